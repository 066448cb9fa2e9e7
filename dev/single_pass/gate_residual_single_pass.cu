// gate_residual's single-pass backward on CUDA: not built. It was reached from
// src/gate_residual.cc's gate_rows_and_partials through the CUDA-only op
// gate_residual_backward_single_pass, behind the launch tunable single_pass
// (off by default), and lived in src/cuda/gate_residual.cu beside the halves'
// kernels, whose helpers (load_elems, store_elems, chunk_local_segments,
// rowwise::gated_grad, rowwise::gate_grad_step) it uses. dev/README.md gives
// its measured result.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/rowwise_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/reduction.cuh"

namespace detdit {
namespace cuda {
namespace {
// The single-pass backward: a block owns one chunk and kThreads * kCols columns
// and walks the chunk's positions in ascending order; each position's grad and
// y are read once and give d_residual (a copy), d_y and the step of the d_gate
// chain of the position's segment (shared memory, this thread's columns only:
// no barrier after set-up). Positions are loaded kAhead at a time, so several
// rows are in flight before the first is used. Bits: the two halves' (each
// chain ascending over its segment's positions). grid (chunk, column block);
// dynamic shared memory: (chunk's segments, kCols, kThreads) floats.
constexpr int kAhead = 4;

struct GateSinglePassArgs {
  const void* grad;        // (M, H)
  const void* y;           // (M, H)
  const void* gate;        // (R, H) row stride gate_stride
  int64_t gate_stride;
  void* d_residual;        // (M, H), or nullptr
  void* d_y;               // (M, H), or nullptr
  PlanTables tables;
  int64_t seq_len, positions, hidden;
  float* partials;         // (G, H) contiguous, or nullptr
};

template <typename T, int kCols, bool kVector>
__global__ void gate_residual_backward_single_pass_kernel(GateSinglePassArgs a) {
  extern __shared__ float segment_sums[];            // [local segment][column e][thread]
  __shared__ int32_t local_segment[kReductionChunk];  // chunk position q -> its segment, 0-based in the chunk
  const int64_t chunk = blockIdx.x;
  const int32_t first = a.tables.chunk_segment_begin[chunk], last = a.tables.chunk_segment_begin[chunk + 1];
  const int64_t begin = chunk * kReductionChunk;
  const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
  chunk_local_segments(a.tables, chunk, begin, end, a.seq_len, local_segment);
  const int threads = static_cast<int>(blockDim.x);
  for (int i = threadIdx.x; i < (last - first) * kCols * threads; i += threads) segment_sums[i] = 0.0f;
  __syncthreads();
  const int64_t i0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kCols;
  if (i0 >= a.hidden) return;
  for (int64_t p0 = begin; p0 < end; p0 += kAhead) {
    float gv[kAhead][kCols], yv[kAhead][kCols];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (p0 + u >= end) break;
      load_elems<T, kCols, kVector>(static_cast<const T*>(a.grad) + (p0 + u) * a.hidden + i0, gv[u]);
      load_elems<T, kCols, kVector>(static_cast<const T*>(a.y) + (p0 + u) * a.hidden + i0, yv[u]);
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t p = p0 + u;
      if (p >= end) break;
      const int32_t local = local_segment[p - begin];
      const int64_t r = a.tables.segment_row[first + local];  // the position's row is its segment's
      if (a.d_residual) store_elems<T, kCols, kVector>(static_cast<T*>(a.d_residual) + p * a.hidden + i0, gv[u]);
      if (a.d_y) {
        float g[kCols], d_y[kCols];
        load_elems<T, kCols, kVector>(static_cast<const T*>(a.gate) + r * a.gate_stride + i0, g);
#pragma unroll
        for (int e = 0; e < kCols; ++e) d_y[e] = rowwise::gated_grad(gv[u][e], g[e]);
        store_elems<T, kCols, kVector>(static_cast<T*>(a.d_y) + p * a.hidden + i0, d_y);
      }
      if (a.partials) {
        float* sums = segment_sums + local * kCols * threads + threadIdx.x;
#pragma unroll
        for (int e = 0; e < kCols; ++e) sums[e * threads] = rowwise::gate_grad_step(gv[u][e], yv[u][e], sums[e * threads]);
      }
    }
  }
  if (!a.partials) return;
  for (int32_t g = 0; g < last - first; ++g) {
    const float* sums = segment_sums + g * kCols * threads + threadIdx.x;
    float* dst = a.partials + (first + g) * a.hidden + i0;  // (H,)
#pragma unroll
    for (int e = 0; e < kCols; ++e) dst[e] = sums[e * threads];
  }
}

int64_t hidden_of(const TensorView& t) { return t.shape[t.rank - 1]; }

}  // namespace

Status gate_residual_backward_single_pass(const GateResidualBackwardParams& p, const TensorView& partials, Stream stream,
                                         bool* launched) {
  *launched = false;
  if (!launch_tuning().single_pass) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.grad.device));
  GateSinglePassArgs a{};
  a.grad = p.grad.data;
  a.y = p.in.y.data;
  a.gate = p.in.gate.data;
  a.gate_stride = p.in.gate.strides[0];
  a.d_residual = p.d_residual.present() ? p.d_residual.data : nullptr;
  a.d_y = p.d_y.present() ? p.d_y.data : nullptr;
  a.tables = p.in.plan.device_tables();
  a.seq_len = p.in.plan.seq_len();
  a.positions = p.in.plan.positions();
  a.hidden = hidden_of(p.grad);
  a.partials = partials.present() ? partials.ptr<float>() : nullptr;
  if (a.positions == 0 || a.hidden == 0) {
    *launched = true;
    return Status();
  }
  constexpr int kThreads = 128, kCols = 4;
  const std::size_t shared_bytes =
      static_cast<std::size_t>(p.in.plan.max_chunk_segments()) * kCols * kThreads * sizeof(float);
  // The static local_segment table shares the 48 KiB a block gets without an
  // opt-in; more segments than fit beside it: the halves.
  if (shared_bytes + kReductionChunk * sizeof(int32_t) > 48 * 1024) return Status();
  const dim3 grid(static_cast<unsigned>(p.in.plan.num_chunks()), blocks_for(a.hidden, kThreads * kCols));
  const cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(p.grad.dtype, [&](auto tag) {
    using T = decltype(tag);
    const std::size_t bytes = kCols * sizeof(T);
    bool vector = a.hidden % kCols == 0 && a.gate_stride % kCols == 0;
    for (const void* q : {a.grad, a.y, a.gate, const_cast<const void*>(a.d_residual), const_cast<const void*>(a.d_y)})
      if (q && !address_aligned(q, bytes)) vector = false;
    if (a.hidden % kCols != 0) return Status();  // a partial vector per row: the halves
    if (vector)
      gate_residual_backward_single_pass_kernel<T, kCols, true><<<grid, kThreads, shared_bytes, s>>>(a);
    else
      gate_residual_backward_single_pass_kernel<T, kCols, false><<<grid, kThreads, shared_bytes, s>>>(a);
    *launched = true;
    return launch_status("gate_residual_backward_single_pass_kernel");
  });
}

}  // namespace cuda
}  // namespace detdit
