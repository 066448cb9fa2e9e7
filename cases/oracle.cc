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

std::vector<double> sinusoid_frequencies64(int64_t half, double max_period) {
  std::vector<double> freq(static_cast<std::size_t>(half));
  for (int64_t k = 0; k < half; ++k)
    freq[k] = std::exp(-std::log(max_period) * static_cast<double>(k) / static_cast<double>(half));
  return freq;
}

std::vector<double> sinusoid64(const std::vector<double>& timesteps, int64_t channels, double max_period) {
  const int64_t half = channels / 2, rows = static_cast<int64_t>(timesteps.size());
  const std::vector<double> freq = sinusoid_frequencies64(half, max_period);
  std::vector<double> out(static_cast<std::size_t>(rows * channels));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t k = 0; k < half; ++k) {
      out[t * channels + k] = std::cos(timesteps[t] * freq[k]);
      out[t * channels + half + k] = std::sin(timesteps[t] * freq[k]);
    }
  return out;
}

std::vector<double> sinusoid_d_t64(const std::vector<double>& timesteps, const std::vector<double>& grad,
                                          int64_t channels, double max_period) {
  const int64_t half = channels / 2, rows = static_cast<int64_t>(timesteps.size());
  const std::vector<double> freq = sinusoid_frequencies64(half, max_period);
  std::vector<double> d_t(static_cast<std::size_t>(rows), 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t k = 0; k < half; ++k)
      d_t[t] += freq[k] * (-grad[t * channels + k] * std::sin(timesteps[t] * freq[k]) +
                           grad[t * channels + half + k] * std::cos(timesteps[t] * freq[k]));
  return d_t;
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

}  // namespace cases
}  // namespace detdit
