// CPU reference of linear (docs/numerics.md 5.2 and 6.2), portable profile.
//
// Forward, per output (t, n): 32 lanes; lane l owns the 16-byte vectors
// j = l, l+32, ... of the K axis (V elements each: 4 fp32 or 8 bf16) and runs
// an ascending fma chain from +0.0 over them; the lanes are combined by the
// XOR butterfly (offsets 16, 8, 4, 2, 1); then bias, the optional FP32
// pre-activation save, the optional SiLU, one rounding to out's dtype.
// Backward: d_x chunk partials (64 rows of N per chunk, ascending-n fma
// chains; src/linear.cc folds them with fold_chunk_partials), d_W
// (ascending-t fma chain) and d_b (ascending-t add chain), each rounded once.
// Threads split outputs (columns n, chunks c, elements) and never an
// accumulation, so the thread count never changes a bit.
// Validation requires 16-byte alignment of x and weight only (linear.h says
// bias too, src/linear.cc does not check it), so every other tensor is read
// and written with cpu/unaligned.h, and the chains accumulate in local
// buffers.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/backends.h"
#include "common/pointwise_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/unaligned.h"

namespace detdit {
namespace cpu {
namespace {

constexpr int kLanes = 32;

// The 32-lane dot product of numerics 5.2 over K = in_features elements of
// two FP32 rows (operands already upcast exactly); `vector_width` is V.
inline __attribute__((always_inline)) float lane_butterfly_dot_body(const float* x, const float* w,
                                                                    int64_t in_features, int64_t vector_width) {
  const int64_t vectors = in_features / vector_width;
  float lanes[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) {
    float acc = 0.0f;
    for (int64_t j = lane; j < vectors; j += kLanes) {
      const int64_t base = j * vector_width;
      for (int64_t e = 0; e < vector_width; ++e) acc = num::fma32(x[base + e], w[base + e], acc);
    }
    lanes[lane] = acc;
  }
  // XOR butterfly: every lane adds its partner's value; lane 0's result is the
  // value every lane ends with.
  for (int offset = kLanes / 2; offset >= 1; offset /= 2) {
    float next[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) next[lane] = num::add32(lanes[lane], lanes[lane ^ offset]);
    for (int lane = 0; lane < kLanes; ++lane) lanes[lane] = next[lane];
  }
  return lanes[0];
}

// acc[k] = fma(scale, row[k], acc[k]) for k < count: one step of the
// ascending chains of d_x partials (over n) and d_W (over t).
inline __attribute__((always_inline)) void fma_axpy_body(float scale, const float* row, float* acc, int64_t count) {
  for (int64_t k = 0; k < count; ++k) acc[k] = num::fma32(scale, row[k], acc[k]);
}

// The two hot loops are compiled twice: for the baseline ISA, where fma32 is
// a libm call, and with the FMA instruction set, picked at run time when the
// CPU has it. Both are the same correctly rounded fused multiply-add, so the
// choice changes no bit; it removes a function call per element.
float lane_butterfly_dot_baseline(const float* x, const float* w, int64_t in_features, int64_t vector_width) {
  return lane_butterfly_dot_body(x, w, in_features, vector_width);
}
void fma_axpy_baseline(float scale, const float* row, float* acc, int64_t count) {
  fma_axpy_body(scale, row, acc, count);
}
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("fma"))) float lane_butterfly_dot_fma(const float* x, const float* w, int64_t in_features,
                                                             int64_t vector_width) {
  return lane_butterfly_dot_body(x, w, in_features, vector_width);
}
__attribute__((target("fma"))) void fma_axpy_fma(float scale, const float* row, float* acc, int64_t count) {
  fma_axpy_body(scale, row, acc, count);
}
bool cpu_has_fma() {
  static const bool has_fma = (__builtin_cpu_init(), __builtin_cpu_supports("fma"));
  return has_fma;
}
#endif

float lane_butterfly_dot(const float* x, const float* w, int64_t in_features, int64_t vector_width) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_fma()) return lane_butterfly_dot_fma(x, w, in_features, vector_width);
#endif
  return lane_butterfly_dot_baseline(x, w, in_features, vector_width);
}

void fma_axpy(float scale, const float* row, float* acc, int64_t count) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_fma()) return fma_axpy_fma(scale, row, acc, count);
#endif
  fma_axpy_baseline(scale, row, acc, count);
}

