// cases/oracle.h: the FP64 oracles.
#include "cases/oracle.h"

#include <cmath>
#include <cstring>

#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"

namespace detdit {
namespace cases {

uint64_t correctly_rounded_bits(double exact, DType dtype) {
  const float nearest_float = static_cast<float>(exact);  // correctly rounded to fp32 (RNE)
  if (dtype == DType::kF32) return num::float_bits(nearest_float);
  // 16-bit: pick the nearest of the candidate and its neighbours in FP64 (exact), ties to even.
  auto encode = [&](float v) -> uint16_t { return dtype == DType::kBF16 ? num::float_to_bf16(v) : num::float_to_f16(v); };
  auto decode = [&](uint16_t h) -> double {
    return dtype == DType::kBF16 ? num::bf16_to_float(h) : num::f16_to_float(h);
  };
  if (std::isnan(exact)) return num::kCanonicalNan16;
  const uint16_t guess = encode(nearest_float);
  uint16_t best = guess;
  double best_err = std::fabs(decode(guess) - exact);
  for (int delta : {-1, 1}) {
    const uint16_t cand = static_cast<uint16_t>(guess + delta);
    const double v = decode(cand);
    if (std::isnan(v) || ((cand ^ guess) & 0x8000u)) continue;
    const double err = std::fabs(v - exact);
    if (err < best_err || (err == best_err && (cand & 1u) == 0)) {
      best = cand;
      best_err = err;
    }
  }
  return best;
}

double correctly_rounded(double exact, DType dtype) {
  const uint64_t bits = correctly_rounded_bits(exact, dtype);
  if (dtype == DType::kF32) return num::bits_float(static_cast<uint32_t>(bits));
  return dtype == DType::kBF16 ? num::bf16_to_float(static_cast<uint16_t>(bits))
                               : num::f16_to_float(static_cast<uint16_t>(bits));
}

int64_t count_correctly_rounded(const HostTensor& got, const std::vector<double>& exact) {
  int64_t hits = 0;
  const std::size_t width = dtype_size(got.dtype());
  for (int64_t i = 0; i < got.numel(); ++i) {
    uint64_t bits = 0;
    std::memcpy(&bits, static_cast<const char*>(got.data()) + i * width, width);
    hits += bits == correctly_rounded_bits(exact[i], got.dtype()) ? 1 : 0;
  }
  return hits;
}

double fraction_correctly_rounded(const HostTensor& got, const std::vector<double>& exact) {
  return got.numel() ? static_cast<double>(count_correctly_rounded(got, exact)) / static_cast<double>(got.numel())
                     : 1.0;
}

std::vector<double> to_doubles(const HostTensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = t.get(i);
  return out;
}

double relative_max_error(const HostTensor& got, const std::vector<double>& ref) {
  double err = 0.0, scale = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double e = std::fabs(got.get(i) - ref[i]);
    if (std::isnan(e)) return e;  // std::max would drop it: a NaN must fail every bound
    err = std::max(err, e);
    scale = std::max(scale, std::fabs(ref[i]));
  }
  return scale > 0.0 ? err / scale : err;
}

double max_abs_error(const HostTensor& got, const std::vector<double>& ref) {
  double err = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double e = std::fabs(got.get(i) - ref[i]);
    if (std::isnan(e)) return e;  // as above
    err = std::max(err, e);
  }
  return err;
}

namespace {

// linear64 (oracle.h) with w given by `weight_row(n, row)`, which writes row n
// of w as doubles into row.
template <typename WeightRow>
std::vector<double> linear64_rows(const std::vector<double>& x, WeightRow weight_row, const std::vector<double>& b,
                                  int64_t rows, int64_t in_features, int64_t out_features) {
  std::vector<double> y(static_cast<std::size_t>(rows * out_features));
  cpu::parallel_for(0, out_features, [&](int64_t n) {
    std::vector<double> wn(static_cast<std::size_t>(in_features));
    weight_row(n, wn.data());
    for (int64_t t = 0; t < rows; ++t) {
      const double* xt = x.data() + t * in_features;
      double acc = b.empty() ? 0.0 : b[n];
      for (int64_t k = 0; k < in_features; ++k) acc += xt[k] * wn[k];
      y[t * out_features + n] = acc;
    }
  });
  return y;
}

}  // namespace

