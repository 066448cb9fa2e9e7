// detdit/linear.h: deterministic row-wise linear (y = x W^T + b) and its
// backward, the GEMV family behind timestep_mlp, adaln_projection,
// final_adaln_out and tp_adaln_projection.
//
// Shapes: x (T, K), weight (N, K), bias (N,), out (T, N). T is the number of
// distinct timesteps (typically 1..8). x, weight and bias share one dtype,
// fp32 or bf16; all are contiguous; x and weight are 16-byte aligned (their
// rows are read as 16-byte vectors), and so are the d_x chunk partials when
// the caller gives them (the CUDA kernels write their rows as 16-byte vectors);
// K is a multiple of the 16-byte vector width (4 for fp32, 8 for bf16); T >= 1.
// bias, out and the other backward tensors are read and written one element at
// a time (also by the CUDA kernels, which fall back to that for a d_weight or
// a weight-backward x off 16 bytes), so they need no 16-byte alignment.
//
// Determinism (docs/numerics.md, "linear"): out[t, n] depends only on x[t, :],
// weight[n, :] and bias[n]: bitwise invariant to T, to the other rows and to
// the launch configuration, identical on the CPU and every CUDA GPU in the
// portable profile. No tensor cores, no split-K, no atomics.
//
// Backward:
//   d_x[t, k] = sum_n grad[t, n] W[n, k]: N is cut into 64-row chunks; each
//     chunk's partial is an ascending-n fma chain from +0.0, stored FP32 as
//     partials (C, T, K) with C = ceil(N / 64); the fold is ascending over c
//     from +0.0 and cast once. Both halves are exposed because a
//     tensor-parallel rank owns whole chunks (its shard is 64-aligned).
//   d_weight[n, k] = sum_t grad[t, n] x[t, k], ascending-t fma chain, cast once.
//   d_bias[n] = sum_t grad[t, n], ascending-t add chain, cast once.
#pragma once

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

constexpr int64_t kLinearChunkRows = 64;  // rows of N per d_x partial

enum class Activation { kNone = 0, kSilu = 1 };

struct LinearParams {
  TensorView x;               // (T, K) fp32 or bf16
  TensorView weight;          // (N, K) x's dtype
  TensorView bias;            // (N,) x's dtype, or absent
  TensorView out;             // (T, N) fp32 or x's dtype
  TensorView pre_activation;  // (T, N) fp32, or absent: x W^T + b before the activation
  Activation activation = Activation::kNone;
  Numerics numerics = Numerics::kPortable;
};
Status linear_forward(const LinearParams& params, Stream stream = nullptr);

struct LinearBackwardInputParams {
  TensorView grad;      // (T, N) fp32
  TensorView weight;    // (N, K) fp32 or bf16
  TensorView partials;  // (ceil(N/64), T, K) fp32: the chunk partials (output of _partials, input of _fold)
  TensorView d_x;       // (T, K) fp32 or bf16 (output of _fold and of linear_backward_input)
};
// partials only.
Status linear_backward_input_partials(const LinearBackwardInputParams& params, Stream stream = nullptr);
// fold partials into d_x (grad and weight unused).
Status linear_fold_partials(const LinearBackwardInputParams& params, Stream stream = nullptr);
// both; partials may be absent (scratch is then internal).
Status linear_backward_input(const LinearBackwardInputParams& params, Stream stream = nullptr);

struct LinearBackwardWeightParams {
  TensorView grad;      // (T, N) fp32
  TensorView x;         // (T, K) fp32 or bf16 (upcast exactly)
  TensorView d_weight;  // (N, K) fp32 or bf16, or absent
  TensorView d_bias;    // (N,) fp32 or bf16, or absent
};
Status linear_backward_weight(const LinearBackwardWeightParams& params, Stream stream = nullptr);

// Both gradients of one linear (weight_grads as linear_backward_weight, input_grad as
// linear_backward_input with its partials given), every argument validated before anything
// is written: the same bytes as the two calls. One linear: weight_grads.grad must be the
// same view as input_grad.grad and x must be (T, K) with weight's K (ValueError), and no
// output may overlap an input of either set. On CUDA, where x, weight and d_weight share a
// dtype, T <= 8 and the rows are 16-byte aligned, d_weight and the d_x chunk partials come
// from one read of the weight.
Status linear_backward_weight_and_input(const LinearBackwardWeightParams& weight_grads,
                                        const LinearBackwardInputParams& input_grad, Stream stream = nullptr);

// SiLU VJP in FP32, elementwise: s = sigmoid(z); d = g * (s * (1 + z * (1 - s))),
// every step a separately rounded FP32 op; sigmoid(z) = 1 / (1 + exp(-z)) with
// the profile's exp. grad, pre, d_pre: same shape, fp32, contiguous; d_pre
// overlaps neither input.
struct SiluBackwardParams {
  TensorView grad;
  TensorView pre;
  TensorView d_pre;
  Numerics numerics = Numerics::kPortable;
};
Status silu_backward(const SiluBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
