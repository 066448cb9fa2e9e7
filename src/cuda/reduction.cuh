// Shared pieces of the partials half of the canonical reduction on CUDA
// (numerics 6.5, backends.h ChunkSelection / ExtraRows): where a selected
// chunk's segment partials go, each position's segment within its chunk, and
// where the data row of a position lives.
#pragma once

#include <cstdint>

#include "common/rowwise_math.h"
#include "cuda/cuda_util.cuh"
#include "detdit/plan.h"

namespace detdit {
namespace cuda {

// Positions a partials kernel loads before it uses the first: the chains are
// sequential, their loads are not, so a thread keeps this many rows' loads in
// flight instead of one.
constexpr int kPartialsAhead = 8;

// Output row of the first segment of selected chunk k (chunk id `chunk`): the
// segment counts of the selected chunks before it, an exact integer sum, so
// its order does not matter. Every thread of the block must call it; `shared`
// holds one int per warp.
__device__ __forceinline__ int64_t selected_segment_offset(const PlanTables& tables, const int32_t* chunks,
                                                           int64_t k, int64_t chunk, int* shared) {
  if (!chunks) return tables.chunk_segment_begin[chunk];
  int count = 0;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x)
    count += tables.chunk_segment_begin[chunks[i] + 1] - tables.chunk_segment_begin[chunks[i]];
  for (int offset = 16; offset >= 1; offset /= 2) count += __shfl_down_sync(kFullMask, count, offset);
  if (threadIdx.x % kWarpSize == 0) shared[threadIdx.x / kWarpSize] = count;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) total += shared[w];
  return total;
}

// local_segment[p - begin] for the positions [begin, end) of `chunk`: the
// position's segment, 0-based in the chunk (one segment per table row present,
// in plan order). Block-strided; the caller synchronises before reading it.
__device__ __forceinline__ void chunk_local_segments(const PlanTables& tables, int64_t chunk, int64_t begin,
                                                     int64_t end, int64_t seq_len, int32_t* local_segment) {
  const int32_t first = tables.chunk_segment_begin[chunk];
  for (int64_t q = threadIdx.x; q < end - begin; q += blockDim.x) {
    const int32_t row = rowwise::table_row(tables.row_of_seq, begin + q, seq_len);
    int32_t g = first;
    while (tables.segment_row[g] != row) ++g;
    local_segment[q] = g - first;
  }
}

// Row of global position p: r >= 0 is row r of the op's own tensors; r < 0 is
// row -1 - r of the ExtraRows tensors (position_row nullptr: row p, own).
__device__ __forceinline__ int64_t data_row(const int32_t* position_row, int64_t p) {
  return position_row ? position_row[p] : p;
}

}  // namespace cuda
}  // namespace detdit
