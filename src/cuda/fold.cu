// The fold half of the canonical cross-row reduction on CUDA (numerics 6.5):
// every output element is an ascending chain over its FP32 partials, from
// +0.0 or (the continued folds of the SP region's chain) from a given FP32
// running sum, rounded once to the output dtype. One thread per output
// element, so the launch geometry never touches an order.
//   fold_segment_partials: out[r, j] over row r's segments (ascending chunk);
//                          rows without segments are exactly +0.0.
//   fold_chunk_partials:   out[j] over chunks c = 0, 1, ...
//   continue_segment_fold / continue_chunk_fold: the same over a range of
//                          segments / the given chunk rows, from running.
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

// Partials a fold thread loads before it adds the first of them. A fold has
// one thread per output element (2688 for the projection's d_x at T = 1:
// under one warp per SM), so its speed is the loads each thread keeps in
// flight; the adds stay one ascending chain, so the bits do not change.
constexpr int kFoldAhead = 32;

// acc + value(0) + value(1) + ... + value(count - 1), one FP32 add at a time in
// that order, with kFoldAhead values loaded before the first of them is added.
template <typename Value>
__device__ float add_ascending(float acc, int64_t count, Value value) {
  int64_t i = 0;
  for (; i + kFoldAhead <= count; i += kFoldAhead) {
    float v[kFoldAhead];
#pragma unroll
    for (int u = 0; u < kFoldAhead; ++u) v[u] = value(i + u);
#pragma unroll
    for (int u = 0; u < kFoldAhead; ++u) acc = num::add32(acc, v[u]);
  }
  for (; i < count; ++i) acc = num::add32(acc, value(i));
  return acc;
}

// The first k in [lo, hi) with ids[k] >= value (ids ascending), else hi.
__device__ int32_t lower_bound(const int32_t* ids, int32_t lo, int32_t hi, int64_t value) {
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (ids[mid] < value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Row r's segments g in [first, end) (one run: a row's segment ids ascend),
// partial row g - first; running (R, W) or nullptr (+0.0).
template <typename Out>
__global__ void fold_segment_partials_kernel(const float* partials, int64_t partial_stride,  // (end - first, W)
                                             int64_t first, int64_t end,
                                             const int32_t* row_segment_begin,              // (R+1,)
                                             const int32_t* row_segments,                   // (G,)
                                             const float* running, int64_t running_stride,  // (R, W) or nullptr
                                             Out* out, int64_t out_stride,                  // (R, W)
                                             int64_t rows, int64_t width) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // (r, j) of (R, W)
  if (i >= rows * width) return;
  const int64_t r = i / width, j = i % width;
  const float start = running != nullptr ? running[r * running_stride + j] : 0.0f;
  const int32_t last = row_segment_begin[r + 1];
  // Row r's segments in [first, end): [k0, stop) of row_segments (ascending ids).
  const int32_t k0 = lower_bound(row_segments, row_segment_begin[r], last, first);
  const int32_t stop = lower_bound(row_segments, k0, last, end);
  const float acc = add_ascending(
      start, stop - k0, [&](int64_t u) { return partials[(row_segments[k0 + u] - first) * partial_stride + j]; });
  out[r * out_stride + j] = from_float<Out>(acc);
}

template <typename Out>
__global__ void fold_chunk_partials_kernel(const float* partials, int64_t partial_stride, int64_t chunks,  // (C, W)
                                           const float* running, int64_t running_stride,  // (W,) or nullptr
                                           Out* out, int64_t out_stride, int64_t width) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= width) return;
  const float start = running != nullptr ? running[j * running_stride] : 0.0f;
  const float acc = add_ascending(start, chunks, [&](int64_t c) { return partials[c * partial_stride + j]; });
  out[j * out_stride] = from_float<Out>(acc);
}

Status segment_fold(const IndexPlan& plan, const TensorView& partials, int64_t first, const TensorView& running,
                    const TensorView& out, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(out.device));
  const int64_t rows = out.shape[0], width = out.shape[1];
  if (rows * width == 0) return Status();
  const PlanTables& tables = plan.device_tables();
  const int threads = launch_tuning().elementwise_threads;
  const float* start = running.present() ? running.ptr<const float>() : nullptr;
  const int64_t start_stride = running.present() ? running.strides[0] : 0;
  return dispatch_float_dtype(out.dtype, [&](auto tag) {
    using Out = decltype(tag);
    fold_segment_partials_kernel<Out><<<blocks_for(rows * width, threads), threads, 0, as_cuda_stream(stream)>>>(
        partials.ptr<const float>(), partials.strides[0], first, first + partials.shape[0], tables.row_segment_begin,
        tables.row_segments, start, start_stride, out.ptr<Out>(), out.strides[0], rows, width);
    return launch_status("fold_segment_partials_kernel");
  });
}

Status chunk_fold(const TensorView& partials, const TensorView& running, const TensorView& out, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(out.device));
  const int64_t chunks = partials.shape[0], width = partials.shape[1];
  if (width == 0) return Status();
  const int threads = launch_tuning().elementwise_threads;
  const int64_t out_stride = out.strides[out.rank - 1];
  const float* start = running.present() ? running.ptr<const float>() : nullptr;
  const int64_t start_stride = running.present() ? running.strides[running.rank - 1] : 0;
  return dispatch_float_dtype(out.dtype, [&](auto tag) {
    using Out = decltype(tag);
    fold_chunk_partials_kernel<Out><<<blocks_for(width, threads), threads, 0, as_cuda_stream(stream)>>>(
        partials.ptr<const float>(), partials.strides[0], chunks, start, start_stride, out.ptr<Out>(), out_stride,
        width);
    return launch_status("fold_chunk_partials_kernel");
  });
}

}  // namespace

Status fold_segment_partials(const IndexPlan& plan, const TensorView& partials, const TensorView& out,
                             Stream stream) {
  return segment_fold(plan, partials, 0, TensorView(), out, stream);
}

Status fold_chunk_partials(const TensorView& partials, const TensorView& out, Stream stream) {
  return chunk_fold(partials, TensorView(), out, stream);
}

Status continue_segment_fold(const IndexPlan& plan, const TensorView& partials, int64_t first,
                             const TensorView& running, const TensorView& out, Stream stream) {
  return segment_fold(plan, partials, first, running, out, stream);
}

Status continue_chunk_fold(const TensorView& partials, const TensorView& running, const TensorView& out,
                           Stream stream) {
  return chunk_fold(partials, running, out, stream);
}

}  // namespace cuda
}  // namespace detdit
