// detdit/chain.h: the MiniMax-H3 conditioning chain, forward and backward, as
// one call (for tests, the CLI's verify and benchmarks).
//
//   features = timestep_sinusoid(timesteps)                  (T, F) fp32
//   temb     = timestep_mlp(features)                        (T, D) fp32
//   per block l = 0 .. L-1, with x_0 = x:
//     table_l  = adaln_projection(temb, W_l, b_l)            (T, 18H), chunks as (3T, H) views
//     h        = rmsnorm(x_l, norm1_l) * (1 + scale_msa) + shift_msa     (adaln plan)
//     x'       = x_l + gate_msa * attn(h)                    (gate_residual)
//     h        = rmsnorm(x', norm2_l) * (1 + scale_mlp) + shift_mlp
//     x_{l+1}  = x' + gate_mlp * ffn(h)
//   out      = final_adaln_out(x_L, norm_out, temb, W_out, b_out)       (timestep plan)
//
// attn and ffn are seeded stand-ins (not the model's attention and FFN): sublayer k's output is
// sublayer_out[k] (k = 2l attention, 2l + 1 FFN), independent of h, and its
// vector-Jacobian product returns sublayer_grad[k] as the gradient of its
// input h. chain_stand_ins fills both deterministically from a seed.
//
// Backward from grad_out: final_adaln_out backward, then blocks in reverse.
// The gradient of x' and x_l is the sum of the residual path and the norm's
// dx, rn(g + dx) rounded once to x's dtype; d_temb is the FP32 ascending sum
// over the blocks 0..L-1, then the final layer; every table gradient is FP32
// into the projection backward (never rounded to the weight dtype in between).
// Every gradient output is optional (absent: not computed into the caller's
// memory). The chain composes the public ops and the internal elementwise add
// (docs/numerics.md 5.10); it runs on the tensors of one device, CPU or CUDA
// (mixed devices are a ValueError), with bitwise equal results. On CUDA every
// step is queued on `stream`; the only host synchronisation is the range check
// of the timesteps (one copy to the host before anything is written), and
// check_range = false removes it, so the call is CUDA-graph capturable.
#pragma once

#include <cstdint>

#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

struct ChainBlockWeights {
  TensorView adaln_weight;  // (18H, D) x's dtype (bf16 or fp32)
  TensorView adaln_bias;    // (18H,)
  TensorView norm1_weight;  // (H,) x's dtype
  TensorView norm2_weight;  // (H,) x's dtype
};

struct ChainWeights {
  TensorView mlp_w1, mlp_b1;  // (Ht, F), (Ht,) fp32
  TensorView mlp_w2, mlp_b2;  // (D, Ht), (D,) fp32
  const ChainBlockWeights* blocks = nullptr;  // (num_blocks,)
  int64_t num_blocks = 0;
  TensorView norm_out_weight;  // (H,) x's dtype
  TensorView out_weight;       // (2H, D) x's dtype
  TensorView out_bias;         // (2H,)
};

// Gradients, each shaped and typed like its weight (fp32 for the MLP), or absent.
struct ChainBlockGrads {
  TensorView d_adaln_weight, d_adaln_bias, d_norm1_weight, d_norm2_weight;
};
struct ChainGrads {
  TensorView d_timesteps;                                  // (T,) timesteps' dtype
  TensorView d_mlp_w1, d_mlp_b1, d_mlp_w2, d_mlp_b2;      // fp32
  const ChainBlockGrads* blocks = nullptr;                 // (num_blocks,) or nullptr
  TensorView d_norm_out_weight, d_out_weight, d_out_bias;
  TensorView dx;                                           // like x
};

struct ChainParams {
  ChainWeights weights;
  TensorView timesteps;      // (T,) fp32, in [0, 1]
  IndexPlan adaln_plan;      // rows ti*3 + tag, R = 3T
  IndexPlan timestep_plan;   // rows ti, R = T (same S and B)
  TensorView x;              // (B*S, H) or (B, S, H) bf16/fp32: hidden states entering block 0
  TensorView sublayer_out;   // (2L, B*S, H) x's dtype
  TensorView sublayer_grad;  // (2L, B*S, H) x's dtype
  TensorView grad_out;       // like x
  TensorView out;            // like x, output
  ChainGrads grads;          // outputs
  float max_period = 10000.0f;
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
  bool check_range = true;  // false: the caller guarantees every timestep finite and in [0, 1]
};
Status chain_forward_backward(const ChainParams& params, Stream stream = nullptr);

// Deterministic stand-ins on the host: sublayer_out = 3 * z, sublayer_grad = z',
// z an approximately standard normal value (sum of 12 uniforms from a
// splitmix64 counter stream, minus 6; pure integer and exact FP64 arithmetic,
// identical on every platform), rounded once to the tensors' dtype. Both
// tensors are contiguous CPU (2L, B*S, H) views of one float dtype.
Status chain_stand_ins(uint64_t seed, const TensorView& sublayer_out, const TensorView& sublayer_grad);

}  // namespace detdit