std::vector<double> linear64(const std::vector<double>& x, const std::vector<double>& w,
                                    const std::vector<double>& b, int64_t rows, int64_t in_features,
                                    int64_t out_features) {
  return linear64_rows(
      x, [&](int64_t n, double* row) { std::copy_n(w.data() + n * in_features, in_features, row); }, b, rows,
      in_features, out_features);
}

std::vector<double> linear64(const std::vector<double>& x, const HostTensor& w, const std::vector<double>& b,
                                    int64_t rows, int64_t in_features, int64_t out_features) {
  const bool bf16 = w.dtype() == DType::kBF16;
  return linear64_rows(
      x,
      [&](int64_t n, double* row) {
        for (int64_t k = 0; k < in_features; ++k)
          row[k] = bf16 ? num::bf16_to_float(w.ptr<uint16_t>()[n * in_features + k])
                        : w.ptr<float>()[n * in_features + k];
      },
      b, rows, in_features, out_features);
}

std::vector<double> linear_d_x64(const std::vector<double>& g, const std::vector<double>& w, int64_t rows,
                                        int64_t in_features, int64_t out_features) {
  std::vector<double> d_x(static_cast<std::size_t>(rows * in_features), 0.0);
  cpu::parallel_for(0, rows, [&](int64_t t) {
    for (int64_t n = 0; n < out_features; ++n)
      for (int64_t k = 0; k < in_features; ++k) d_x[t * in_features + k] += g[t * out_features + n] * w[n * in_features + k];
  });
  return d_x;
}

std::vector<double> linear_d_w64(const std::vector<double>& g, const std::vector<double>& x, int64_t rows,
                                        int64_t in_features, int64_t out_features) {
  std::vector<double> d_w(static_cast<std::size_t>(out_features * in_features), 0.0);
  cpu::parallel_for(0, out_features, [&](int64_t n) {
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t k = 0; k < in_features; ++k) d_w[n * in_features + k] += g[t * out_features + n] * x[t * in_features + k];
  });
  return d_w;
}

std::vector<double> linear_d_b64(const std::vector<double>& g, int64_t rows, int64_t out_features) {
  std::vector<double> d_b(static_cast<std::size_t>(out_features), 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t n = 0; n < out_features; ++n) d_b[n] += g[t * out_features + n];
  return d_b;
}

std::vector<double> sinusoid_frequencies64(int64_t half, double max_period, double downscale_freq_shift) {
  std::vector<double> freq(static_cast<std::size_t>(half));
  for (int64_t k = 0; k < half; ++k)
    freq[k] = std::exp(-std::log(max_period) * static_cast<double>(k) / (static_cast<double>(half) - downscale_freq_shift));
  return freq;
}

std::vector<double> sinusoid64(const std::vector<double>& timesteps, int64_t channels, const SinusoidOracle64& o) {
  const int64_t half = channels / 2, rows = static_cast<int64_t>(timesteps.size());
  const std::vector<double> freq = sinusoid_frequencies64(half, o.max_period, o.downscale_freq_shift);
  const int64_t cos_at = o.flip_sin_to_cos ? 0 : half, sin_at = o.flip_sin_to_cos ? half : 0;
  std::vector<double> out(static_cast<std::size_t>(rows * channels), 0.0);  // an odd C's last column stays 0
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t k = 0; k < half; ++k) {
      const double arg = o.scale * timesteps[t] * freq[k];
      out[t * channels + cos_at + k] = std::cos(arg);
      out[t * channels + sin_at + k] = std::sin(arg);
    }
  return out;
}

std::vector<double> sinusoid64(const std::vector<double>& timesteps, int64_t channels, double max_period) {
  SinusoidOracle64 o;
  o.max_period = max_period;
  return sinusoid64(timesteps, channels, o);
}

std::vector<double> sinusoid_d_t64(const std::vector<double>& timesteps, const std::vector<double>& grad,
                                   int64_t channels, const SinusoidOracle64& o) {
  const int64_t half = channels / 2, rows = static_cast<int64_t>(timesteps.size());
  const std::vector<double> freq = sinusoid_frequencies64(half, o.max_period, o.downscale_freq_shift);
  const int64_t cos_at = o.flip_sin_to_cos ? 0 : half, sin_at = o.flip_sin_to_cos ? half : 0;
  std::vector<double> d_t(static_cast<std::size_t>(rows), 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t k = 0; k < half; ++k) {
      const double arg = o.scale * timesteps[t] * freq[k];
      d_t[t] += o.scale * freq[k] *
                (-grad[t * channels + cos_at + k] * std::sin(arg) + grad[t * channels + sin_at + k] * std::cos(arg));
    }
  return d_t;
}

