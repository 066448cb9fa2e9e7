// detdit/gate_residual_rmsnorm.h: the region every H3 block runs twice, fused:
//   h   = residual + gate[i] * y                      (gate_residual)
//   out = rmsnorm(h) * w,  modulated: * (1 + scale[i]) + shift[i]   (rmsnorm)
// with both h and out returned; i = the table row of the position (plan).
// The other models' regions are the same op in the forms below.
// Forward: bitwise equal to gate_residual_forward then rmsnorm_forward on its
//   output (docs/numerics.md 5.11); rstd (M,) fp32 is saved for the backward.
// Backward from d_out and, optionally, d_h (the gradient that reaches h from
//   the rest of the network, e.g. the next residual branch):
//     dn = the rmsnorm backward's dx of d_out, rounded to h's dtype T;
//     g  = R_T(rn(d_h + dn)) when d_h is present, else dn (autograd's sum of
//          the two gradients of h);
//     d_residual = R(g) in y's dtype; d_y = R(rn(g * gate[i])); d_gate = the canonical
//     reduction of fma(g, y); d_weight, d_shift, d_scale = rmsnorm's from d_out.
//   Bitwise equal to autograd through the two separate ops (docs/numerics.md 6.10).
// Layout: as rmsnorm and gate_residual (include/detdit/rmsnorm.h,
//   gate_residual.h): residual, y, h, out, d_out, d_h (M, H) or (B, S, H)
//   contiguous, H a multiple of 4; h, out and weight (the norm's x, out and
//   weight) aligned to 4 elements of their dtype, the others at any address.
// Forms and recipes (detdit/modulation.h, docs/numerics.md 5.11, 6.10): each
//   half's. The gate may be absent (h = residual + y), indexed with a plan,
//   per sample, per frame or per token (then residual is (B, S, H)); shift
//   and scale absent (plain norm) or in the gate's form; every present
//   modulation tensor of one call in one form, fp32 or residual's dtype.
//   has_k/k are the gate's, upcast both halves'. h has gate_residual's output
//   dtype (modulated_out_dtype of residual's dtype and the gate: fp32 for an
//   fp32 gate with upcast = false, else residual's); the norm reads h as its
//   x: weight in h's dtype, out (and d_out) rmsnorm's output dtype for h.
//   d_residual and d_y have y's dtype, d_gate / d_shift / d_scale the
//   modulation tensor's shape (an (R, H) table when indexed), fp32 or its
//   dtype.
// Two routes, one set of bits:
//   - the H3 rule (the indexed gate with a plan, shift and scale indexed or
//     absent, the modulation in residual's dtype, upcast = false, no k):
//     the fused kernels above (5.11, 6.10), on CUDA one forward kernel and
//     the backward walks;
//   - every other call: the two ops' own backends composed (gate_residual
//     into h, rmsnorm of h; backward as above with g in d_residual or
//     scratch), so every output is bitwise gate_residual_forward then
//     rmsnorm_forward, and autograd through them, for that form and recipe.
// Determinism: every output is a pure function of the inputs (row-local ones
//   of their row; the cross-row gradients by the canonical reduction, the
//   grouped forms' per group, batch-invariant), the same on every CUDA GPU
//   and the CPU in the portable profile.
// Errors: a Status naming the argument (h, not the norm's x); nothing is
//   written on error.
#pragma once

#include "detdit/modulation.h"
#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// What the forward and the backward both read (residual only feeds the forward).
struct GateResidualRmsnormInputs {
  TensorView residual;  // (M, H) or (B, S, H)
  TensorView y;         // residual's shape and dtype (the sublayer output)
  TensorView gate;      // (R, H) with plan, (B, H), (B, F, H), (B, S, H)...; or absent
  TensorView weight;    // (H,) h's dtype (the norm weight)
  TensorView shift;     // gate's form, or absent (plain norm)
  TensorView scale;     // as shift, or absent
  IndexPlan plan;       // required for the indexed form
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
  bool has_k = false;   // the gate term is R(k + gate) when true (SGLang's MulAdd)
  float k = 0.0f;
  bool upcast = false;  // false: each op rounds (eager); true: FP32 in each half, h and out rounded once
};

struct GateResidualRmsnormParams {
  GateResidualRmsnormInputs in;
  TensorView h;     // residual's shape, gate_residual's out dtype; saved for the backward
  TensorView out;   // h's shape, rmsnorm's out dtype for x = h: the norm of h
  TensorView rstd;  // (M,) fp32, saved for the backward
};
Status gate_residual_rmsnorm_forward(const GateResidualRmsnormParams& params, Stream stream = nullptr);

struct GateResidualRmsnormBackwardParams {
  GateResidualRmsnormInputs in;  // as in the forward (residual is not read)
  TensorView h, rstd;            // saved by the forward
  TensorView d_out;              // like out: gradient of out
  TensorView d_h;                // like h: gradient of h from elsewhere, or absent (zero)
  TensorView d_residual;         // like y, or absent
  TensorView d_y;                // like y, or absent
  TensorView d_gate;             // gate's shape, fp32 or gate's dtype, or absent
  TensorView d_weight;           // (H,) fp32 or h's dtype, or absent
  TensorView d_shift, d_scale;   // shift's / scale's shape, fp32 or their dtype, or absent
};
Status gate_residual_rmsnorm_backward(const GateResidualRmsnormBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
