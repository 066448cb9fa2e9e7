// detdit/gate_residual.h: the gated residual, out = residual + gate[i] * y.
//
// Forward: out = R_T(residual + R_T(gate[i] * y)), two separately rounded FP32
// operations (no FMA, also in fp32), i = the table row of the position (plan,
// shared across the batch). Bitwise equal to eager `res + gate[idx] * y`.
// Backward: d_residual = grad (a copy); d_y = R_T(grad * gate[i]);
// d_gate[r] = canonical reduction (plan.h) of fma(grad, y, acc), cast once to
// d_gate's dtype.
// Layout: residual, y, out, grad (M, H) or (B, S, H) contiguous, one dtype in
// fp32/bf16/fp16; gate (R, H) with unit column stride, any row stride.
#pragma once

#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// What the forward and the backward read: the backward takes the forward's
// inputs unchanged and reads y, gate and plan (residual only feeds the forward).
struct GateResidualInputs {
  TensorView residual;  // (M, H)
  TensorView y;         // (M, H) residual's dtype (the sublayer output)
  TensorView gate;      // (R, H) residual's dtype
  IndexPlan plan;
};

struct GateResidualParams {
  GateResidualInputs in;
  TensorView out;       // (M, H) residual's dtype
};
Status gate_residual_forward(const GateResidualParams& params, Stream stream = nullptr);

struct GateResidualBackwardParams {
  GateResidualInputs in;  // as in the forward (residual is not read)
  TensorView grad;        // (M, H) y's dtype
  TensorView d_residual;  // (M, H), or absent
  TensorView d_y;         // (M, H), or absent
  TensorView d_gate;      // (R, H) fp32 or gate's dtype, or absent
};
Status gate_residual_backward(const GateResidualBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