std::vector<double> sinusoid_d_t64(const std::vector<double>& timesteps, const std::vector<double>& grad,
                                   int64_t channels, double max_period) {
  SinusoidOracle64 o;
  o.max_period = max_period;
  return sinusoid_d_t64(timesteps, grad, channels, o);
}

RmsnormReference rmsnorm_reference(const HostTensor& x, const HostTensor& weight, const HostTensor* shift,
                                   const HostTensor* scale, const std::vector<int64_t>& row_of, int64_t num_rows,
                                   const HostTensor& grad, double eps, DType dtype) {
  const int64_t hidden = weight.numel(), positions = x.numel() / hidden;
  auto stored = [&](double v) { return correctly_rounded(v, dtype); };  // the model stores this value
  RmsnormReference ref;
  ref.out.resize(x.numel());
  ref.dx.resize(x.numel());
  ref.d_weight.assign(hidden, 0.0);
  ref.d_shift.assign(num_rows * hidden, 0.0);
  ref.d_scale.assign(num_rows * hidden, 0.0);
  std::vector<double> d_n(hidden);
  for (int64_t p = 0; p < positions; ++p) {
    const int64_t base = p * hidden, table = row_of.empty() ? 0 : row_of[p] * hidden;
    double ss = 0;
    for (int64_t i = 0; i < hidden; ++i) ss += x.get(base + i) * x.get(base + i);
    const double rstd = 1.0 / std::sqrt(ss / hidden + eps);
    double dot = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      const double xi = x.get(base + i), wi = weight.get(i), g = grad.get(base + i);
      const double n = stored(wi * xi * rstd);
      const double t1 = shift ? stored(1.0 + scale->get(table + i)) : 1.0;
      ref.out[base + i] = shift ? stored(stored(n * t1) + shift->get(table + i)) : n;
      d_n[i] = g * t1;
      dot += wi * d_n[i] * xi;
      ref.d_weight[i] += d_n[i] * xi * rstd;
      if (shift) {
        ref.d_shift[table + i] += g;
        ref.d_scale[table + i] += g * n;
      }
    }
    for (int64_t i = 0; i < hidden; ++i) {
      const double xi = x.get(base + i);
      ref.dx[base + i] = rstd * weight.get(i) * d_n[i] - xi * rstd * rstd * rstd * dot / hidden;
    }
  }
  return ref;
}

std::vector<double> row_gather_grad_exact(const IndexCase& c, const HostTensor& grad, int64_t hidden) {
  std::vector<double> sum(c.num_rows() * 6 * hidden, 0.0);
  for (int chunk = 0; chunk < 6; ++chunk)
    for (int64_t p = 0; p < c.positions(); ++p)
      for (int64_t i = 0; i < hidden; ++i)
        sum[c.row(p % c.seq_len) * 6 * hidden + chunk * hidden + i] += grad.get((chunk * c.positions() + p) * hidden + i);
  return sum;
}

ProjectionReference projection_reference(const HostTensor& temb, const HostTensor& weight, const HostTensor& bias,
                                         const std::vector<double>* d_table, DType dtype) {
  const int64_t rows = temb.shape()[0], in = temb.shape()[1], out = weight.shape()[0];
  ProjectionReference ref;
  ref.act.resize(rows * in);
  ref.table.resize(rows * out);
  for (int64_t i = 0; i < rows * in; ++i) {
    const double z = temb.get(i);
    ref.act[i] = correctly_rounded(z / (1.0 + std::exp(-z)), dtype);
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t n = 0; n < out; ++n) {
      double acc = bias.get(n);
      for (int64_t k = 0; k < in; ++k) acc += ref.act[t * in + k] * weight.get(n * in + k);
      ref.table[t * out + n] = correctly_rounded(acc, dtype);
    }
  if (!d_table) return ref;
  ref.d_weight.assign(out * in, 0.0);
  ref.d_bias.assign(out, 0.0);
  ref.d_temb.assign(rows * in, 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t n = 0; n < out; ++n) {
      const double g = (*d_table)[t * out + n];
      ref.d_bias[n] += g;
      for (int64_t k = 0; k < in; ++k) {
        ref.d_weight[n * in + k] += g * ref.act[t * in + k];
        ref.d_temb[t * in + k] += g * weight.get(n * in + k);
      }
    }
  for (int64_t i = 0; i < rows * in; ++i) {
    const double z = temb.get(i), sig = 1.0 / (1.0 + std::exp(-z));
    ref.d_temb[i] *= sig * (1.0 + z * (1.0 - sig));
  }
  return ref;
}

