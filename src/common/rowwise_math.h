// Per-element formulas of the row-wise ops, shared by the CPU reference
// (src/cpu/) and the CUDA kernels (src/cuda/), so that CPU/GPU equality holds
// by construction for these lines (docs/numerics.md 5.6, 5.7, 6.7, 6.8).
// Every step is one separately rounded FP32 operation (rn); R_T rounds to the
// storage type T and back (round_to<T>); fma32 is the only fused operation,
// written out where the order says so. The row statistics (the reduction
// tree and its rsqrt) live in row_tree.h and the backends, not here.
#pragma once

#include <cstdint>

#include "common/scalar_math.h"
#include "common/storage.h"

namespace detdit {
namespace rowwise {

// The table row of flattened position p = b*S + s: the plan's row of s
// (one (S,) index shared by every batch item).
DETDIT_HD int64_t table_row(const int32_t* row_of_seq, int64_t position, int64_t seq_len) {
  return row_of_seq[position % seq_len];
}

// ---- rmsnorm (numerics 5.6 forward, 6.7 backward) --------------------------

// t1 = R_T(rn(1 + scale)), the rounded modulation factor.
template <typename T>
DETDIT_HD float one_plus(float scale) {
  return round_to<T>(num::add32(1.0f, scale));
}

// n = R_T(rn(w * rn(rstd * x))), the stored normalised value.
template <typename T>
DETDIT_HD float normalised(float w, float rstd, float x) {
  return round_to<T>(num::mul32(w, num::mul32(rstd, x)));
}

// The modulated output before its final rounding: rn(R_Mid(rn(n * t1)) + shift)
// with t1 = R_Factor(rn(1 + scale)); the caller stores R_Out of it
// (modulation_math.h Recipe; the H3 rule: Mid = Factor = T).
template <typename Mid, typename Factor = Mid>
DETDIT_HD float modulated(float n, float scale, float shift) {
  return num::add32(round_to<Mid>(num::mul32(n, one_plus<Factor>(scale))), shift);
}

// d_n = rn(g * t1) of a modulated norm (a plain norm's d_n is g itself).
template <typename T>
DETDIT_HD float modulated_grad(float g, float scale) {
  return num::mul32(g, one_plus<T>(scale));
}

// The row-tree term of the backward dot: a = rn(w * d_n) (b = x).
DETDIT_HD float dot_term(float w, float d_n) { return num::mul32(w, d_n); }

// coef = rn(rn(rstd^3 * dot) / H), rstd^3 = rn(rn(rstd * rstd) * rstd).
DETDIT_HD float dx_coefficient(float rstd, float dot, int64_t hidden) {
  const float rstd3 = num::mul32(num::mul32(rstd, rstd), rstd);
  return num::div32(num::mul32(rstd3, dot), static_cast<float>(hidden));
}

// dx = rn(rn(rn(rstd * w) * d_n) - rn(x * coef)); the caller stores R_T of it.
DETDIT_HD float dx_value(float rstd, float w, float d_n, float x, float coef) {
  return num::sub32(num::mul32(num::mul32(rstd, w), d_n), num::mul32(x, coef));
}

// One step of the d_weight chain: fma(d_n, rn(x * rstd), acc).
DETDIT_HD float weight_grad_step(float d_n, float x, float rstd, float acc) {
  return num::fma32(d_n, num::mul32(x, rstd), acc);
}

// One step of the d_scale chain: fma(g, n, acc), n the stored normalised value
// (d_shift's chain is rn(acc + g)).
DETDIT_HD float scale_grad_step(float g, float n, float acc) { return num::fma32(g, n, acc); }

// ---- gate_residual (numerics 5.7 forward, 6.8 backward) --------------------

// out = rn(residual + R_T(rn(gate * y))); the caller stores R_T of it (T is
// the recipe's Mid type, modulation_math.h; the H3 rule: the rows' type).
template <typename T>
DETDIT_HD float gated_sum(float residual, float gate, float y) {
  return num::add32(residual, round_to<T>(num::mul32(gate, y)));
}

// The gate term with SGLang's constant: R_Factor(rn(k + gate)) (numerics 5.12).
template <typename Factor>
DETDIT_HD float gate_with_constant(float k, float gate) {
  return round_to<Factor>(num::add32(k, gate));
}

// d_y = rn(grad * gate); the caller stores R_T of it.
DETDIT_HD float gated_grad(float grad, float gate) { return num::mul32(grad, gate); }

// One step of the d_gate chain: fma(grad, y, acc).
DETDIT_HD float gate_grad_step(float grad, float y, float acc) { return num::fma32(grad, y, acc); }

}  // namespace rowwise
}  // namespace detdit
