// The row reduction tree of RMSNorm, host emulation.
//
// detdit replays PyTorch's vectorized RMSNorm statistics (torch 2.11,
// vectorized_layer_norm_kernel<T, float, rms_norm=true>): one block of 128
// threads per row, laid out as 4 warps of 32 lanes (thread = lane + 32*warp).
//   1. thread t walks 4-element vectors j = t, t+128, t+256, ... < H/4 and, for
//      e = 0..3 in order, does s = fma(a[4j+e], b[4j+e], s) from s = +0.0;
//   2. each warp reduces with a shuffle-DOWN tree, offsets 16, 8, 4, 2, 1:
//      lane l takes s_l + s_{l+off} (lanes past the end keep their value);
//      lane 0 holds the warp sum W_w;
//   3. total = (W0 + W2) + (W1 + W3).
// The forward statistics use a = b = x (sum of squares); the backward dot of
// dx uses a = rn(w * d_n), b = x. src/cuda/ implements the same tree with real
// warp shuffles; this function is its definition on the host.
#pragma once

#include <cstdint>

#include "common/scalar_math.h"

namespace detdit {

constexpr int kRowTreeThreads = 128;
constexpr int kRowTreeWarps = 4;
constexpr int kRowTreeVector = 4;

// term(i, &a, &b) supplies the FP32 operands of element i in [0, hidden).
template <typename Term>
float row_tree_sum(int64_t hidden, Term&& term) {
  float lane_sum[kRowTreeThreads];
  const int64_t vectors = hidden / kRowTreeVector;
  for (int t = 0; t < kRowTreeThreads; ++t) {
    float s = 0.0f;
    for (int64_t j = t; j < vectors; j += kRowTreeThreads) {
      for (int e = 0; e < kRowTreeVector; ++e) {
        float a, b;
        term(j * kRowTreeVector + e, &a, &b);
        s = num::fma32(a, b, s);
      }
    }
    lane_sum[t] = s;
  }
  float warp_sum[kRowTreeWarps];
  for (int w = 0; w < kRowTreeWarps; ++w) {
    float* v = lane_sum + 32 * w;
    for (int offset = 16; offset >= 1; offset /= 2)
      for (int l = 0; l + offset < 32; ++l) v[l] = num::add32(v[l], v[l + offset]);
    warp_sum[w] = v[0];
  }
  return num::add32(num::add32(warp_sum[0], warp_sum[2]), num::add32(warp_sum[1], warp_sum[3]));
}

}  // namespace detdit