MlpReference mlp_reference(const HostTensor& x, const HostTensor& w1, const HostTensor& b1, const HostTensor& w2,
                           const HostTensor& b2, const HostTensor& run_pre, const HostTensor& run_hidden,
                           const HostTensor* grad) {
  const DType dtype = x.dtype();
  const int64_t rows = x.shape()[0], k_in = x.shape()[1], hidden = w1.shape()[0], d_out = w2.shape()[0];
  auto store = [dtype](double v) { return dtype == DType::kF32 ? static_cast<double>(static_cast<float>(v))
                                                              : correctly_rounded(v, dtype); };
  auto silu_stored = [&store](double z) { return store(silu64(z)); };
  // y[t, n] = sum_k a[t, k] w[n, k] + b[n] and sum |a w| + |b|, over plain doubles.
  auto affine = [](const std::vector<double>& a, const HostTensor& w, const HostTensor& b, int64_t rows_,
                   int64_t k_, int64_t n_, std::vector<double>* y, std::vector<double>* mag) {
    y->assign(static_cast<std::size_t>(rows_ * n_), 0.0);
    if (mag) mag->assign(y->size(), 0.0);
    for (int64_t t = 0; t < rows_; ++t)
      for (int64_t n = 0; n < n_; ++n) {
        double acc = b.get(n), m = std::fabs(acc);
        for (int64_t k = 0; k < k_; ++k) {
          const double product = a[t * k_ + k] * w.get(n * k_ + k);
          acc += product;
          m += std::fabs(product);
        }
        (*y)[t * n_ + n] = acc;
        if (mag) (*mag)[t * n_ + n] = m;
      }
  };
  MlpReference r;
  const std::vector<double> xs = to_doubles(x), pre_run = to_doubles(run_pre), hidden_run = to_doubles(run_hidden);
  affine(xs, w1, b1, rows, k_in, hidden, &r.pre_exact, &r.pre_magnitude);
  r.hidden_of_run_pre.resize(pre_run.size());
  for (std::size_t i = 0; i < pre_run.size(); ++i) r.hidden_of_run_pre[i] = silu_stored(pre_run[i]);
  affine(hidden_run, w2, b2, rows, hidden, d_out, &r.out_of_run_hidden, &r.out_magnitude);
  std::vector<double> own_hidden(r.pre_exact.size());
  for (std::size_t i = 0; i < own_hidden.size(); ++i) own_hidden[i] = silu_stored(store(r.pre_exact[i]));
  affine(own_hidden, w2, b2, rows, hidden, d_out, &r.out, nullptr);
  if (!grad) return r;
  const std::vector<double> g = to_doubles(*grad);
  r.d_w2 = linear_d_w64(g, hidden_run, rows, hidden, d_out);
  r.d_b2 = linear_d_b64(g, rows, d_out);
  std::vector<double> d_pre = linear_d_x64(g, to_doubles(w2), rows, hidden, d_out);
  for (std::size_t i = 0; i < d_pre.size(); ++i) d_pre[i] *= silu_derivative64(pre_run[i]);
  r.d_w1 = linear_d_w64(d_pre, xs, rows, k_in, hidden);
  r.d_b1 = linear_d_b64(d_pre, rows, hidden);
  r.d_x = linear_d_x64(d_pre, to_doubles(w1), rows, k_in, hidden);
  return r;
}

ProjectionExact projection_exact64(const HostTensor& temb, const HostTensor& weight, const HostTensor& bias) {
  const int64_t rows = temb.shape()[0], k_in = temb.shape()[1], n_out = weight.shape()[0];
  std::vector<double> act(static_cast<std::size_t>(rows * k_in));
  for (std::size_t i = 0; i < act.size(); ++i) {
    const float silu = static_cast<float>(silu64(temb.get(static_cast<int64_t>(i))));
    act[i] = weight.dtype() == DType::kF32 ? silu : correctly_rounded(silu, weight.dtype());
  }
  ProjectionExact p;
  p.exact.assign(static_cast<std::size_t>(rows * n_out), 0.0);
  p.magnitude.assign(p.exact.size(), 0.0);
  dispatch_float_dtype(weight.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* wp = weight.ptr<T>();
    const T* bp = bias.ptr<T>();
    cpu::parallel_for(0, n_out, [&](int64_t n) {
      for (int64_t t = 0; t < rows; ++t) {
        double acc = to_float(bp[n]), mag = std::fabs(acc);
        for (int64_t k = 0; k < k_in; ++k) {
          const double product = act[t * k_in + k] * static_cast<double>(to_float(wp[n * k_in + k]));
          acc += product;
          mag += std::fabs(product);
        }
        p.exact[t * n_out + n] = acc;
        p.magnitude[t * n_out + n] = mag;
      }
    });
  });
  return p;
}

