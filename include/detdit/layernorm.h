// detdit/layernorm.h: LayerNorm without affine, with weight, or with weight
// and bias (F.layer_norm over the last dimension).
//
// Forward, per row x of H elements (x dtype T in fp32, bf16, fp16):
//   (mean, m2) = PyTorch's vectorized LayerNorm Welford tree (128 lanes of
//                4-element vectors, shuffle-down warp tree, (W0+W2)+(W1+W3));
//   var  = m2 / H;  rstd = rsqrt(var + eps)   (profile rsqrt: portable or hardware)
//   out  = R_T(rstd * (x - mean))             neither weight nor bias
//          R_T(w * (rstd * (x - mean)))       weight
//          R_T(fma(w, rstd * (x - mean), b))  weight and bias
// mean and rstd (M,) fp32 are saved for the backward. The torch profile is
// PyTorch eager's F.layer_norm on the same GPU; the portable profile gives
// the same bytes on the CPU and every CUDA GPU (docs/numerics.md 9).
// Backward: dx row-local, PyTorch's layer_norm_grad_input_kernel arithmetic
// from the saved mean and rstd (so dx is eager's in the torch profile).
// d_weight and d_bias are detdit's canonical reduction (chunks of 256
// flattened positions, ascending fold; plan.h) in both profiles: deterministic
// and independent of the batch split, not PyTorch's M-dependent dgamma order.
// Layout: x (M, H) or (B, S, H) contiguous, H a multiple of 4 and at most
// 2^24; x, weight, bias and out aligned to 4*sizeof(T) bytes (PyTorch's
// vectorized path; other layouts are rejected rather than computed with
// different bits). grad and dx: contiguous like x, any alignment.
//
// Modulation (AdaLN: SD3, Flux, HunyuanVideo, Wan), as rmsnorm's
// (detdit/modulation.h, docs/numerics.md 9.5, 9.6): with shift and scale,
//   out = R(R(n * R(1 + scale)) + shift),  n the normalised value above,
// in every form: indexed ((R, H) tables with a plan), per sample (B, H) /
// (B, 1, H), per frame (B, F, H) / (B, F, 1, H), per token (B, S, H) (x then
// (B, S, H)); fp32 or x's dtype. upcast = false rounds every step to the
// promoted dtype of its operands as eager PyTorch does (out and grad: fp32
// when the modulation is fp32, else x's dtype); upcast = true keeps n and
// every step in FP32 and rounds once to x's dtype (Wan's FP32 LayerNorm,
// `(norm(x.float()) * (1 + scale) + shift).type_as(x)`). The backward reads
// d_n = rn(g * R(1 + scale)) (FP32) where the plain norm reads g (dx,
// d_weight, d_bias); d_shift / d_scale have shift's / scale's shape: indexed
// by the canonical reduction over the plan, grouped forms per group
// (batch-invariant), per token row-local. The plain norm (no shift, scale)
// has the bytes above in both recipes.
// Streams: CUDA work is enqueued on `stream` (nullptr: the legacy default
// stream) and the call returns without synchronising; the CPU ignores it.
// Errors: a Status naming the argument; nothing is written on error.
#pragma once

#include "detdit/modulation.h"
#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// What the forward and the backward both read: the backward takes the
// forward's inputs unchanged (LayernormBackwardParams::in = LayernormParams::in).
struct LayernormInputs {
  TensorView x;       // (M, H) or (B, S, H)
  TensorView weight;  // (H,) x's dtype, or absent (no affine)
  TensorView bias;    // (H,) x's dtype, or absent; needs weight
  TensorView shift;   // (R, H) with plan, (B, H), (B, F, H), (B, S, H)...; or absent (plain norm)
  TensorView scale;   // as shift (same form and dtype), or absent
  IndexPlan plan;     // required for the indexed form
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
  bool upcast = false;  // false: each op rounds (eager); true: FP32 throughout, one rounding
};

struct LayernormParams {
  LayernormInputs in;
  TensorView out;   // x's shape; dtype: x's, or fp32 for fp32 modulation with upcast = false
  TensorView mean;  // (M,) fp32, or absent
  TensorView rstd;  // (M,) fp32, or absent
};
Status layernorm_forward(const LayernormParams& params, Stream stream = nullptr);

struct LayernormBackwardParams {
  LayernormInputs in;   // as in the forward
  TensorView mean;      // (M,) fp32 saved by the forward
  TensorView rstd;      // (M,) fp32 saved by the forward
  TensorView grad;      // like out
  TensorView dx;        // like x, or absent
  TensorView d_weight;  // (H,) fp32 or x's dtype, or absent; needs weight
  TensorView d_bias;    // (H,) fp32 or x's dtype, or absent; needs bias
  // shift's / scale's shape, fp32 or their dtype, or absent ({}: a plain
  // norm's brace-initialised params may leave them out)
  TensorView d_shift{};
  TensorView d_scale{};
};
Status layernorm_backward(const LayernormBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