// count elements of T from element `first` of `data`, upcast to FP32.
template <typename T>
std::vector<float> upcast_rows(const void* data, int64_t first, int64_t count) {
  std::vector<float> out(static_cast<std::size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[i] = to_float(load<T>(data, first + i));
  return out;
}

template <typename In, typename Out>
void linear_forward_typed(const LinearParams& p) {
  const int64_t rows = p.x.shape[0], in_features = p.x.shape[1], out_features = p.weight.shape[0];
  const int64_t vector_width = 16 / static_cast<int64_t>(sizeof(In));
  const std::vector<float> x = upcast_rows<In>(p.x.data, 0, rows * in_features);  // (T, K)
  // weight (N, K), bias (N,) or absent, pre_activation (T, N) fp32 or absent, out (T, N)
  parallel_for(0, out_features, [&](int64_t n) {
    const std::vector<float> w = upcast_rows<In>(p.weight.data, n * in_features, in_features);
    for (int64_t t = 0; t < rows; ++t) {
      float v = lane_butterfly_dot(x.data() + t * in_features, w.data(), in_features, vector_width);
      if (p.bias.present()) v = num::add32(v, to_float(load<In>(p.bias.data, n)));
      if (p.pre_activation.present()) store(p.pre_activation.data, t * out_features + n, v);
      if (p.activation == Activation::kSilu) v = silu_value(v, PortableExp{});
      store(p.out.data, t * out_features + n, from_float<Out>(v));
    }
  });
}

template <typename W>
void backward_input_partials_typed(const LinearBackwardInputParams& p) {
  const int64_t rows = p.grad.shape[0], out_features = p.grad.shape[1], in_features = p.weight.shape[1];
  const int64_t chunks = p.partials.shape[0];
  // grad (T, N) fp32, weight (N, K), partials (C, T, K) fp32
  parallel_for(0, chunks, [&](int64_t c) {
    const int64_t n_begin = c * kLinearChunkRows;
    const int64_t n_end = std::min(n_begin + kLinearChunkRows, out_features);
    std::vector<float> chunk(static_cast<std::size_t>(rows * in_features), 0.0f);  // partial[c, :, :]
    // Ascending n within the chunk; for each n every (t, k) chain takes one step.
    for (int64_t n = n_begin; n < n_end; ++n) {
      const std::vector<float> w = upcast_rows<W>(p.weight.data, n * in_features, in_features);
      for (int64_t t = 0; t < rows; ++t)
        fma_axpy(load<float>(p.grad.data, t * out_features + n), w.data(), chunk.data() + t * in_features,
                 in_features);
    }
    if (!chunk.empty()) {
      std::memcpy(static_cast<char*>(p.partials.data) + c * rows * in_features * static_cast<int64_t>(sizeof(float)),
                  chunk.data(), chunk.size() * sizeof(float));
    }
  });
}

template <typename In>
void backward_weight_typed(const LinearBackwardWeightParams& p) {
  const int64_t rows = p.grad.shape[0], out_features = p.grad.shape[1], in_features = p.x.shape[1];
  const std::vector<float> grad = upcast_rows<float>(p.grad.data, 0, rows * out_features);  // (T, N)
  const std::vector<float> x = upcast_rows<In>(p.x.data, 0, rows * in_features);           // (T, K)
  if (p.d_weight.present()) {
    dispatch_float_dtype(p.d_weight.dtype, [&](auto tag) {
      using Out = decltype(tag);
      parallel_for(0, out_features, [&](int64_t n) {
        // Ascending t; for each t every k's chain takes one step.
        std::vector<float> acc(static_cast<std::size_t>(in_features), 0.0f);
        for (int64_t t = 0; t < rows; ++t)
          fma_axpy(grad[t * out_features + n], x.data() + t * in_features, acc.data(), in_features);
        for (int64_t k = 0; k < in_features; ++k) store(p.d_weight.data, n * in_features + k, from_float<Out>(acc[k]));
      });
    });
  }
  if (p.d_bias.present()) {
    dispatch_float_dtype(p.d_bias.dtype, [&](auto tag) {
      using Out = decltype(tag);
      for (int64_t n = 0; n < out_features; ++n) {
        float acc = 0.0f;
        for (int64_t t = 0; t < rows; ++t) acc = num::add32(acc, grad[t * out_features + n]);
        store(p.d_bias.data, n, from_float<Out>(acc));  // (N,)
      }
    });
  }
}

}  // namespace

Status linear_forward(const LinearParams& p, Stream) {
  dispatch_float_dtype(p.x.dtype, [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_float_dtype(p.out.dtype, [&](auto out_tag) { linear_forward_typed<In, decltype(out_tag)>(p); });
  });
  return Status();
}

Status linear_backward_input_partials(const LinearBackwardInputParams& p, Stream) {
  dispatch_float_dtype(p.weight.dtype, [&](auto tag) { backward_input_partials_typed<decltype(tag)>(p); });
  return Status();
}

Status linear_backward_weight(const LinearBackwardWeightParams& p, Stream) {
  dispatch_float_dtype(p.x.dtype, [&](auto tag) { backward_weight_typed<decltype(tag)>(p); });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
