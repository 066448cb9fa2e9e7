// detdit/rmsnorm.h: RMSNorm, plain and with AdaLN modulation.
//
// Forward, per row x of H elements (x dtype T in fp32, bf16, fp16):
//   ss   = PyTorch's vectorized RMSNorm tree over fma(v, v, s) (128 lanes of
//          4-element vectors, shuffle-down warp tree, (W0+W2)+(W1+W3));
//   rstd = rsqrt(ss / H + eps)     (profile rsqrt: portable or hardware)
//   n    = R_T(w * (rstd * x))
//   plain:     out = n
//   modulated: out = R_T(R_T(n * R_T(1 + scale[i])) + shift[i]), i = row of the
//              position in the plan (shared across the batch), no FMA.
// rstd (M,) fp32 is saved for the backward.
// Backward: dx row-local; d_weight, d_shift, d_scale by the canonical
// reduction (plan.h); table gradients FP32, cast once in-op when the output
// view has the table's dtype. d_n = g * R_T(1 + scale) in FP32; d_scale uses
// the rounded n.
// Layout: x (M, H) or (B, S, H) contiguous with M = B*S = plan.positions();
// H a multiple of 4; x, weight and out aligned to 4*sizeof(T) bytes (PyTorch's
// vectorized path; other layouts are rejected rather than computed with
// different bits). shift and scale are (R, H) views with unit column stride.
//
// Modulation forms and recipes (detdit/modulation.h, docs/numerics.md 5.12,
// 6.11): without a plan, shift and scale may be per sample (B, H) / (B, 1, H),
// per frame (B, F, H) / (B, F, 1, H) or per token (B, S, H) views (x then
// (B, S, H)), fp32 or x's dtype. upcast = false rounds every step to the
// promoted dtype of its operands as eager PyTorch does (out and grad: fp32
// when the modulation is fp32, else x's dtype); upcast = true computes every
// step in FP32 and rounds once to x's dtype (out and grad: x's dtype). The
// indexed form with x's dtype and upcast = false is the rule above, bit for bit.
// d_shift / d_scale have shift's / scale's shape; grouped forms reduce each
// group's positions alone (batch-invariant), per token is row-local.
#pragma once

#include "detdit/modulation.h"
#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// What the forward and the backward both read: the backward takes the
// forward's inputs unchanged (RmsnormBackwardParams::in = RmsnormParams::in).
struct RmsnormInputs {
  TensorView x;       // (M, H) or (B, S, H)
  TensorView weight;  // (H,) x's dtype
  TensorView shift;   // (R, H) with plan, (B, H), (B, F, H), (B, S, H)...; or absent (plain norm)
  TensorView scale;   // as shift (same form and dtype), or absent
  IndexPlan plan;     // required for the indexed form
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
  bool upcast = false;  // false: each op rounds (eager); true: FP32 throughout, one rounding
};

struct RmsnormParams {
  RmsnormInputs in;
  TensorView out;     // x's shape; dtype: x's, or fp32 for fp32 modulation with upcast = false
  TensorView rstd;    // (M,) fp32, or absent
};
Status rmsnorm_forward(const RmsnormParams& params, Stream stream = nullptr);

struct RmsnormBackwardParams {
  RmsnormInputs in;    // as in the forward
  TensorView rstd;     // (M,) fp32 saved by the forward
  TensorView grad;     // like out
  TensorView dx;       // like x, or absent
  TensorView d_weight; // (H,) x's dtype or fp32, or absent
  TensorView d_shift;  // shift's shape, fp32 or shift's dtype, or absent
  TensorView d_scale;  // scale's shape, fp32 or scale's dtype, or absent
};
Status rmsnorm_backward(const RmsnormBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
