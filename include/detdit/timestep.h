// detdit/timestep.h: the timestep path, timestep_sinusoid and timestep_mlp.
//
// timestep_sinusoid: diffusers' Timesteps(C, flip_sin_to_cos,
//   downscale_freq_shift, scale) with max_period (get_timestep_embedding):
//   half = C / 2 (integer division), freq[k] = exp(rn(rn(c*k) * inv)) with
//   c = fp32(-ln(max_period)), inv = fp32(1 / fp32(half - downscale_freq_shift)),
//   arg[t, k] = rn(scale * rn(t * freq[k])), features[t] = [cos(arg) | sin(arg)]
//   (flip_sin_to_cos = true; false: [sin(arg) | cos(arg)]), then one +0.0
//   column when C is odd. The defaults are MiniMax-H3's convention.
//   timesteps (T,) fp32, bf16 or fp16 (upcast exactly first), finite and in
//   [0, t_max]: t_max = 1 takes t = 1 - sigma unscaled (H3; t*1000 fails
//   closed), t_max = 1000 the sigma*1000 timesteps of SD3, Flux, Wan, ...;
//   features (T, C) fp32 contiguous; C positive; max_period >= 1;
//   downscale_freq_shift < half (when half >= 1); scale finite; t_max positive
//   with |scale| * t_max <= 1e6 (the portable sin/cos range, numerics 4).
//   Row-local: features[t] depends on timesteps[t] alone.
//   The range check reads the timesteps on the host (for CUDA timesteps: one
//   copy that synchronises the stream). A caller that has validated them
//   already (or captures a CUDA graph) sets check_range = false; the op then
//   never synchronises and trusts that every value is finite and in [0, t_max].
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
  bool check_range = true;  // false: the caller guarantees t finite and in [0, t_max]
  bool flip_sin_to_cos = true;        // true: [cos | sin] (H3 and every family); false: [sin | cos]
  float downscale_freq_shift = 0.0f;  // the exponent is divided by (half - downscale_freq_shift)
  float scale = 1.0f;                 // arg = rn(scale * rn(t * freq)); 1 is an exact no-op (Qwen-Image: 1000)
  float t_max = 1.0f;                 // the timesteps' upper bound (1: t = 1 - sigma; 1000: sigma * 1000)
};

struct TimestepSinusoidParams {
  TimestepSinusoidInputs in;
  TensorView features;    // (T, C) fp32, contiguous (C odd: the last column is +0.0)
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