std::vector<double> adaln_act64(const HostTensor& temb, DType dtype) {
  std::vector<double> act(static_cast<std::size_t>(temb.numel()));
  for (int64_t i = 0; i < temb.numel(); ++i) act[i] = correctly_rounded(silu64(temb.get(i)), dtype);
  return act;
}

std::vector<double> final_table_grad64(const HostTensor& x, const HostTensor& norm_weight, const HostTensor& grad,
                                       const IndexCase& index, double eps) {
  const int64_t H = norm_weight.numel(), M = index.positions();
  std::vector<double> d_table(static_cast<std::size_t>(index.num_timesteps * 2 * H), 0.0);
  for (int64_t p = 0; p < M; ++p) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += x.get(p * H + i) * x.get(p * H + i);
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(H) + eps);
    double* row = d_table.data() + index.timestep_indices[p % index.seq_len] * 2 * H;
    for (int64_t i = 0; i < H; ++i) {
      const double n = correctly_rounded(norm_weight.get(i) * x.get(p * H + i) * rstd, x.dtype());
      const double g = grad.get(p * H + i);
      row[i] += g;
      row[H + i] += g * n;
    }
  }
  return d_table;
}

namespace {

// Whether element i of `got` is the correctly rounded `exact`.
bool is_correctly_rounded(const HostTensor& got, int64_t i, double exact) {
  uint64_t bits = 0;
  const std::size_t width = dtype_size(got.dtype());
  std::memcpy(&bits, static_cast<const char*>(got.data()) + i * width, width);
  return bits == correctly_rounded_bits(exact, got.dtype());
}

}  // namespace

double weight_grad_fraction_not_rn(const std::vector<double>& d_table, const std::vector<double>& act,
                                   const HostTensor& d_weight, int64_t stride) {
  const int64_t outputs = d_weight.shape()[0], embed = d_weight.shape()[1];
  const int64_t timesteps = static_cast<int64_t>(d_table.size()) / outputs;
  const int64_t sampled = (outputs + stride - 1) / stride;
  std::vector<int64_t> wrong_per_row(static_cast<std::size_t>(sampled), 0);
  cpu::parallel_for(0, sampled, [&](int64_t j) {
    const int64_t n = j * stride;
    for (int64_t k = 0; k < embed; ++k) {
      double exact = 0;
      for (int64_t t = 0; t < timesteps; ++t) exact += d_table[t * outputs + n] * act[t * embed + k];
      wrong_per_row[j] += is_correctly_rounded(d_weight, n * embed + k, exact) ? 0 : 1;
    }
  });
  int64_t wrong = 0;
  for (int64_t w : wrong_per_row) wrong += w;
  return static_cast<double>(wrong) / static_cast<double>(sampled * embed);
}

double bias_grad_fraction_not_rn(const std::vector<double>& d_table, const HostTensor& d_bias) {
  const int64_t outputs = d_bias.numel(), timesteps = static_cast<int64_t>(d_table.size()) / outputs;
  int64_t wrong = 0;
  for (int64_t n = 0; n < outputs; ++n) {
    double exact = 0;
    for (int64_t t = 0; t < timesteps; ++t) exact += d_table[t * outputs + n];
    wrong += is_correctly_rounded(d_bias, n, exact) ? 0 : 1;
  }
  return static_cast<double>(wrong) / static_cast<double>(outputs);
}

