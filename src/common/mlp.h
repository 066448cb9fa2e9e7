// The two-layer SiLU MLP shared by timestep_mlp and combined_timestep_embedding
// (docs/numerics.md 5.3 and 6.3). Internal.
//
// T = the MLP's dtype: x, w1, b1, w2, b2, out and the saved pre and hidden all
// share it, fp32 or bf16 (linear's dtypes; fp16 is a TypeError).
// Forward, fp32: hidden = linear(x, W1, b1) with the SiLU epilogue, pre its
//                FP32 pre-activation; out = linear(hidden, W2, b2)
// Forward, bf16: pre = R(linear(x, W1, b1)); hidden = R(silu_P(pre));
//                out = R(linear(hidden, W2, b2)): eager's rounding points
// (fp32 is the same formula with every R the identity, so one contract.)
// Backward: g = fp32(grad_out) (exact); dW2, db2 = linear d_W / d_b (g, hidden);
//           d_hidden = linear d_x (g, W2) FP32, not rounded through hidden's
//           cast (its VJP is the identity); d_pre = silu_backward(d_hidden,
//           fp32(pre)); dW1, db1 = linear d_W / d_b (d_pre, x); d_x = linear
//           d_x (d_pre, W1); each output rounded once to its dtype.
//
// Use: validate_* first (every op validates all of its MLPs before the first
// write), then forward / backward, which take scratch memory for the absent
// or intermediate tensors.
#pragma once

#include <memory>
#include <string>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace mlp {

// One MLP's operands: x (R, K), w1 (H, K), b1 (H,), w2 (D, H), b2 (D,).
struct Operands {
  TensorView x, w1, b1, w2, b2;
};

// The forward's outputs: out (R, D); pre, hidden (R, H), each may be absent.
struct Outputs {
  TensorView out, pre, hidden;
};

// The backward's tensors: pre, hidden saved by the forward (R, H); grad_out
// (R, D) fp32 or T; the gradients fp32 or T, each may be absent.
struct Gradients {
  TensorView pre, hidden, grad_out;
  TensorView d_x, d_w1, d_b1, d_w2, d_b2;
};

// How error messages name the tensors: x_name for x, out_name for out (and
// grad_<out_name> for its gradient, d_<x_name> for x's), prefix + "w1" etc.
// for the rest.
struct Names {
  std::string x = "features", out = "temb", prefix;
  std::string operator()(const char* name) const { return prefix + name; }
};

// The scratch of one run: the outputs with every absent intermediate filled
// in, and the FP32 working tensors. An op that runs several MLPs takes all of
// their scratch (prepare_*) before it runs the first (run_*).
struct ForwardScratch {
  Outputs out;
  TensorView pre_f32;
  std::shared_ptr<void> owners[3];
};
struct BackwardScratch {
  Gradients g;
  TensorView grad_f32, pre_f32, d_hidden, d_pre, hidden_partials, x_partials;
  std::shared_ptr<void> owners[6];
};

Status validate_forward(const Operands& in, const Outputs& out, Numerics numerics, const Names& names);
Status prepare_forward(const Operands& in, const Outputs& out, Stream stream, ForwardScratch* scratch);
Status run_forward(const Operands& in, const ForwardScratch& scratch, Numerics numerics, Stream stream);
Status forward(const Operands& in, const Outputs& out, Numerics numerics, Stream stream);  // prepare, then run

// b1 and b2 are not read (may be absent).
Status validate_backward(const Operands& in, const Gradients& g, Numerics numerics, const Names& names);
Status prepare_backward(const Operands& in, const Gradients& g, Stream stream, BackwardScratch* scratch);
Status run_backward(const Operands& in, const BackwardScratch& scratch, Numerics numerics, Stream stream);
Status backward(const Operands& in, const Gradients& g, Numerics numerics, Stream stream);  // prepare, then run

}  // namespace mlp
}  // namespace detdit
