// FP64 oracles, one set for the whole tree: the math of every op written as
// straightforward double loops, independently of docs/numerics.md's FP32
// orders, with the model's storage roundings (correctly rounded from the
// exact value) where the model stores a value. The CPU tests use them to show
// the reference itself is accurate; detdit verify reports the error against them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cases/index_case.h"
#include "cases/tensor.h"

namespace detdit {
namespace cases {

// ---- rounding of exact values ------------------------------------------------

// The correctly rounded (RNE) value of an exact result in `dtype`, as bits and as a value.
uint64_t correctly_rounded_bits(double exact, DType dtype);
double correctly_rounded(double exact, DType dtype);
// How many elements of `got` equal the correctly rounded `exact`, and their fraction.
int64_t count_correctly_rounded(const HostTensor& got, const std::vector<double>& exact);
double fraction_correctly_rounded(const HostTensor& got, const std::vector<double>& exact);
// A tensor's elements as doubles (exact for every float dtype).
std::vector<double> to_doubles(const HostTensor& t);
// max |got - ref| / max |ref|, and max |got - ref|; NaN where either holds a NaN.
double relative_max_error(const HostTensor& got, const std::vector<double>& ref);
double max_abs_error(const HostTensor& got, const std::vector<double>& ref);

// ---- elementwise ---------------------------------------------------------------

inline double silu64(double z) { return z / (1.0 + std::exp(-z)); }
// d silu / dz = s (1 + z (1 - s)), s = sigmoid(z)
inline double silu_derivative64(double z) {
  const double s = 1.0 / (1.0 + std::exp(-z));
  return s * (1.0 + z * (1.0 - s));
}

// ---- linear (y = x W^T + b) ---------------------------------------------------

// y[t, n] = sum_k x[t, k] w[n, k] (+ b[n]); x (T, K), w (N, K), b (N,) or empty.
std::vector<double> linear64(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b,
                             int64_t rows, int64_t in_features, int64_t out_features);
// The same with w read straight from an fp32 or bf16 tensor (no FP64 copy of an H3-sized weight).
std::vector<double> linear64(const std::vector<double>& x, const HostTensor& w, const std::vector<double>& b,
                             int64_t rows, int64_t in_features, int64_t out_features);
// d_x[t, k] = sum_n g[t, n] w[n, k]
std::vector<double> linear_d_x64(const std::vector<double>& g, const std::vector<double>& w, int64_t rows,
                                 int64_t in_features, int64_t out_features);
// d_w[n, k] = sum_t g[t, n] x[t, k]
std::vector<double> linear_d_w64(const std::vector<double>& g, const std::vector<double>& x, int64_t rows,
                                 int64_t in_features, int64_t out_features);
// d_b[n] = sum_t g[t, n]
std::vector<double> linear_d_b64(const std::vector<double>& g, int64_t rows, int64_t out_features);

// ---- timestep_sinusoid -----------------------------------------------------------

// diffusers' get_timestep_embedding (Timesteps(C, flip_sin_to_cos,
// downscale_freq_shift, scale)) in FP64: half = C / 2,
// freq[k] = exp(-ln(max_period) k / (half - downscale_freq_shift)),
// arg = scale t freq, features[t] = [cos(arg) | sin(arg)] (flip_sin_to_cos;
// else [sin | cos]), then a zero column when C is odd.
struct SinusoidOracle64 {
  double max_period = 10000.0;
  bool flip_sin_to_cos = true;
  double downscale_freq_shift = 0.0, scale = 1.0;
};
std::vector<double> sinusoid_frequencies64(int64_t half, double max_period, double downscale_freq_shift = 0.0);
std::vector<double> sinusoid64(const std::vector<double>& timesteps, int64_t channels, const SinusoidOracle64& o);
std::vector<double> sinusoid64(const std::vector<double>& timesteps, int64_t channels, double max_period);
// d_t[t] = sum_k scale freq[k] (-g[t, cos column k] sin(arg) + g[t, sin column k] cos(arg))
std::vector<double> sinusoid_d_t64(const std::vector<double>& timesteps, const std::vector<double>& grad,
                                   int64_t channels, const SinusoidOracle64& o);
std::vector<double> sinusoid_d_t64(const std::vector<double>& timesteps, const std::vector<double>& grad,
                                   int64_t channels, double max_period);

// ---- rmsnorm, gate_residual, adaln_row_gather ----------------------------------

// The (modulated) RMSNorm forward and backward, rounding to `dtype` where the
// model stores values (n = norm(x), 1 + scale, the product, the sum) and
// straight through for the gradient. shift/scale null for the plain norm;
// row_of[p] is the table row of flattened position p.
struct RmsnormReference {
  std::vector<double> out, dx, d_weight, d_shift, d_scale;
};
RmsnormReference rmsnorm_reference(const HostTensor& x, const HostTensor& weight, const HostTensor* shift,
                                   const HostTensor* scale, const std::vector<int64_t>& row_of, int64_t num_rows,
                                   const HostTensor& grad, double eps, DType dtype);

// The exact (3T, 6H) gather gradient: d_rows[r, chunk*H + i] = sum of
// grad[chunk, p, i] over the positions p of row r; grad (6, B*S, H).
std::vector<double> row_gather_grad_exact(const IndexCase& c, const HostTensor& grad, int64_t hidden);

// ---- the two-layer SiLU MLP (timestep_mlp, combined_timestep_embedding) ---------------

// The MLP in FP64 with the model's storage roundings in `dtype` (the identity
// for fp32): pre = R(x W1^T + b1), hidden = R(silu(pre)), out = hidden W2^T +
// b2 before its rounding. Each stage also from the run's own saved input to it
// (run_pre, run_hidden: what the run's next stage read), so that a stage is
// measured alone: pre_exact from x; hidden_of_run_pre = R(silu(run_pre));
// out_of_run_hidden from run_hidden, with the magnitude sum |h_k w_k| + |b|
// of its terms. The backward, straight through every rounding, from the run's
// pre and hidden and the exact gradient g: d_w2 = g^T hidden, d_b2 = sum g,
// d_pre = (g W2) silu'(pre), d_w1 = d_pre^T x, d_b1 = sum d_pre, d_x = d_pre W1.
struct MlpReference {
  std::vector<double> pre_exact, pre_magnitude, hidden_of_run_pre, out_of_run_hidden, out_magnitude;
  std::vector<double> out;  // the whole chain from x alone, with the roundings above
  std::vector<double> d_x, d_w1, d_b1, d_w2, d_b2;
};
MlpReference mlp_reference(const HostTensor& x, const HostTensor& w1, const HostTensor& b1, const HostTensor& w2,
                           const HostTensor& b2, const HostTensor& run_pre, const HostTensor& run_hidden,
                           const HostTensor* grad);

// ---- the AdaLN projection -----------------------------------------------------------

// act = R_W(silu(temb)), table = R_W(act W^T + b) (W = `dtype`); backward from
// an exact table gradient d_table (T, N): dW = d_table^T act, db = sum_t
// d_table, d_temb = silu'(temb) * (d_table W).
struct ProjectionReference {
  std::vector<double> act, table, d_weight, d_bias, d_temb;
};
ProjectionReference projection_reference(const HostTensor& temb, const HostTensor& weight, const HostTensor& bias,
                                         const std::vector<double>* d_table, DType dtype);

// The table before its rounding, in FP64, from the activation as the model
// casts it (silu(temb) to fp32, then to the weight's 16-bit dtype): exact[t, n]
// = sum_k act[t, k] w[n, k] + b[n], and magnitude[t, n] = sum_k |act[t, k]
// w[n, k]| + |b[n]| (what an FP32 chain's rounding error scales with).
struct ProjectionExact {
  std::vector<double> exact, magnitude;
};
ProjectionExact projection_exact64(const HostTensor& temb, const HostTensor& weight, const HostTensor& bias);

// ---- the fused AdaLN ops' weight gradients (adaln_modulation, final_adaln_out) ----

// act = silu(temb) in FP64, rounded once to `dtype` (T, D).
std::vector<double> adaln_act64(const HostTensor& temb, DType dtype);
// final_adaln_out's exact table gradient (T, 2H) = [d_shift | d_scale]:
// d_shift[t, i] = sum of g[p, i], d_scale[t, i] = sum of g[p, i] n[p, i] over
// the positions p of timestep t, n = R_x(w x rstd) (rounded to x's dtype, as
// the model stores it), rstd = 1 / sqrt(mean(x^2) + eps), all in FP64.
// (adaln_modulation's (T, 18H) table gradient is row_gather_grad_exact's
// (3T, 6H) rows, the same bytes.)
std::vector<double> final_table_grad64(const HostTensor& x, const HostTensor& norm_weight, const HostTensor& grad,
                                       const IndexCase& index, double eps);
// The fraction of a projection's weight gradient that is not the correctly
// rounded FP64 dW[n, k] = sum_t d_table[t, n] act[t, k], over the rows n = 0,
// stride, 2 stride, ... of d_weight (N, D); and of d_bias (N,) against db[n]
// = sum_t d_table[t, n]. d_table (T, N), act (T, D).
double weight_grad_fraction_not_rn(const std::vector<double>& d_table, const std::vector<double>& act,
                                   const HostTensor& d_weight, int64_t stride);
double bias_grad_fraction_not_rn(const std::vector<double>& d_table, const HostTensor& d_bias);

// ---- the modulation forms of rmsnorm and gate_residual ---------------------------

// A modulation tensor as the oracles read it, whatever its form: element i of
// modulation row g is t->get(g * row_stride + offset + i) (t null: absent).
// group_of[p] (below) gives the row of flattened position p: the table row
// (indexed), b (per sample), b*F + s / (S/F) (per frame), p (per token).
struct ModulationRows {
  const HostTensor* t = nullptr;
  int64_t row_stride = 0, offset = 0;
  double at(int64_t g, int64_t i) const { return t->get(g * row_stride + offset + i); }
};

// A modulated op's forward in FP64 without any rounding, and the magnitude
// its roundings act on (what an accuracy bound is stated in):
//   rmsnorm:       product = w x rstd (1 + scale), rstd = 1 / sqrt(mean(x^2) + eps),
//                  exact = product + shift (absent shift and scale: the plain norm,
//                  exact = product = w x rstd)
//   gate_residual: product = (k + gate) y (absent gate: y), exact = residual + product
// x, residual, y (P, H) or (B, S, H); weight (H,).
struct ModulatedExact {
  std::vector<double> exact, product;
};
ModulatedExact rmsnorm_exact64(const HostTensor& x, const HostTensor& weight, const ModulationRows& shift,
                               const ModulationRows& scale, const std::vector<int64_t>& group_of, double eps);
ModulatedExact gate_residual_exact64(const HostTensor& residual, const HostTensor& y, const ModulationRows& gate,
                                     const std::vector<int64_t>& group_of, double k);

// ---- layernorm ---------------------------------------------------------------------

// F.layer_norm over the last dimension in FP64: mean, var = mean((x - mean)^2),
// rstd = 1 / sqrt(var + eps), xhat = (x - mean) rstd, out = R(w xhat + b)
// (rounded once to `dtype`, as the model stores it; w = 1, b = 0 when absent);
// backward with gw = g w: dx = rstd (gw - mean(gw) - xhat mean(gw xhat)),
// d_weight = sum_p g xhat, d_bias = sum_p g. weight / bias null when absent.
struct LayernormReference {
  std::vector<double> exact_out, out, mean, rstd, dx, d_weight, d_bias;  // exact_out: w xhat + b unrounded
};
LayernormReference layernorm_reference(const HostTensor& x, const HostTensor* weight, const HostTensor* bias,
                                       const HostTensor& grad, double eps, DType dtype);

// ---- layernorm's bytes: docs/numerics.md 9 as plain scalar loops -------------------

// A second route to layernorm's outputs, bitwise: 9.1-9.6 written out here
// step by step (each step one FP32 operation of common/scalar_math.h, the
// Welford tree, BlockReduceSum and the reductions as plain loops), sharing no
// code with the op's CPU reference (src/cpu/layernorm.cc,
// src/common/layernorm_math.h). Modulated (shift.t set) in any form:
// group_of[p] is position p's modulation row; the gradient sums run per
// group of group_len contiguous positions (grouped forms, 6.11), or, with
// group_len 0, as the canonical reduction over the rows (indexed, 6.5).
struct LayernormNumericsInputs {
  const HostTensor* x = nullptr;  // (M, H) or (B, S, H)
  const HostTensor* weight = nullptr;  // or null (no affine)
  const HostTensor* bias = nullptr;    // or null
  const HostTensor* grad = nullptr;    // out's dtype; null: no backward
  ModulationRows shift, scale;         // t null: the plain norm
  std::vector<int64_t> group_of;
  int64_t group_len = 0, num_rows = 0;  // num_rows: modulation rows (d_shift, d_scale rows)
  DType mod_dtype = DType::kF32;
  bool upcast = false;
  float eps = 1e-6f;
};
// The outputs to write, each with its dtype and shape (null: not wanted);
// d_shift and d_scale are (num_rows, H) in row order, whatever their shape.
struct LayernormNumericsOutputs {
  HostTensor *out = nullptr, *mean = nullptr, *rstd = nullptr, *dx = nullptr;
  HostTensor *d_weight = nullptr, *d_bias = nullptr, *d_shift = nullptr, *d_scale = nullptr;
};
void layernorm_numerics9(const LayernormNumericsInputs& in, const LayernormNumericsOutputs& out);

}  // namespace cases
}  // namespace detdit
