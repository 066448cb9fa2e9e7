// detdit/gate_residual_rmsnorm.h: the region every H3 block runs twice, fused:
//   h   = residual + gate[i] * y                      (gate_residual)
//   out = rmsnorm(h) * w,  modulated: * (1 + scale[i]) + shift[i]   (rmsnorm)
// with both h and out returned; i = the table row of the position (plan).
//
// Forward: bitwise equal to gate_residual_forward then rmsnorm_forward on its
//   output (docs/numerics.md 5.11); rstd (M,) fp32 is saved for the backward.
// Backward from d_out and, optionally, d_h (the gradient that reaches h from
//   the rest of the network, e.g. the next residual branch):
//     dn = the rmsnorm backward's dx of d_out, rounded to T;
//     g  = R_T(rn(d_h + dn)) when d_h is present, else dn (autograd's sum of
//          the two gradients of h);
//     d_residual = g; d_y = R_T(rn(g * gate[i])); d_gate = the canonical
//     reduction of fma(g, y); d_weight, d_shift, d_scale = rmsnorm's from d_out.
//   Bitwise equal to autograd through the two separate ops (docs/numerics.md 6.10).
// Layout: as rmsnorm and gate_residual (include/detdit/rmsnorm.h,
//   gate_residual.h): residual, y, h, out, d_out, d_h (M, H) or (B, S, H)
//   contiguous in one float dtype T, H a multiple of 4; h, out and weight (the
//   norm's x, out and weight) aligned to 4*sizeof(T) bytes, the others at any
//   address; gate, shift, scale (R, H) views in T with unit column stride.
// Determinism: every output is a pure function of the inputs (row-local ones
//   of their row; the cross-row gradients by the canonical reduction), the
//   same on every CUDA GPU and the CPU in the portable profile.
#pragma once

#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// What the forward and the backward both read (residual only feeds the forward).
struct GateResidualRmsnormInputs {
  TensorView residual;  // (M, H)
  TensorView y;         // (M, H) residual's dtype (the sublayer output)
  TensorView gate;      // (R, H) residual's dtype
  TensorView weight;    // (H,) residual's dtype (the norm weight)
  TensorView shift;     // (R, H), or absent (plain norm)
  TensorView scale;     // (R, H), or absent (plain norm)
  IndexPlan plan;
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
};

struct GateResidualRmsnormParams {
  GateResidualRmsnormInputs in;
  TensorView h;     // (M, H) residual + gate * y, saved for the backward
  TensorView out;   // (M, H) the norm of h
  TensorView rstd;  // (M,) fp32, saved for the backward
};
Status gate_residual_rmsnorm_forward(const GateResidualRmsnormParams& params, Stream stream = nullptr);

struct GateResidualRmsnormBackwardParams {
  GateResidualRmsnormInputs in;  // as in the forward (residual is not read)
  TensorView h, rstd;            // saved by the forward
  TensorView d_out;              // (M, H) gradient of out
  TensorView d_h;                // (M, H) gradient of h from elsewhere, or absent (zero)
  TensorView d_residual;         // (M, H), or absent
  TensorView d_y;                // (M, H), or absent
  TensorView d_gate;             // (R, H) fp32 or T, or absent
  TensorView d_weight;           // (H,) fp32 or T, or absent
  TensorView d_shift, d_scale;   // (R, H) fp32 or T, or absent (modulated norms only)
};
Status gate_residual_rmsnorm_backward(const GateResidualRmsnormBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