ModulatedExact rmsnorm_exact64(const HostTensor& x, const HostTensor& weight, const ModulationRows& shift,
                               const ModulationRows& scale, const std::vector<int64_t>& group_of, double eps) {
  const int64_t hidden = weight.numel(), positions = x.numel() / hidden;
  ModulatedExact e;
  e.exact.resize(x.numel());
  e.product.resize(x.numel());
  for (int64_t p = 0; p < positions; ++p) {
    const int64_t base = p * hidden;
    double ss = 0;
    for (int64_t i = 0; i < hidden; ++i) ss += x.get(base + i) * x.get(base + i);
    const double rstd = 1.0 / std::sqrt(ss / hidden + eps);
    for (int64_t i = 0; i < hidden; ++i) {
      const double n = weight.get(i) * x.get(base + i) * rstd;
      const double product = scale.t ? n * (1.0 + scale.at(group_of[p], i)) : n;
      e.product[base + i] = product;
      e.exact[base + i] = shift.t ? product + shift.at(group_of[p], i) : product;
    }
  }
  return e;
}

ModulatedExact gate_residual_exact64(const HostTensor& residual, const HostTensor& y, const ModulationRows& gate,
                                     const std::vector<int64_t>& group_of, double k) {
  const int64_t hidden = residual.shape().back(), positions = residual.numel() / hidden;
  ModulatedExact e;
  e.exact.resize(residual.numel());
  e.product.resize(residual.numel());
  for (int64_t p = 0; p < positions; ++p)
    for (int64_t i = 0; i < hidden; ++i) {
      const int64_t at = p * hidden + i;
      const double product = gate.t ? (k + gate.at(group_of[p], i)) * y.get(at) : y.get(at);
      e.product[at] = product;
      e.exact[at] = residual.get(at) + product;
    }
  return e;
}

LayernormReference layernorm_reference(const HostTensor& x, const HostTensor* weight, const HostTensor* bias,
                                       const HostTensor& grad, double eps, DType dtype) {
  const int64_t hidden = x.shape().back(), rows = x.numel() / hidden;
  LayernormReference ref;
  ref.exact_out.resize(x.numel());
  ref.out.resize(x.numel());
  ref.dx.resize(x.numel());
  ref.mean.resize(rows);
  ref.rstd.resize(rows);
  ref.d_weight.assign(hidden, 0.0);
  ref.d_bias.assign(hidden, 0.0);
  std::vector<double> xhat(hidden), gw(hidden);
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t base = m * hidden;
    double sum = 0;
    for (int64_t i = 0; i < hidden; ++i) sum += x.get(base + i);
    const double mean = sum / hidden;
    double sq = 0;
    for (int64_t i = 0; i < hidden; ++i) sq += (x.get(base + i) - mean) * (x.get(base + i) - mean);
    const double rstd = 1.0 / std::sqrt(sq / hidden + eps);
    ref.mean[m] = mean;
    ref.rstd[m] = rstd;
    double mean_gw = 0, mean_gw_xhat = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      const double w = weight ? weight->get(i) : 1.0, b = bias ? bias->get(i) : 0.0, g = grad.get(base + i);
      xhat[i] = (x.get(base + i) - mean) * rstd;
      gw[i] = g * w;
      ref.exact_out[base + i] = w * xhat[i] + b;
      ref.out[base + i] = correctly_rounded(ref.exact_out[base + i], dtype);
      mean_gw += gw[i] / hidden;
      mean_gw_xhat += gw[i] * xhat[i] / hidden;
      ref.d_weight[i] += g * xhat[i];
      ref.d_bias[i] += g;
    }
    for (int64_t i = 0; i < hidden; ++i) ref.dx[base + i] = rstd * (gw[i] - mean_gw - xhat[i] * mean_gw_xhat);
  }
  return ref;
}

