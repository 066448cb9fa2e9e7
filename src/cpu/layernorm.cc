// LayerNorm, CPU reference: the executable form of docs/numerics.md 9
// (forward 9.2, dx 9.3, d_weight / d_bias 9.4 over the canonical reduction's
// chunks, 6.5), for the portable profile (the torch profile is CUDA only:
// its rsqrt is the GPU's; every other operation is this file's).
//
// x, grad, out, dx are contiguous (M, H) rows. x, weight, bias and out are
// aligned to their 4-element vectors (validation); grad and dx may sit at any
// byte address and are read and written through cpu::load / cpu::store
// (src/cpu/unaligned.h). Rows and chunks are independent, so parallel_for's
// split never decides a bit.
#include <algorithm>
#include <cstdint>

#include "common/backends.h"
#include "common/layernorm_math.h"
#include "common/row_tree.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/reduction.h"
#include "cpu/unaligned.h"

namespace detdit {
namespace cpu {
namespace {

int64_t hidden_of(const TensorView& x) { return x.shape[x.rank - 1]; }

// weight / bias element i, or 1 / 0 when absent (the values PyTorch's kernels use).
template <typename T>
float weight_at(const TensorView& w, int64_t i) {
  return w.present() ? to_float(static_cast<const T*>(w.data)[i]) : 1.0f;
}

template <typename T>
void forward(const LayernormParams& p) {
  const int64_t hidden = hidden_of(p.in.x);
  const int64_t rows = p.in.x.numel() / hidden;
  const T* x = static_cast<const T*>(p.in.x.data);
  T* out = static_cast<T*>(p.out.data);
  const bool has_weight = p.in.weight.present(), has_bias = p.in.bias.present();
  parallel_for(0, rows, [&](int64_t m) {
    const int64_t h = hidden;  // bounds and bases in locals (unaligned.h)
    const T* xr = x + m * h;   // (H,) row m
    T* outr = out + m * h;
    const layernorm::RowMoments moments =
        layernorm::moments_of(layernorm::layernorm_row_stats(h, [&](int64_t i) { return to_float(xr[i]); }), h);
    const float rstd = num::portable_rsqrt(num::add32(moments.var, p.in.eps));
    if (p.mean.present()) store(p.mean.data, m, moments.mean);
    if (p.rstd.present()) store(p.rstd.data, m, rstd);
    for (int64_t i = 0; i < h; ++i) {
      const float b = has_bias ? to_float(static_cast<const T*>(p.in.bias.data)[i]) : 0.0f;
      outr[i] = from_float<T>(layernorm::normalised(to_float(xr[i]), moments.mean, rstd, has_weight,
                                                    weight_at<T>(p.in.weight, i), has_bias, b));
    }
  });
}

template <typename T>
void backward_rows(const LayernormBackwardParams& p) {
  const int64_t hidden = hidden_of(p.in.x);
  const int64_t rows = p.in.x.numel() / hidden;
  const T* x = static_cast<const T*>(p.in.x.data);
  parallel_for(0, rows, [&](int64_t m) {
    const int64_t h = hidden;  // bounds and bases in locals (unaligned.h)
    const T* xr = x + m * h;   // (H,) row m; grad and dx row m start at element m * h
    const void* grad = static_cast<const char*>(p.grad.data) + m * h * static_cast<int64_t>(sizeof(T));
    void* dx = static_cast<char*>(p.dx.data) + m * h * static_cast<int64_t>(sizeof(T));
    const float mean = load<float>(p.mean.data, m), rstd = load<float>(p.rstd.data, m);
    // Each of the 128 threads' (s1, s2) over its vectors t, t+128, ... in element order.
    float s1[kRowTreeThreads], s2[kRowTreeThreads];
    const int64_t vectors = h / kRowTreeVector;
    for (int t = 0; t < kRowTreeThreads; ++t) {
      layernorm::DxSums s{0.0f, 0.0f};
      for (int64_t j = t; j < vectors; j += kRowTreeThreads)
        for (int e = 0; e < kRowTreeVector; ++e) {
          const int64_t i = j * kRowTreeVector + e;
          s = layernorm::dx_sums_step(s, to_float(load<T>(grad, i)), weight_at<T>(p.in.weight, i), to_float(xr[i]),
                                      mean, rstd);
        }
      s1[t] = s.s1;
      s2[t] = s.s2;
    }
    const float sum1 = layernorm::layernorm_block_sum(s1), sum2 = layernorm::layernorm_block_sum(s2);
    const float term1 = layernorm::dx_term1(rstd, h);
    for (int64_t i = 0; i < h; ++i)
      store(dx, i,
            from_float<T>(layernorm::dx_value(to_float(load<T>(grad, i)), weight_at<T>(p.in.weight, i),
                                              to_float(xr[i]), mean, rstd, sum1, sum2, term1, h)));
  });
}

// One partial per chunk of 256 positions (rows), each an ascending chain from
// +0.0 over the chunk's positions.
template <typename T>
void backward_partials(const LayernormBackwardParams& p, const TensorView& weight_partials,
                       const TensorView& bias_partials) {
  const int64_t hidden = hidden_of(p.in.x);
  const int64_t positions = p.in.x.numel() / hidden;
  const int64_t chunks = (positions + kReductionChunk - 1) / kReductionChunk;
  const T* x = static_cast<const T*>(p.in.x.data);
  parallel_for(0, chunks, [&](int64_t c) {
    const int64_t h = hidden;
    const int64_t begin = c * kReductionChunk, end = std::min(positions, begin + kReductionChunk);
    float* wacc = weight_partials.present() ? row_ptr<float>(weight_partials, c) : nullptr;  // (H,)
    float* bacc = bias_partials.present() ? row_ptr<float>(bias_partials, c) : nullptr;
    for (int64_t i = 0; i < h; ++i) {
      if (wacc) wacc[i] = 0.0f;
      if (bacc) bacc[i] = 0.0f;
    }
    for (int64_t pos = begin; pos < end; ++pos) {
      const T* xr = x + pos * h;
      const void* grad = static_cast<const char*>(p.grad.data) + pos * h * static_cast<int64_t>(sizeof(T));
      const float mean = load<float>(p.mean.data, pos), rstd = load<float>(p.rstd.data, pos);
      for (int64_t i = 0; i < h; ++i) {
        const float g = to_float(load<T>(grad, i));
        if (wacc) wacc[i] = layernorm::weight_grad_step(g, to_float(xr[i]), mean, rstd, wacc[i]);
        if (bacc) bacc[i] = num::add32(bacc[i], g);
      }
    }
  });
}

}  // namespace

Status layernorm_forward(const LayernormParams& p, Stream) {
  dispatch_float_dtype(p.in.x.dtype, [&](auto tag) { forward<decltype(tag)>(p); });
  return Status();
}

Status layernorm_backward_rows(const LayernormBackwardParams& p, Stream) {
  if (!p.dx.present()) return Status();
  dispatch_float_dtype(p.in.x.dtype, [&](auto tag) { backward_rows<decltype(tag)>(p); });
  return Status();
}

Status layernorm_backward_partials(const LayernormBackwardParams& p, const TensorView& weight_partials,
                                   const TensorView& bias_partials, Stream) {
  if (!weight_partials.present() && !bias_partials.present()) return Status();
  dispatch_float_dtype(p.in.x.dtype,
                       [&](auto tag) { backward_partials<decltype(tag)>(p, weight_partials, bias_partials); });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
