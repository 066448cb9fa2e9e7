// LayerNorm's arithmetic, shared by the CPU reference (src/cpu/layernorm.cc)
// and the CUDA kernels (src/cuda/layernorm.cu), so that CPU/GPU equality holds
// by construction for these lines (docs/numerics.md 9).
//
// The statistics replay PyTorch's vectorized_layer_norm_kernel (the path
// F.layer_norm takes for H % 4 == 0 and aligned rows): one block of 128
// threads per row (thread t = lane + 32*warp), each thread folding its
// 4-element vectors t, t+128, ... into a Welford state (mean, m2, count) with
// the reciprocal of the count multiplied in; the warps combine with a
// shuffle-down tree, then (W0 + W2) + (W1 + W3). The dx sums replay
// layer_norm_grad_input_kernel_vectorized: two FP32 sums per thread over the
// same vectors, then PyTorch's BlockReduceSum. Every FMA below is where nvcc's
// default contraction (--fmad=true, which PyTorch is built with) fuses the
// source's a*b + c; detdit writes each one out (its build contracts nothing).
// layernorm_row_stats and layernorm_block_sum are the host definitions of the
// trees; src/cuda/ runs the same trees with warp shuffles.
#pragma once

#include <cstdint>

#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"

namespace detdit {
namespace layernorm {

// A Welford state: FP32 mean, sum of squared deviations m2, and count (an
// integer held in FP32, exact below 2^24).
struct Welford {
  float mean, m2, count;
};

// One element v into the state (PyTorch's cuWelfordOnlineSum):
// delta = rn(v - mean), count' = rn(count + 1), r = rn(1 / count'),
// mean' = fma(delta, r, mean), m2' = fma(delta, rn(v - mean'), m2).
DETDIT_HD Welford welford_step(Welford s, float v) {
  const float delta = num::sub32(v, s.mean);
  const float count = num::add32(s.count, 1.0f);
  const float r = num::div32(1.0f, count);
  const float mean = num::fma32(delta, r, s.mean);
  return Welford{mean, num::fma32(delta, num::sub32(v, mean), s.m2), count};
}

// own <- combine(own, other) (PyTorch's cuWelfordCombine(dataB = own, dataA =
// other)). Executed literally also when a side is empty: n_own = own.count *
// rn(1 / count) need not be exactly 1.
DETDIT_HD Welford welford_combine(Welford own, Welford other) {
  const float delta = num::sub32(own.mean, other.mean);
  const float count = num::add32(other.count, own.count);
  if (!(count > 0.0f)) return Welford{0.0f, 0.0f, count};
  const float coef = num::div32(1.0f, count);
  const float n_other = num::mul32(other.count, coef);
  const float n_own = num::mul32(own.count, coef);
  // n_other*other.mean + n_own*own.mean: the left product fused, the right rounded
  const float mean = num::fma32(n_other, other.mean, num::mul32(n_own, own.mean));
  // (other.m2 + own.m2) + ((delta*delta)*other.count)*n_own: the last product fused
  const float m2 = num::fma32(num::mul32(num::mul32(delta, delta), other.count), n_own, num::add32(other.m2, own.m2));
  return Welford{mean, m2, count};
}

// The row's mean and variance: var = rn(m2 / fp32(H)).
struct RowMoments {
  float mean, var;
};
DETDIT_HD RowMoments moments_of(const Welford& total, int64_t hidden) {
  return RowMoments{total.mean, num::div32(total.m2, static_cast<float>(hidden))};
}

// The cross-warp step of both trees on the 4 warp results:
// (W0 <- W2, W1 <- W3), then W0 <- W1.
DETDIT_HD Welford combine_warps(const Welford (&w)[kRowTreeWarps]) {
  return welford_combine(welford_combine(w[0], w[2]), welford_combine(w[1], w[3]));
}

// The cross-warp step of PyTorch's BlockReduceSum: warp 0 reloads the 4 warp
// sums into lanes 0..3 (+0.0 in lanes 4..31) and runs the shuffle-down tree
// again; lanes 0..3 add +0.0 three times (once is the same: -0.0 becomes +0.0),
// then (W0 + W2) + (W1 + W3).
DETDIT_HD float block_sum_of_warps(const float (&w)[kRowTreeWarps]) {
  float v[kRowTreeWarps];
  for (int i = 0; i < kRowTreeWarps; ++i) v[i] = num::add32(w[i], 0.0f);
  return num::add32(num::add32(v[0], v[2]), num::add32(v[1], v[3]));
}

// ---- per element -----------------------------------------------------------------

// The output before its rounding to T, d = rn(x - mean), p = rn(rstd * d):
// weight and bias: fma(w, p, b); weight alone: rn(w * p); neither: p.
DETDIT_HD float normalised(float x, float mean, float rstd, bool has_weight, float w, bool has_bias, float b) {
  const float p = num::mul32(rstd, num::sub32(x, mean));
  if (!has_weight) return p;
  return has_bias ? num::fma32(w, p, b) : num::mul32(w, p);
}

// One element into a thread's dx sums (w = 1 without a weight):
// s1 = rn(s1 + rn(g * w)); s2 = fma(rn(rn(g * w) * rn(x - mean)), rstd, s2).
// The product g * w feeds both sums and is not fused into s1's add (the
// fused s1 differs from eager's fp32 dx on an H100; with bf16 and fp16
// inputs the product is exact and both readings agree).
struct DxSums {
  float s1, s2;
};
DETDIT_HD DxSums dx_sums_step(DxSums s, float g, float w, float x, float mean, float rstd) {
  return DxSums{num::add32(s.s1, num::mul32(g, w)),
                num::fma32(num::mul32(num::mul32(g, w), num::sub32(x, mean)), rstd, s.s2)};
}

// term1 = rn(rn(1 / fp32(H)) * rstd).
DETDIT_HD float dx_term1(float rstd, int64_t hidden) {
  return num::mul32(num::div32(1.0f, static_cast<float>(hidden)), rstd);
}

// dx before its rounding to T (w = 1 without a weight), fH = fp32(H):
// f = fma(rn(fH * w), g, -rn(rn(rn(x - mean) * rstd) * s2)); f = rn(f - s1);
// return rn(f * term1). (PyTorch's f = fH*w*g; f -= (x - mean)*rstd*s2: the
// subtraction of two products fuses the left one.)
DETDIT_HD float dx_value(float g, float w, float x, float mean, float rstd, float s1, float s2, float term1,
                         int64_t hidden) {
  const float fh = static_cast<float>(hidden);
  const float a = num::mul32(num::mul32(num::sub32(x, mean), rstd), s2);
  float f = num::fma32(num::mul32(fh, w), g, -a);
  f = num::sub32(f, s1);
  return num::mul32(f, term1);
}

// One step of the d_weight chain: fma(g, rn(rn(x - mean) * rstd), acc) (the
// d_bias chain is rn(acc + g)).
DETDIT_HD float weight_grad_step(float g, float x, float mean, float rstd, float acc) {
  return num::fma32(g, num::mul32(num::sub32(x, mean), rstd), acc);
}

// ---- modulation (numerics 9.5, 9.6; the recipe's types: modulation_math.h) ----

// The modulated norm's n_i = R_Norm(v), v = normalised(...) unrounded: the
// value the output's modulation and the d_scale chain read.
template <typename Norm>
DETDIT_HD float modulation_input(float v) {
  return round_to<Norm>(v);
}

// The modulated output before its rounding to Out: rn(R_Mid(rn(n * t1)) +
// shift), t1 = R_Factor(rn(1 + scale)) (rmsnorm's steps, rowwise_math.h).
template <typename Norm, typename Mid, typename Factor>
DETDIT_HD float modulated(float v, float scale, float shift) {
  return rowwise::modulated<Mid, Factor>(modulation_input<Norm>(v), scale, shift);
}

// ---- the host trees -------------------------------------------------------------

// The row's Welford total: thread t folds element(4j + e) for its vectors
// j = t, t+128, ... < H/4 and e = 0..3 in order; each warp's shuffle-down tree
// (offsets 16, 8, 4, 2, 1: lane l <- combine(lane l, lane l + off)); then the
// warps. element(i) returns x_i widened to FP32.
template <typename Element>
Welford layernorm_row_stats(int64_t hidden, Element&& element) {
  Welford lane[kRowTreeThreads];
  const int64_t vectors = hidden / kRowTreeVector;
  for (int t = 0; t < kRowTreeThreads; ++t) {
    Welford s{0.0f, 0.0f, 0.0f};
    for (int64_t j = t; j < vectors; j += kRowTreeThreads)
      for (int e = 0; e < kRowTreeVector; ++e) s = welford_step(s, element(j * kRowTreeVector + e));
    lane[t] = s;
  }
  Welford warp[kRowTreeWarps];
  for (int w = 0; w < kRowTreeWarps; ++w) {
    Welford* v = lane + 32 * w;
    // lanes >= off do not feed lane 0 (numerics 7); ascending l reads the step's old values
    for (int off = 16; off >= 1; off /= 2)
      for (int l = 0; l < off; ++l) v[l] = welford_combine(v[l], v[l + off]);
    warp[w] = v[0];
  }
  return combine_warps(warp);
}

// PyTorch's BlockReduceSum of the 128 threads' values: each warp's
// shuffle-down tree of rn(v[l] + v[l + off]), then block_sum_of_warps.
inline float layernorm_block_sum(const float (&lane_value)[kRowTreeThreads]) {
  float warp[kRowTreeWarps];
  for (int w = 0; w < kRowTreeWarps; ++w) {
    float v[32];
    for (int l = 0; l < 32; ++l) v[l] = lane_value[32 * w + l];
    for (int off = 16; off >= 1; off /= 2)
      for (int l = 0; l < off; ++l) v[l] = num::add32(v[l], v[l + off]);
    warp[w] = v[0];
  }
  return block_sum_of_warps(warp);
}

}  // namespace layernorm
}  // namespace detdit
