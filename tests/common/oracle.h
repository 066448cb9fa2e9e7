// FP64 oracles of the timestep path (linear, SiLU, timestep_sinusoid, the
// timestep MLP, the AdaLN projection), written as straightforward double
// loops from the math, independently of docs/numerics.md's FP32 orders.
// Header-only (inline) so every test suite can use it without a build change.
// Rounding of an exact result to a storage dtype: correctly_rounded_bits in
// tests/common/cases.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/scalar_math.h"
#include "common/test_util.h"
#include "cpu/parallel.h"

namespace detdit {
namespace testing {

// A tensor's elements as doubles (exact for every float dtype).
inline std::vector<double> to_doubles(const HostTensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = t.get(i);
  return out;
}

inline double silu64(double z) { return z / (1.0 + std::exp(-z)); }
// d silu / dz = s (1 + z (1 - s)), s = sigmoid(z)
inline double silu_derivative64(double z) {
  const double s = 1.0 / (1.0 + std::exp(-z));
  return s * (1.0 + z * (1.0 - s));
}

// y[t, n] = sum_k x[t, k] w[n, k] (+ b[n]); x (T, K), w (N, K), b (N,) or
// empty. `weight_row(n, row)` writes row n of w as doubles into row.
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
inline std::vector<double> linear64(const std::vector<double>& x, const std::vector<double>& w,
                                    const std::vector<double>& b, int64_t rows, int64_t in_features,
                                    int64_t out_features) {
  return linear64_rows(
      x, [&](int64_t n, double* row) { std::copy_n(w.data() + n * in_features, in_features, row); }, b, rows,
      in_features, out_features);
}
// The same with w read straight from an fp32 or bf16 tensor (no FP64 copy of
// an H3-sized weight).
inline std::vector<double> linear64(const std::vector<double>& x, const HostTensor& w, const std::vector<double>& b,
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

// d_x[t, k] = sum_n g[t, n] w[n, k]
inline std::vector<double> linear_d_x64(const std::vector<double>& g, const std::vector<double>& w, int64_t rows,
                                        int64_t in_features, int64_t out_features) {
  std::vector<double> d_x(static_cast<std::size_t>(rows * in_features), 0.0);
  cpu::parallel_for(0, rows, [&](int64_t t) {
    for (int64_t n = 0; n < out_features; ++n)
      for (int64_t k = 0; k < in_features; ++k) d_x[t * in_features + k] += g[t * out_features + n] * w[n * in_features + k];
  });
  return d_x;
}

// d_w[n, k] = sum_t g[t, n] x[t, k]
inline std::vector<double> linear_d_w64(const std::vector<double>& g, const std::vector<double>& x, int64_t rows,
                                        int64_t in_features, int64_t out_features) {
  std::vector<double> d_w(static_cast<std::size_t>(out_features * in_features), 0.0);
  cpu::parallel_for(0, out_features, [&](int64_t n) {
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t k = 0; k < in_features; ++k) d_w[n * in_features + k] += g[t * out_features + n] * x[t * in_features + k];
  });
  return d_w;
}

// d_b[n] = sum_t g[t, n]
inline std::vector<double> linear_d_b64(const std::vector<double>& g, int64_t rows, int64_t out_features) {
  std::vector<double> d_b(static_cast<std::size_t>(out_features), 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t n = 0; n < out_features; ++n) d_b[n] += g[t * out_features + n];
  return d_b;
}

// diffusers' Timesteps(C, flip_sin_to_cos=True, shift=0) in FP64:
// freq[k] = exp(-ln(max_period) k / half); features[t] = [cos(t freq) | sin(t freq)].
inline std::vector<double> sinusoid_frequencies64(int64_t half, double max_period) {
  std::vector<double> freq(static_cast<std::size_t>(half));
  for (int64_t k = 0; k < half; ++k)
    freq[k] = std::exp(-std::log(max_period) * static_cast<double>(k) / static_cast<double>(half));
  return freq;
}
inline std::vector<double> sinusoid64(const std::vector<double>& timesteps, int64_t channels, double max_period) {
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
// d_t[t] = sum_k freq[k] (-g[t, k] sin(t freq[k]) + g[t, half + k] cos(t freq[k]))
inline std::vector<double> sinusoid_d_t64(const std::vector<double>& timesteps, const std::vector<double>& grad,
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

// max |got - ref| / max |ref| (the MLP's relative error measure).
inline double relative_max_error(const HostTensor& got, const std::vector<double>& ref) {
  double err = 0.0, scale = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    err = std::max(err, std::fabs(got.get(i) - ref[i]));
    scale = std::max(scale, std::fabs(ref[i]));
  }
  return scale > 0.0 ? err / scale : err;
}
inline double max_abs_error(const HostTensor& got, const std::vector<double>& ref) {
  double err = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) err = std::max(err, std::fabs(got.get(i) - ref[i]));
  return err;
}

// Fast synthetic values for H3-sized weights (fill_normal is too slow for
// 2.6e8 elements): mean + std * (sum of 4 uniforms on [0, 1) - 2) * sqrt(3),
// an approximately normal (Irwin-Hall) variate with the requested mean and
// standard deviation, from a splitmix64 stream per block of 65536 elements
// (deterministic for any thread count). fp32/bf16 tensors.
inline void fill_approx_normal(HostTensor* t, uint64_t seed, double mean, double std) {
  constexpr int64_t kBlock = 65536;
  const int64_t count = t->numel();
  const bool bf16 = t->dtype() == DType::kBF16;
  cpu::parallel_for(0, (count + kBlock - 1) / kBlock, [&](int64_t block) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(block) * 0xD1B54A32D192ED03ull;
    const int64_t end = std::min(count, (block + 1) * kBlock);
    for (int64_t i = block * kBlock; i < end; ++i) {
      state += 0x9E3779B97F4A7C15ull;
      uint64_t z = state;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      double sum = 0.0;
      for (int part = 0; part < 4; ++part) sum += static_cast<double>((z >> (16 * part)) & 0xFFFFu) / 65536.0;
      const float v = static_cast<float>(mean + std * (sum - 2.0) * std::sqrt(3.0));
      if (bf16)
        t->ptr<uint16_t>()[i] = num::float_to_bf16(v);
      else
        t->ptr<float>()[i] = v;
    }
  });
}

}  // namespace testing
}  // namespace detdit