namespace {

constexpr int64_t kReductionChunk = 256;  // positions per chunk (6.5)

// v rounded to `dtype` and widened back (exact): R_dtype of an FP32 value.
float rounded_to(float v, DType dtype) {
  if (dtype == DType::kBF16) return num::bf16_to_float(num::float_to_bf16(v));
  if (dtype == DType::kF16) return num::f16_to_float(num::float_to_f16(v));
  return v;
}

struct WelfordState {
  float mean, m2, count;
};

WelfordState welford_step(WelfordState s, float v) {  // 9.1 step
  const float delta = num::sub32(v, s.mean);
  const float count = num::add32(s.count, 1.0f);
  const float r = num::div32(1.0f, count);
  const float mean = num::fma32(delta, r, s.mean);
  return {mean, num::fma32(delta, num::sub32(v, mean), s.m2), count};
}

WelfordState welford_combine(WelfordState own, WelfordState other) {  // 9.1 combine
  const float delta = num::sub32(own.mean, other.mean);
  const float count = num::add32(other.count, own.count);
  if (!(count > 0.0f)) return {0.0f, 0.0f, count};
  const float coef = num::div32(1.0f, count);
  const float n_oth = num::mul32(other.count, coef), n_own = num::mul32(own.count, coef);
  return {num::fma32(n_oth, other.mean, num::mul32(n_own, own.mean)),
          num::fma32(num::mul32(num::mul32(delta, delta), other.count), n_own, num::add32(other.m2, own.m2)), count};
}

// 9.1 row_stats of the H values at row: (mean, var).
void welford_row_stats(const std::vector<float>& row, float* mean, float* var) {
  const int64_t h = static_cast<int64_t>(row.size());
  std::vector<WelfordState> s(128, WelfordState{0.0f, 0.0f, 0.0f});
  for (int t = 0; t < 128; ++t)
    for (int64_t j = t; j < h / 4; j += 128)
      for (int e = 0; e < 4; ++e) s[t] = welford_step(s[t], row[4 * j + e]);
  WelfordState warp[4];
  for (int w = 0; w < 4; ++w) {
    std::vector<WelfordState> v(s.begin() + 32 * w, s.begin() + 32 * w + 32);
    for (int off = 16; off >= 1; off /= 2)
      for (int l = 0; l < off; ++l) v[l] = welford_combine(v[l], v[l + off]);
    warp[w] = v[0];
  }
  const WelfordState total = welford_combine(welford_combine(warp[0], warp[2]), welford_combine(warp[1], warp[3]));
  *mean = total.mean;
  *var = num::div32(total.m2, static_cast<float>(h));
}

// 9.3 block_sum of 128 thread values.
float block_sum128(const std::vector<float>& v) {
  float warp[4];
  for (int w = 0; w < 4; ++w) {
    std::vector<float> u(v.begin() + 32 * w, v.begin() + 32 * w + 32);
    for (int off = 16; off >= 1; off /= 2)
      for (int l = 0; l < off; ++l) u[l] = num::add32(u[l], u[l + off]);
    warp[w] = u[0];
  }
  return num::add32(num::add32(num::add32(warp[0], 0.0f), num::add32(warp[2], 0.0f)),
                    num::add32(num::add32(warp[1], 0.0f), num::add32(warp[3], 0.0f)));
}

}  // namespace

