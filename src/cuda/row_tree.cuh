// The RMSNorm row tree on the device (docs/numerics.md 7), equal bit for bit
// to the host emulation row_tree_sum in src/common/row_tree.h: one block of
// 128 threads (4 warps) per row; thread t has already accumulated its
// 4-element vectors t, t+128, ... with fma from +0.0; this finishes the sum.
#pragma once

#include "common/row_tree.h"
#include "common/scalar_math.h"
#include "cuda/cuda_util.cuh"

namespace detdit {
namespace cuda {

// Shuffle-down warp tree (lane 0 ends with the warp sum; lanes whose partner
// is past the end never feed lane 0), then total = (W0 + W2) + (W1 + W3).
// The row's 4 warps call it together, `warp` their index 0..3 among them and
// `sync` a barrier of exactly these warps; each gets the total. `shared` holds
// kRowTreeWarps floats.
template <typename Sync>
__device__ __forceinline__ float row_tree_sum(float lane_sum, float* shared, int warp, Sync sync) {
  for (int offset = 16; offset >= 1; offset /= 2)
    lane_sum = num::add32(lane_sum, __shfl_down_sync(kFullMask, lane_sum, offset));
  if (threadIdx.x % kWarpSize == 0) shared[warp] = lane_sum;
  sync();
  const float total = num::add32(num::add32(shared[0], shared[2]), num::add32(shared[1], shared[3]));
  sync();  // shared may be reused by the caller's next tree
  return total;
}

// The tree of a block of exactly the row's 128 threads.
__device__ __forceinline__ float row_tree_block_sum(float lane_sum, float* shared) {
  return row_tree_sum(lane_sum, shared, static_cast<int>(threadIdx.x) / kWarpSize, [] { __syncthreads(); });
}

}  // namespace cuda
}  // namespace detdit
