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
// Streams: CUDA work is enqueued on `stream` (nullptr: the legacy default
// stream) and the call returns without synchronising; the CPU ignores it.
// Errors: a Status naming the argument; nothing is written on error.
#pragma once

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// What the forward and the backward both read: the backward takes the
// forward's inputs unchanged (LayernormBackwardParams::in = LayernormParams::in).
struct LayernormInputs {
  TensorView x;       // (M, H) or (B, S, H)
  TensorView weight;  // (H,) x's dtype, or absent (no affine)
  TensorView bias;    // (H,) x's dtype, or absent; needs weight
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
};

struct LayernormParams {
  LayernormInputs in;
  TensorView out;   // like x
  TensorView mean;  // (M,) fp32, or absent
  TensorView rstd;  // (M,) fp32, or absent
};
Status layernorm_forward(const LayernormParams& params, Stream stream = nullptr);

struct LayernormBackwardParams {
  LayernormInputs in;   // as in the forward
  TensorView mean;      // (M,) fp32 saved by the forward
  TensorView rstd;      // (M,) fp32 saved by the forward
  TensorView grad;      // like x
  TensorView dx;        // like x, or absent
  TensorView d_weight;  // (H,) fp32 or x's dtype, or absent; needs weight
  TensorView d_bias;    // (H,) fp32 or x's dtype, or absent; needs bias
};
Status layernorm_backward(const LayernormBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
