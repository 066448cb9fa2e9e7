// detdit/gate_residual_layernorm.h: the gated residual and the LayerNorm after
// it, one op (SD3, Flux, HunyuanVideo, Wan: SGLang's
// ScaleResidualLayerNormScaleShift):
//   h   = residual + gate * y                       (gate_residual)
//   out = layernorm(h), modulated: * (1 + scale) + shift   (layernorm)
// with both h and out returned.
//
// Contract: the composition, bit for bit (docs/numerics.md 9.7). The forward
//   is gate_residual_forward into h, then layernorm_forward of h: h is
//   rounded to its dtype before the norm reads it, in both recipes. The
//   backward from d_out and, optionally, d_h (the gradient reaching h from
//   the rest of the network) is autograd through the two ops:
//     dn = layernorm's dx of d_out (h's dtype);
//     g  = R(rn(dn + d_h)) in h's dtype when d_h is present, else dn;
//     d_weight, d_bias, d_shift, d_scale = layernorm's from d_out;
//     d_residual, d_y, d_gate = gate_residual's from g.
// Forms and recipes: each half's (detdit/gate_residual.h, layernorm.h): the
//   gate absent (plain residual add), indexed with a plan, per sample, per
//   frame or per token; shift and scale absent (plain norm) or in the same
//   forms; every present modulation tensor of one call in one form. has_k/k
//   are the gate's, upcast both halves'. h has gate_residual's output dtype
//   (residual's, or fp32 for an fp32 gate with upcast = false), and the norm's
//   rules apply to h as its x: weight and bias in h's dtype, H a multiple of
//   4, h, weight, bias and out each aligned to 4 elements of its dtype.
// Layout: residual, y, h, d_h (M, H) or (B, S, H) contiguous (the grouped and
//   per-token forms need (B, S, H)); out and d_out as layernorm's out.
// Determinism: every output is a pure function of the inputs, the same bytes
//   on the CPU and every CUDA GPU in the portable profile (the halves'
//   guarantees, including batch invariance of the grouped gradients).
// Streams: CUDA work is enqueued on `stream`; the CPU ignores it.
// Errors: a Status naming the argument; nothing is written on error.
#pragma once

#include "detdit/modulation.h"
#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// What the forward and the backward both read (residual only feeds the forward).
struct GateResidualLayernormInputs {
  TensorView residual;  // (M, H) or (B, S, H)
  TensorView y;         // residual's shape and dtype (the sublayer output)
  TensorView gate;      // (R, H) with plan, (B, H), (B, F, H), (B, S, H)...; or absent
  TensorView weight;    // (H,) h's dtype, or absent (no affine)
  TensorView bias;      // (H,) h's dtype, or absent; needs weight
  TensorView shift;     // gate's form, or absent (plain norm)
  TensorView scale;     // as shift, or absent
  IndexPlan plan;       // required for the indexed form
  bool has_k = false;   // the gate term is R(k + gate) when true (SGLang's MulAdd)
  float k = 0.0f;
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
  bool upcast = false;  // false: each op rounds (eager); true: FP32 in each half, h and out rounded once
};

struct GateResidualLayernormParams {
  GateResidualLayernormInputs in;
  TensorView h;     // residual's shape; gate_residual's out dtype
  TensorView out;   // h's shape; layernorm's out dtype for x = h
  TensorView mean;  // (M,) fp32, or absent (needed by the backward)
  TensorView rstd;  // (M,) fp32, or absent (needed by the backward)
};
Status gate_residual_layernorm_forward(const GateResidualLayernormParams& params, Stream stream = nullptr);

struct GateResidualLayernormBackwardParams {
  GateResidualLayernormInputs in;  // as in the forward (residual is not read)
  TensorView h, mean, rstd;        // saved by the forward
  TensorView d_out;                // like out
  // The optional ones ({}: brace-initialised params may leave them out).
  TensorView d_h{};                    // like h, or absent (zero)
  TensorView d_residual{};             // like y, or absent
  TensorView d_y{};                    // like y, or absent
  TensorView d_gate{};                 // gate's shape, fp32 or gate's dtype, or absent
  TensorView d_weight{}, d_bias{};     // (H,) fp32 or h's dtype, or absent
  TensorView d_shift{}, d_scale{};     // shift's / scale's shape, fp32 or their dtype, or absent
};
Status gate_residual_layernorm_backward(const GateResidualLayernormBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
