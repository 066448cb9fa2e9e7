// The fold half of the canonical cross-row reduction on CUDA (numerics 6.5):
// every output element is an ascending chain from +0.0 over its FP32
// partials, rounded once to the output dtype. One thread per output element,
// so the launch geometry never touches an order.
//   fold_segment_partials: out[r, j] over row r's segments (ascending chunk);
//                          rows without segments are exactly +0.0.
//   fold_chunk_partials:   out[j] over chunks c = 0, 1, ...
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

template <typename Out>
__global__ void fold_segment_partials_kernel(const float* partials, int64_t partial_stride,  // (G, W)
                                             const int32_t* row_segment_begin,              // (R+1,)
                                             const int32_t* row_segments,                   // (G,)
                                             Out* out, int64_t out_stride,                  // (R, W)
                                             int64_t rows, int64_t width) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // (r, j) of (R, W)
  if (i >= rows * width) return;
  const int64_t r = i / width, j = i % width;
  float acc = 0.0f;
  for (int32_t k = row_segment_begin[r]; k < row_segment_begin[r + 1]; ++k)
    acc = num::add32(acc, partials[row_segments[k] * partial_stride + j]);
  out[r * out_stride + j] = from_float<Out>(acc);
}

template <typename Out>
__global__ void fold_chunk_partials_kernel(const float* partials, int64_t partial_stride, int64_t chunks,  // (C, W)
                                           Out* out, int64_t out_stride, int64_t width) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= width) return;
  float acc = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) acc = num::add32(acc, partials[c * partial_stride + j]);
  out[j * out_stride] = from_float<Out>(acc);
}

}  // namespace

Status fold_segment_partials(const IndexPlan& plan, const TensorView& partials, const TensorView& out,
                             Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(out.device));
  const int64_t rows = out.shape[0], width = out.shape[1];
  if (rows * width == 0) return Status();
  const PlanTables& tables = plan.device_tables();
  const int threads = launch_tuning().elementwise_threads;
  return dispatch_float_dtype(out.dtype, [&](auto tag) {
    using Out = decltype(tag);
    fold_segment_partials_kernel<Out><<<blocks_for(rows * width, threads), threads, 0, as_cuda_stream(stream)>>>(
        partials.ptr<const float>(), partials.strides[0], tables.row_segment_begin, tables.row_segments,
        out.ptr<Out>(), out.strides[0], rows, width);
    return launch_status("fold_segment_partials_kernel");
  });
}

Status fold_chunk_partials(const TensorView& partials, const TensorView& out, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(out.device));
  const int64_t chunks = partials.shape[0], width = partials.shape[1];
  if (width == 0) return Status();
  const int threads = launch_tuning().elementwise_threads;
  const int64_t out_stride = out.strides[out.rank - 1];
  return dispatch_float_dtype(out.dtype, [&](auto tag) {
    using Out = decltype(tag);
    fold_chunk_partials_kernel<Out><<<blocks_for(width, threads), threads, 0, as_cuda_stream(stream)>>>(
        partials.ptr<const float>(), partials.strides[0], chunks, out.ptr<Out>(), out_stride, width);
    return launch_status("fold_chunk_partials_kernel");
  });
}

}  // namespace cuda
}  // namespace detdit
