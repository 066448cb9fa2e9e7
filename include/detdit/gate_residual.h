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
//
// Modulation forms and recipes (detdit/modulation.h, docs/numerics.md 5.12,
// 6.11): gate may be absent (out = R_T(residual + y)), indexed as above, or
// without a plan per sample, per frame or per token, fp32 or residual's dtype;
// has_k and k make the gate term k + gate (SGLang's MulAdd, c + a * (k + b)).
// upcast = false rounds each op to its operands' promoted dtype (out, grad:
// fp32 for an fp32 gate, else residual's dtype); upcast = true computes in
// FP32 and rounds once to residual's dtype. d_residual = R_T(grad); d_gate has
// gate's shape. The indexed form, residual's dtype, no k, upcast = false is
// the rule above, bit for bit.
#pragma once

#include "detdit/modulation.h"
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
  TensorView gate;      // (R, H) with plan, (B, H), (B, F, H), (B, S, H)...; or absent
  IndexPlan plan;       // required for the indexed form
  bool has_k = false;      // the gate term is R(k + gate) when true, gate itself when false
  float k = 0.0f;
  bool upcast = false;     // false: each op rounds (eager); true: FP32 throughout, one rounding
};

struct GateResidualParams {
  GateResidualInputs in;
  TensorView out;       // residual's shape; residual's dtype, or fp32 (fp32 gate, upcast = false)
};
Status gate_residual_forward(const GateResidualParams& params, Stream stream = nullptr);

struct GateResidualBackwardParams {
  GateResidualInputs in;  // as in the forward (residual is not read)
  TensorView grad;        // like the forward's out
  TensorView d_residual;  // y's shape and dtype, or absent
  TensorView d_y;         // y's shape and dtype, or absent
  TensorView d_gate;      // gate's shape, fp32 or gate's dtype, or absent
};
Status gate_residual_backward(const GateResidualBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
