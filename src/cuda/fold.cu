// The fold half of the canonical cross-row reduction on CUDA (numerics 6.5):
// every output element is an ascending chain over its FP32 partials, from
// +0.0 or (the continued folds of the SP region's chain) from a given FP32
// running sum, rounded once to the output dtype. Each chain is added by one
// thread in ascending order; the launch geometry only decides who loads the
// partials, never an order.
//   fold_segment_partials: out[r, j] over row r's segments (ascending chunk),
//                          one thread per output element; rows without
//                          segments are exactly +0.0.
//   fold_chunk_partials:   out[j] over chunks c = 0, 1, ...: one thread per
//                          column for at most kTileRows chunks, else blocks of
//                          kTileColumns columns whose kTileWarps warps stage
//                          the partials through shared memory for one adding
//                          warp (chunk_fold says why).
//   continue_segment_fold / continue_chunk_fold: the same over a range of
//                          segments / the given chunk rows, from running.
//   fold_group_partials:   the grouped modulation forms' fold: each group's
//                          own chunk partials, one thread per (group, column).
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/modulation_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

// Partials a fold thread loads before it adds the first of them. The segment
// fold and the per-column chunk fold have one thread per output element, so
// their speed is the loads each thread keeps in flight; the adds stay one
// ascending chain, so the bits do not change.
constexpr int kFoldAhead = 32;

// The chunk fold's tiles (fold_chunk_partials_tiled_kernel): a block of
// kTileWarps warps owns kTileColumns consecutive columns and walks the chunks
// in stages of kTileRows rows.
constexpr int kTileColumns = kWarpSize;  // one column per lane: a warp's copy of a row is 128 contiguous bytes
constexpr int kTileWarps = 8;            // copying warps per block; warp 0 also adds
constexpr int kTileThreads = kTileWarps * kWarpSize;
constexpr int kTileRows = 64;            // chunk rows per stage
constexpr int kTileRowsPerWarp = kTileRows / kTileWarps;
// Stages in a block's shared ring (8 KB each): the copies of kTileStages - 1
// stages (192 rows, 24 KB) are in flight while warp 0 adds one. 32 KB a block
// lets 6 blocks share an H200 SM (228 KB), so the largest d_x fold (T = 8:
// 21504 columns, 672 blocks) is resident at once on 132 SMs.
constexpr int kTileStages = 4;
static_assert(kTileRows % kTileWarps == 0, "every warp copies the same number of a stage's rows");

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

