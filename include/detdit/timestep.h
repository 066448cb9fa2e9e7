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
// timestep_mlp: temb = W2 silu(W1 f + b1) + b2 in the MLP's dtype T, the
//   features' dtype: fp32 (H3's FP32 time embedder) or bf16 (SD3, Flux,
//   HunyuanVideo run it in the activation dtype, with eager's roundings: pre
//   and hidden rounded to bf16, numerics 5.3); fp16, or operands of two
//   dtypes, are a TypeError. Every tensor is contiguous and 16-byte aligned
//   (linear reads its rows as 16-byte vectors; a ValueError otherwise).
//   The families' pooled-text embedder (diffusers' PixArtAlphaTextProjection
//   with the SiLU) is timestep_mlp with the pooled text (B, P) as features.
// combined_timestep_embedding: the families' sum of the timestep, guidance and
//   text embeddings (the section at the end of this file).
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
// T = features' dtype, fp32 or bf16; every operand in T.
struct TimestepMlpInputs {
  TensorView features;  // (T, K) T   (K = 256 in H3 and the diffusers families)
  TensorView w1;        // (H, K) T   (H = 5376 in H3)
  TensorView b1;        // (H,)   T   (forward only)
  TensorView w2;        // (D, H) T   (D = 2688 in H3)
  TensorView b2;        // (D,)   T   (forward only)
  Numerics numerics = Numerics::kPortable;
};

struct TimestepMlpParams {
  TimestepMlpInputs in;
  TensorView temb;      // (T, D) T output
  TensorView pre;       // (T, H) T saved for backward (R(W1 f + b1)), or absent
  TensorView hidden;    // (T, H) T saved for backward (R(silu(pre))), or absent
};
Status timestep_mlp_forward(const TimestepMlpParams& params, Stream stream = nullptr);

struct TimestepMlpBackwardParams {
  TimestepMlpInputs in;         // as in the forward
  TensorView pre, hidden;       // saved by the forward
  TensorView grad_temb;         // (T, D) fp32 or T
  TensorView d_features;        // (T, K) fp32 or T, or absent
  TensorView d_w1, d_b1, d_w2, d_b2;  // fp32 or T, each may be absent
};
Status timestep_mlp_backward(const TimestepMlpBackwardParams& params, Stream stream = nullptr);

// ---- the families' combined embedding (combined_timestep_embedding) ----
//
// combined_timestep_embedding: CombinedTimestepTextProjEmbeddings (SD3,
//   Flux-schnell) and CombinedTimestepGuidanceTextProjEmbeddings (Flux-dev,
//   HunyuanVideo): temb = (t_emb + g_emb) + text_emb, or t_emb + text_emb
//   without guidance, each add rounded to T (numerics 5.3), where t_emb and
//   g_emb are timestep_mlp of the timestep's and the guidance's sinusoid
//   features and text_emb is timestep_mlp of the pooled text. The caller
//   computes the features with timestep_sinusoid and casts them to T, as the
//   models do. The backward gives every MLP the same grad_temb (an add's VJP
//   is the identity).

// One MLP's weights: linear_1 (w1 (H, K), b1 (H,)) and linear_2 (w2 (D, H), b2 (D,)).
struct MlpWeights {
  TensorView w1, b1, w2, b2;
};
// What one MLP's forward saves for its backward: pre, hidden (B, H) in T.
struct MlpSaved {
  TensorView pre, hidden;
};
// One MLP's gradients: d_x (the input's), d_w1, d_b1, d_w2, d_b2; fp32 or T, each may be absent.
struct MlpGrads {
  TensorView d_x, d_w1, d_b1, d_w2, d_b2;
};

struct CombinedTimestepEmbeddingInputs {
  TensorView timestep_features;  // (B, K) T: the timesteps' sinusoid features cast to T
  TensorView guidance_features;  // (B, K') T, or absent: no guidance embedder
  TensorView pooled;             // (B, P) T
  MlpWeights timestep, guidance, text;  // guidance's absent with guidance_features; every D equal
  Numerics numerics = Numerics::kPortable;
};
struct CombinedTimestepEmbeddingParams {
  CombinedTimestepEmbeddingInputs in;
  TensorView temb;                                      // (B, D) T
  MlpSaved timestep_saved, guidance_saved, text_saved;  // each (B, H) T, or absent
};
Status combined_timestep_embedding_forward(const CombinedTimestepEmbeddingParams& params, Stream stream = nullptr);

struct CombinedTimestepEmbeddingBackwardParams {
  CombinedTimestepEmbeddingInputs in;
  MlpSaved timestep_saved, guidance_saved, text_saved;  // saved by the forward (guidance's with guidance)
  TensorView grad_temb;                                 // (B, D) fp32 or T
  MlpGrads timestep_grads, guidance_grads, text_grads;  // d_x: d_timestep_features, d_guidance_features, d_pooled
};
Status combined_timestep_embedding_backward(const CombinedTimestepEmbeddingBackwardParams& params,
                                            Stream stream = nullptr);

}  // namespace detdit
