// adaln_table_add and column_chunk_partials on CUDA (src/common/backends.h),
// bitwise equal to src/cpu/adaln_table_add.cc:
//   forward / backward_proj: one thread per output element, the same single
//   rounded add (or, broadcast, the same ascending chain over k) as the CPU;
//   element-local, so the geometry never changes a bit.
//   column_chunk_partials: one thread per (chunk, column), the ascending chain
//   over the chunk's rows; adjacent threads read adjacent columns.
// Dtypes are switched per element (the three float storage types): the ops
// move a few (T, K, H) tensors, not worth 27 instantiations.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/tuning.h"
#include "detdit/plan.h"

namespace detdit {
namespace cuda {
namespace {

__device__ __forceinline__ float load_widened(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16: return to_float(static_cast<const Bf16*>(base)[i]);
    case DType::kF16: return to_float(static_cast<const F16*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

__device__ __forceinline__ void store_rounded(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kBF16: static_cast<Bf16*>(base)[i] = from_float<Bf16>(v); break;
    case DType::kF16: static_cast<F16*>(base)[i] = from_float<F16>(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

__global__ void table_add_kernel(const void* table, DType td, const void* proj, DType pd, void* out, DType od,
                                 int64_t k, int64_t hidden, bool broadcast, int64_t elements) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= elements) return;
  const int64_t j = i % (k * hidden), t = i / (k * hidden);
  const int64_t pi = broadcast ? t * hidden + j % hidden : i;
  store_rounded(out, od, i, num::add32(load_widened(table, td, j), load_widened(proj, pd, pi)));
}

__global__ void table_add_proj_grad_kernel(const void* grad, DType gd, void* d_proj, DType dd, int64_t k,
                                           int64_t hidden, bool broadcast, int64_t elements) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= elements) return;
  if (!broadcast) {
    store_rounded(d_proj, dd, i, load_widened(grad, gd, i));
    return;
  }
  const int64_t t = i / hidden, h = i % hidden;
  float acc = 0.0f;
  for (int64_t c = 0; c < k; ++c) acc = num::add32(acc, load_widened(grad, gd, (t * k + c) * hidden + h));
  store_rounded(d_proj, dd, i, acc);
}

__global__ void column_chunk_partials_kernel(const void* src, DType sd, float* partials, int64_t rows, int64_t width,
                                             int64_t chunks) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks * width) return;
  const int64_t c = i / width, j = i % width;
  const int64_t begin = c * kReductionChunk, end = rows < begin + kReductionChunk ? rows : begin + kReductionChunk;
  float acc = 0.0f;
  for (int64_t r = begin; r < end; ++r) acc = num::add32(acc, load_widened(src, sd, r * width + j));
  partials[i] = acc;
}

}  // namespace

Status adaln_table_add_forward(const AdalnTableAddParams& p, Stream stream) {
  const int64_t elements = p.out.numel();
  if (elements == 0) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.out.device));
  const int threads = launch_tuning().elementwise_threads;
  const int64_t k = p.out.shape[1], hidden = p.out.shape[2];
  table_add_kernel<<<blocks_for(elements, threads), threads, 0, as_cuda_stream(stream)>>>(
      p.table.data, p.table.dtype, p.proj.data, p.proj.dtype, p.out.data, p.out.dtype, k, hidden,
      p.proj.shape[1] == 1 && k != 1, elements);
  return launch_status("table_add_kernel");
}

Status adaln_table_add_backward_proj(const AdalnTableAddBackwardParams& p, Stream stream) {
  const int64_t elements = p.d_proj.numel();
  if (elements == 0) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.d_proj.device));
  const int threads = launch_tuning().elementwise_threads;
  const int64_t k = p.grad.shape[1], hidden = p.grad.shape[2];
  table_add_proj_grad_kernel<<<blocks_for(elements, threads), threads, 0, as_cuda_stream(stream)>>>(
      p.grad.data, p.grad.dtype, p.d_proj.data, p.d_proj.dtype, k, hidden, p.d_proj.shape[1] == 1 && k != 1,
      elements);
  return launch_status("table_add_proj_grad_kernel");
}

Status column_chunk_partials(const TensorView& src, const TensorView& partials, Stream stream) {
  const int64_t rows = src.shape[0], chunks = partials.shape[0], width = partials.shape[1];
  if (chunks * width == 0) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(partials.device));
  const int threads = launch_tuning().elementwise_threads;
  column_chunk_partials_kernel<<<blocks_for(chunks * width, threads), threads, 0, as_cuda_stream(stream)>>>(
      src.data, src.dtype, partials.ptr<float>(), rows, width, chunks);
  return launch_status("column_chunk_partials_kernel");
}

}  // namespace cuda
}  // namespace detdit
