// detdit/timestep.h: the timestep path, timestep_sinusoid and timestep_mlp.
//
// timestep_sinusoid: features[t] = [cos(t*freq[0..half)) | sin(t*freq[0..half))],
//   freq[k] = exp(rn(rn(c*k) * rn(1/half))) with c = fp32(-ln(max_period)),
//   half = C/2 (diffusers' Timesteps(C, flip_sin_to_cos=True, shift=0)).
//   timesteps (T,) fp32, bf16 or fp16 (upcast exactly first), finite and in
//   [0, 1] (t = 1 - sigma, unscaled: the t*1000 convention fails closed);
//   features (T, C) fp32 contiguous; C even and positive; max_period >= 1.
//   Row-local: features[t] depends on timesteps[t] alone.
//   The range check reads the timesteps on the host (for CUDA timesteps: one
//   copy that synchronises the stream). A caller that has validated them
//   already (or captures a CUDA graph) sets check_range = false; the op then
//   never synchronises and trusts that every value is finite and in [0, 1].
// timestep_mlp: temb = W2 silu(W1 f + b1) + b2, all FP32 (the H3 time
//   embedder is an FP32 module; a bf16 operand is a TypeError). Every tensor
//   is contiguous and 16-byte aligned (linear reads its rows as 16-byte
//   vectors; a ValueError otherwise).
#pragma once

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// What the forward and the backward both read.
struct TimestepSinusoidInputs {
  TensorView timesteps;   // (T,) fp32/bf16/fp16, contiguous
  float max_period = 10000.0f;
  Numerics numerics = Numerics::kPortable;
  bool check_range = true;  // false: the caller guarantees t finite and in [0, 1]
};

struct TimestepSinusoidParams {
  TimestepSinusoidInputs in;
  TensorView features;    // (T, C) fp32, contiguous
};
Status timestep_sinusoid_forward(const TimestepSinusoidParams& params, Stream stream = nullptr);

struct TimestepSinusoidBackwardParams {
  TimestepSinusoidInputs in;  // as in the forward
  TensorView grad_features;   // (T, C) fp32
  TensorView d_timesteps;     // (T,) timesteps' dtype
};
Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& params, Stream stream = nullptr);

// What the forward and the backward both read (b1, b2 only feed the forward).
struct TimestepMlpInputs {
  TensorView features;  // (T, K) fp32   (K = 256 in H3)
  TensorView w1;        // (H, K) fp32   (H = 5376)
  TensorView b1;        // (H,)   fp32   (forward only)
  TensorView w2;        // (D, H) fp32   (D = 2688)
  TensorView b2;        // (D,)   fp32   (forward only)
  Numerics numerics = Numerics::kPortable;
};

struct TimestepMlpParams {
  TimestepMlpInputs in;
  TensorView temb;      // (T, D) fp32 output
  TensorView pre;       // (T, H) fp32 saved for backward (W1 f + b1), or absent
  TensorView hidden;    // (T, H) fp32 saved for backward (silu(pre)), or absent
};
Status timestep_mlp_forward(const TimestepMlpParams& params, Stream stream = nullptr);

struct TimestepMlpBackwardParams {
  TimestepMlpInputs in;         // as in the forward
  TensorView pre, hidden;       // saved by the forward
  TensorView grad_temb;         // (T, D) fp32
  TensorView d_features;        // (T, K) fp32, or absent
  TensorView d_w1, d_b1, d_w2, d_b2;  // fp32, each may be absent
};
Status timestep_mlp_backward(const TimestepMlpBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