// The same chains as fold_chunk_partials_kernel, staged through shared memory:
// block b owns columns j = b * kTileColumns + lane. Stage s is chunk rows
// c = s * kTileRows + r, r in [0, kTileRows): warp w copies rows
// r = w * kTileRowsPerWarp + i (lane = column) into ring buffer
// s % kTileStages, and warp 0 (lane = column) adds the stage's rows in
// ascending r to its column's accumulator, which stays in its register from
// start to the rounding. The copies run kTileStages - 1 stages ahead of the
// adds. Columns >= width are neither copied nor added nor stored.
template <typename Out>
__global__ void __launch_bounds__(kTileThreads)
    fold_chunk_partials_tiled_kernel(const float* partials, int64_t partial_stride, int64_t chunks,  // (C, W)
                                     const float* running, int64_t running_stride,  // (W,) or nullptr
                                     Out* out, int64_t out_stride, int64_t width) {
  __shared__ float tile[kTileStages][kTileRows][kTileColumns];  // [s % kTileStages][r][lane]
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kTileColumns + lane;  // column of (C, W)
  const bool in_width = j < width;
  const bool adds = warp == 0 && in_width;
  const int64_t stages = (chunks + kTileRows - 1) / kTileRows;
  // This thread's copies of stage s (none past the last stage, the last chunk
  // or the width), then one commit: every thread commits one group per stage,
  // so __pipeline_wait_prior counts stages.
  const auto copy_stage = [&](int64_t s) {
    if (s < stages && in_width) {
      const int64_t c0 = s * kTileRows + warp * kTileRowsPerWarp;  // chunk of this warp's first row
      float* dst = &tile[s % kTileStages][warp * kTileRowsPerWarp][lane];
#pragma unroll
      for (int i = 0; i < kTileRowsPerWarp; ++i)
        if (c0 + i < chunks)  // cp.async: the copy holds no register while in flight
          __pipeline_memcpy_async(dst + i * kTileColumns, partials + (c0 + i) * partial_stride + j, sizeof(float));
    }
    __pipeline_commit();
  };
  float acc = 0.0f;
  if (adds && running != nullptr) acc = running[j * running_stride];
  for (int s = 0; s < kTileStages - 1; ++s) copy_stage(s);
  for (int64_t s = 0; s < stages; ++s) {
    __pipeline_wait_prior(kTileStages - 2);  // this thread's copies of stage s have landed
    // After the barrier every thread's copies of stage s are visible, and warp
    // 0 has added stage s - 1, whose buffer ((s - 1) % kTileStages) the next
    // line refills with stage s + kTileStages - 1.
    __syncthreads();
    copy_stage(s + kTileStages - 1);
    if (adds) {
      const float(*rows)[kTileColumns] = tile[s % kTileStages];  // [r][lane]
      const int64_t left = chunks - s * kTileRows;
      if (left >= kTileRows) {
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) acc = num::add32(acc, rows[r][lane]);
      } else {
        for (int r = 0; r < left; ++r) acc = num::add32(acc, rows[r][lane]);
      }
    }
  }
  if (adds) out[j * out_stride] = from_float<Out>(acc);
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
  // Which kernel loads (both give the same bits, and both read every partial
  // once): the speed is the loads in flight. One thread per column keeps at
  // most kFoldAhead of its column's partials in flight, on width / threads
  // blocks (the T = 1 d_x fold, 1512 chunks of 2688 columns: 11 blocks on 11
  // SMs, 52 us); a tile block keeps (kTileStages - 1) * kTileRows rows of its
  // kTileColumns columns in flight, on width / kTileColumns blocks. So the
  // tiles for more than kTileRows chunks. With at most kTileRows chunks a tile
  // block has one stage and nothing to overlap, while a column's thread needs
  // at most two look-ahead batches: one thread per column, 8 times fewer
  // threads and no 32 KB of shared memory per 32 columns, the cheaper launch
  // for the wide and shallow folds (many columns, few chunks).
  const cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(out.dtype, [&](auto tag) {
    using Out = decltype(tag);
    if (chunks > kTileRows) {
      fold_chunk_partials_tiled_kernel<Out><<<blocks_for(width, kTileColumns), kTileThreads, 0, s>>>(
          partials.ptr<const float>(), partials.strides[0], chunks, start, start_stride, out.ptr<Out>(), out_stride,
          width);
      return launch_status("fold_chunk_partials_tiled_kernel");
    }
    fold_chunk_partials_kernel<Out><<<blocks_for(width, threads), threads, 0, s>>>(
        partials.ptr<const float>(), partials.strides[0], chunks, start, start_stride, out.ptr<Out>(), out_stride,
        width);
    return launch_status("fold_chunk_partials_kernel");
  });
}

template <typename Out>
__global__ void fold_group_partials_kernel(const float* partials, int64_t partial_stride, int64_t per_group,
                                           int64_t width, int64_t groups, ModulationOperand out, int64_t frames) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= groups * width) return;
  const int64_t g = t / width, j = t % width;
  const float* first = partials + g * per_group * partial_stride + j;
  const float acc = add_ascending(0.0f, per_group, [&](int64_t c) { return first[c * partial_stride]; });
  static_cast<Out*>(const_cast<void*>(out.data))[group_offset(out, frames, g) + j] = from_float<Out>(acc);
}

}  // namespace

Status fold_group_partials(const TensorView& partials, int64_t per_group, const ResolvedModulation& mod,
                           const TensorView& out, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(out.device));
  const int64_t width = partials.shape[1], total = mod.groups() * width;
  if (total == 0) return Status();
  const int threads = launch_tuning().elementwise_threads;
  const cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(out.dtype, [&](auto tag) {
    using Out = decltype(tag);
    fold_group_partials_kernel<Out><<<blocks_for(total, threads), threads, 0, s>>>(
        partials.ptr<const float>(), partials.strides[0], per_group, width, mod.groups(),
        modulation_operand(out, mod), mod.frames);
    return launch_status("fold_group_partials_kernel");
  });
}

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
