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
#pragma once

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
  TensorView shift;   // (R, H) x's dtype, or absent (plain norm)
  TensorView scale;   // (R, H) x's dtype, or absent (plain norm)
  IndexPlan plan;     // required iff modulated
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
};

struct RmsnormParams {
  RmsnormInputs in;
  TensorView out;     // like x
  TensorView rstd;    // (M,) fp32, or absent
};
Status rmsnorm_forward(const RmsnormParams& params, Stream stream = nullptr);

struct RmsnormBackwardParams {
  RmsnormInputs in;    // as in the forward
  TensorView rstd;     // (M,) fp32 saved by the forward
  TensorView grad;     // like x
  TensorView dx;       // like x, or absent
  TensorView d_weight; // (H,) x's dtype or fp32, or absent
  TensorView d_shift;  // (R, H) fp32 or x's dtype, or absent
  TensorView d_scale;  // (R, H) fp32 or x's dtype, or absent
};
Status rmsnorm_backward(const RmsnormBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