void layernorm_numerics9(const LayernormNumericsInputs& in, const LayernormNumericsOutputs& o) {
  const HostTensor& xt = *in.x;
  const int64_t h = xt.shape().back(), positions = xt.numel() / h;
  const bool on = in.shift.t != nullptr, has_w = in.weight != nullptr, has_b = in.bias != nullptr;
  const DType t = xt.dtype(), m = in.mod_dtype, promoted = m == DType::kF32 ? DType::kF32 : t;
  // Where each step rounds (9.5, 5.12): eager's promoted dtypes, or FP32 and one rounding at the end.
  auto norm_r = [&](float v) { return in.upcast ? v : rounded_to(v, t); };
  auto factor_r = [&](float v) { return in.upcast ? v : rounded_to(v, m); };
  auto mid_r = [&](float v) { return in.upcast ? v : rounded_to(v, promoted); };
  auto w = [&](int64_t i) { return has_w ? static_cast<float>(in.weight->get(i)) : 1.0f; };
  auto x = [&](int64_t p, int64_t i) { return static_cast<float>(xt.get(p * h + i)); };
  auto g = [&](int64_t p, int64_t i) { return static_cast<float>(in.grad->get(p * h + i)); };
  auto t1 = [&](int64_t p, int64_t i) {
    return factor_r(num::add32(1.0f, static_cast<float>(in.scale.at(in.group_of[p], i))));
  };
  std::vector<float> n(positions * h), d_n(positions * h), xhat(positions * h);
  for (int64_t p = 0; p < positions; ++p) {
    std::vector<float> row(h);
    for (int64_t i = 0; i < h; ++i) row[i] = x(p, i);
    float mu = 0, var = 0;
    welford_row_stats(row, &mu, &var);
    const float rs = num::portable_rsqrt(num::add32(var, in.eps));  // 9.2, the portable profile
    if (o.mean) o.mean->set(p, mu);
    if (o.rstd) o.rstd->set(p, rs);
    for (int64_t i = 0; i < h; ++i) {
      const float pi = num::mul32(rs, num::sub32(x(p, i), mu));
      const float v = !has_w ? pi : has_b ? num::fma32(w(i), pi, static_cast<float>(in.bias->get(i))) : num::mul32(w(i), pi);
      const int64_t e = p * h + i;
      xhat[e] = num::mul32(num::sub32(x(p, i), mu), rs);
      if (!on) {
        if (o.out) o.out->set(e, v);  // set() rounds once to out's dtype
        if (in.grad) d_n[e] = g(p, i);
        continue;
      }
      n[e] = norm_r(v);
      const float u = mid_r(num::mul32(n[e], t1(p, i)));
      if (o.out) o.out->set(e, num::add32(u, static_cast<float>(in.shift.at(in.group_of[p], i))));
      if (in.grad) d_n[e] = num::mul32(g(p, i), t1(p, i));
    }
    if (!in.grad || !o.dx) continue;
    // 9.3 with d_n for g (9.6).
    std::vector<float> s1(128, 0.0f), s2(128, 0.0f);
    for (int tt = 0; tt < 128; ++tt)
      for (int64_t j = tt; j < h / 4; j += 128)
        for (int e = 0; e < 4; ++e) {
          const int64_t i = 4 * j + e;
          const float gw = num::mul32(d_n[p * h + i], w(i));
          s1[tt] = num::add32(s1[tt], gw);
          s2[tt] = num::fma32(num::mul32(gw, num::sub32(x(p, i), mu)), rs, s2[tt]);
        }
    const float S1 = block_sum128(s1), S2 = block_sum128(s2), fh = static_cast<float>(h);
    const float term1 = num::mul32(num::div32(1.0f, fh), rs);
    for (int64_t i = 0; i < h; ++i) {
      const float a = num::mul32(num::mul32(num::sub32(x(p, i), mu), rs), S2);
      const float f = num::fma32(num::mul32(fh, w(i)), d_n[p * h + i], -a);
      o.dx->set(p * h + i, num::mul32(num::sub32(f, S1), term1));
    }
  }
  if (!in.grad) return;
  // 9.4, 9.6: d_weight and d_bias over chunks of the flattened positions.
  for (int64_t i = 0; i < h && (o.d_weight || o.d_bias); ++i) {
    float fw = 0.0f, fb = 0.0f;
    for (int64_t begin = 0; begin < positions; begin += kReductionChunk) {
      float aw = 0.0f, ab = 0.0f;
      for (int64_t p = begin; p < std::min(begin + kReductionChunk, positions); ++p) {
        aw = num::fma32(d_n[p * h + i], xhat[p * h + i], aw);
        ab = num::add32(ab, d_n[p * h + i]);
      }
      fw = num::add32(fw, aw);
      fb = num::add32(fb, ab);
    }
    if (o.d_weight) o.d_weight->set(i, fw);
    if (o.d_bias) o.d_bias->set(i, fb);
  }
  if (!on) return;
  // d_shift, d_scale: per group, chunks counted from the group's first
  // position (6.11); indexed, the canonical reduction over the rows (6.5).
  const int64_t len = in.group_len;
  auto reduce = [&](int64_t r, int64_t i, bool scale) {
    auto step = [&](float acc, int64_t p) {
      return scale ? num::fma32(g(p, i), n[p * h + i], acc) : num::add32(acc, g(p, i));
    };
    float fold = 0.0f;
    if (len > 0) {
      for (int64_t begin = r * len; begin < (r + 1) * len; begin += kReductionChunk) {
        float acc = 0.0f;
        for (int64_t p = begin; p < std::min(begin + kReductionChunk, (r + 1) * len); ++p) acc = step(acc, p);
        fold = num::add32(fold, acc);
      }
      return fold;
    }
    for (int64_t begin = 0; begin < positions; begin += kReductionChunk) {
      float acc = 0.0f;
      bool any = false;
      for (int64_t p = begin; p < std::min(begin + kReductionChunk, positions); ++p)
        if (in.group_of[p] == r) {
          acc = step(acc, p);
          any = true;
        }
      if (any) fold = num::add32(fold, acc);
    }
    return fold;
  };
  for (int64_t r = 0; r < in.num_rows; ++r)
    for (int64_t i = 0; i < h; ++i) {
      if (o.d_shift) o.d_shift->set(r * h + i, reduce(r, i, false));
      if (o.d_scale) o.d_scale->set(r * h + i, reduce(r, i, true));
    }
}

}  // namespace cases
}  // namespace detdit
