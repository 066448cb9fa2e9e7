// adaln_row_gather on CUDA (numerics 5.5, 6.6):
//   forward:  out[c, s, :] = rows[row(s), c*H : (c+1)*H], a byte copy in the
//             widest access (16, 8, 4 or 2 bytes) that H, the row stride and
//             both pointers allow; the width never changes a byte.
//   backward: d_rows[r, j] (j = c*H + h) by the canonical reduction: the
//             segment partials here (an ascending chain over each segment's
//             positions of grad[c, p, h], one thread per column), then the
//             public adaln_row_gather_backward folds them (src/adaln.cc:
//             fold_segment_partials, ascending chunk, cast once).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

template <int kBytes>
__global__ void adaln_row_gather_copy_kernel(const char* rows, int64_t row_stride_bytes,  // (R, 6H)
                                             const int32_t* row_of_seq,                   // (S,)
                                             char* out,                                   // (6, S, H)
                                             int64_t seq_len, int64_t chunk_bytes) {
  using Raw = typename RawVec<kBytes>::Type;
  const int64_t per_row = chunk_bytes / kBytes;  // vectors per (c, s) output row
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= kAdalnChunks * seq_len * per_row) return;
  const int64_t cs = i / per_row, v = i % per_row;  // output row (c, s) of (6, S), vector v
  const int64_t c = cs / seq_len, s = cs % seq_len;
  const char* src = rows + row_of_seq[s] * row_stride_bytes + c * chunk_bytes + v * kBytes;
  *reinterpret_cast<Raw*>(out + i * kBytes) = *reinterpret_cast<const Raw*>(src);
}

// grid (segment g, column block); d_partials[g, j] = chain over g's positions.
template <typename T>
__global__ void adaln_row_gather_partials_kernel(const T* grad,  // (6, P, H)
                                                 PlanTables tables, int64_t positions, int64_t hidden,
                                                 float* partials) {  // (G, 6H)
  const int64_t g = blockIdx.x;
  const int64_t width = kAdalnChunks * hidden;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;  // column of (6H,)
  if (j >= width) return;
  const int64_t c = j / hidden, h = j % hidden;
  const T* column = grad + c * positions * hidden + h;  // grad[c, :, h]
  float acc = 0.0f;
  for (int32_t q = tables.segment_pos_begin[g]; q < tables.segment_pos_begin[g + 1]; ++q)
    acc = num::add32(acc, to_float(column[static_cast<int64_t>(tables.segment_positions[q]) * hidden]));
  partials[g * width + j] = acc;
}

// Widest access in bytes (<= the tunable) that divides H's bytes, the row
// stride's bytes and both addresses.
int copy_width(const AdalnRowGatherParams& p, int64_t chunk_bytes) {
  const int64_t stride_bytes = p.rows.strides[0] * static_cast<int64_t>(dtype_size(p.rows.dtype));
  for (int bytes = launch_tuning().vector_bytes; bytes > 2; bytes /= 2)
    if (chunk_bytes % bytes == 0 && stride_bytes % bytes == 0 && address_aligned(p.rows.data, bytes) &&
        address_aligned(p.out.data, bytes))
      return bytes;
  return 2;
}

}  // namespace

Status adaln_row_gather_forward(const AdalnRowGatherParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.rows.device));
  const int64_t es = static_cast<int64_t>(dtype_size(p.rows.dtype));
  const int64_t hidden = p.rows.shape[1] / kAdalnChunks;
  const int64_t seq_len = p.plan.seq_len();
  const int64_t chunk_bytes = hidden * es;
  if (chunk_bytes == 0) return Status();
  const int bytes = copy_width(p, chunk_bytes);
  const int64_t vectors = kAdalnChunks * seq_len * (chunk_bytes / bytes);
  const int threads = launch_tuning().elementwise_threads;
  const char* rows = static_cast<const char*>(p.rows.data);
  const int64_t stride_bytes = p.rows.strides[0] * es;
  const int32_t* row_of_seq = p.plan.device_tables().row_of_seq;
  char* out = static_cast<char*>(p.out.data);
  cudaStream_t s = as_cuda_stream(stream);
  const unsigned blocks = blocks_for(vectors, threads);
  switch (bytes) {
    case 16: adaln_row_gather_copy_kernel<16><<<blocks, threads, 0, s>>>(rows, stride_bytes, row_of_seq, out, seq_len, chunk_bytes); break;
    case 8: adaln_row_gather_copy_kernel<8><<<blocks, threads, 0, s>>>(rows, stride_bytes, row_of_seq, out, seq_len, chunk_bytes); break;
    case 4: adaln_row_gather_copy_kernel<4><<<blocks, threads, 0, s>>>(rows, stride_bytes, row_of_seq, out, seq_len, chunk_bytes); break;
    default: adaln_row_gather_copy_kernel<2><<<blocks, threads, 0, s>>>(rows, stride_bytes, row_of_seq, out, seq_len, chunk_bytes); break;
  }
  return launch_status("adaln_row_gather_copy_kernel");
}

Status adaln_row_gather_backward_partials(const AdalnRowGatherBackwardParams& p, const TensorView& partials,
                                          Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.grad.device));
  const int64_t width = p.d_rows.shape[1];
  const int64_t hidden = width / kAdalnChunks;
  const int64_t segments = p.plan.num_segments();
  if (segments == 0 || width == 0) return Status();
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>(segments), blocks_for(width, kThreads));
  return dispatch_float_dtype(p.grad.dtype, [&](auto tag) {
    using T = decltype(tag);
    adaln_row_gather_partials_kernel<T><<<grid, kThreads, 0, as_cuda_stream(stream)>>>(
        p.grad.ptr<const T>(), p.plan.device_tables(), p.plan.positions(), hidden, partials.ptr<float>());
    return launch_status("adaln_row_gather_partials_kernel");
  });
}

}  // namespace cuda
}  // namespace detdit
