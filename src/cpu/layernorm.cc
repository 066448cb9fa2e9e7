// LayerNorm, plain and AdaLN-modulated, CPU reference: the executable form of
// docs/numerics.md 9 (forward 9.2, dx 9.3, d_weight / d_bias 9.4 over the
// canonical reduction's chunks, 6.5; the modulation forms and recipes 9.5,
// 9.6 with 5.12 and 6.11), for the portable profile (the torch profile is
// CUDA only: its rsqrt is the GPU's; every other operation is this file's).
//
// x, grad, out, dx are contiguous (M, H) rows, M = B*S; position p = row p
// reads its shift and scale row at modulation_offset (common/modulation_math.h:
// the indexed table row plan.row_of_seq[p % S], or its sample, frame or token
// row). Each kernel is a template over the recipe <T, M, upcast>
// (modulation_math.h Recipe): T = x's type, M = the modulation's (T for the
// plain norm, whose bytes are the same in both recipes: Out = T and the one
// rounding is R_T). x, weight, bias and out are aligned to their 4-element
// vectors (validation); every other tensor may sit at any byte address and is
// read and written through cpu::load / cpu::store (src/cpu/unaligned.h).
// Rows, chunks, segments and groups are independent, so parallel_for's split
// never decides a bit.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/backends.h"
#include "common/layernorm_math.h"
#include "common/modulation_math.h"
#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/reduction.h"
#include "cpu/shift_scale.h"
#include "cpu/unaligned.h"
#include "rowwise/checks.h"

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
float bias_at(const TensorView& b, int64_t i) {
  return b.present() ? to_float(static_cast<const T*>(b.data)[i]) : 0.0f;
}

// The unrounded normalised value of element i (9.2: p_i, rn(w_i * p_i) or fma(w_i, p_i, b_i)).
template <typename T>
float normalised_at(const LayernormInputs& in, float x, float mean, float rstd, int64_t i) {
  return layernorm::normalised(x, mean, rstd, in.weight.present(), weight_at<T>(in.weight, i), in.bias.present(),
                               bias_at<T>(in.bias, i));
}

// The shift and scale of a call as the kernels address them.
ShiftScale modulation_of(const LayernormInputs& in) {
  return ShiftScale(rowwise::layernorm_modulation(in), in.shift, in.scale, in.plan);
}

template <typename T, typename M, bool kUpcast>
void forward(const LayernormParams& p) {
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  const int64_t hidden = hidden_of(p.in.x);
  const int64_t rows = p.in.x.numel() / hidden;
  const T* x = static_cast<const T*>(p.in.x.data);
  Out* out = static_cast<Out*>(p.out.data);
  const ShiftScale m = modulation_of(p.in);
  parallel_for(0, rows, [&](int64_t pos) {
    const int64_t h = hidden;  // bounds and bases in locals (unaligned.h)
    const T* xr = x + pos * h;   // (H,) row pos
    Out* outr = out + pos * h;
    const layernorm::RowMoments moments =
        layernorm::moments_of(layernorm::layernorm_row_stats(h, [&](int64_t i) { return to_float(xr[i]); }), h);
    const float rstd = num::portable_rsqrt(num::add32(moments.var, p.in.eps));
    if (p.mean.present()) store(p.mean.data, pos, moments.mean);
    if (p.rstd.present()) store(p.rstd.data, pos, rstd);
    const bool on = m.on();
    const int64_t shift = on ? m.shift_at(pos) : 0, scale = on ? m.scale_at(pos) : 0;
    const void *shift_data = m.shift.data, *scale_data = m.scale.data;
    for (int64_t i = 0; i < h; ++i) {
      const float v = normalised_at<T>(p.in, to_float(xr[i]), moments.mean, rstd, i);
      outr[i] = from_float<Out>(on ? layernorm::modulated<typename R::Norm, typename R::Mid, typename R::Factor>(
                                         v, to_float(load<M>(scale_data, scale + i)),
                                         to_float(load<M>(shift_data, shift + i)))
                                   : v);
    }
  });
}

template <typename T, typename M, bool kUpcast>
void backward_rows(const LayernormBackwardParams& p) {
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  const int64_t hidden = hidden_of(p.in.x);
  const int64_t rows = p.in.x.numel() / hidden;
  const T* x = static_cast<const T*>(p.in.x.data);
  const ShiftScale m = modulation_of(p.in);
  parallel_for(0, rows, [&](int64_t pos) {
    const int64_t h = hidden;  // bounds and bases in locals (unaligned.h)
    const T* xr = x + pos * h;   // (H,) row pos; grad and dx row pos start at element pos * h
    const void* grad = static_cast<const char*>(p.grad.data) + pos * h * static_cast<int64_t>(sizeof(Out));
    void* dx = static_cast<char*>(p.dx.data) + pos * h * static_cast<int64_t>(sizeof(T));
    const float mean = load<float>(p.mean.data, pos), rstd = load<float>(p.rstd.data, pos);
    const int64_t scale = m.on() ? m.scale_at(pos) : 0;
    std::vector<float> d_n_row(static_cast<std::size_t>(h));
    float* d_n = d_n_row.data();
    for (int64_t i = 0; i < h; ++i)
      d_n[i] = m.grad_normalised<typename R::Factor, M>(scale, i, to_float(load<Out>(grad, i)));
    // Each of the 128 threads' (s1, s2) over its vectors t, t+128, ... in element order.
    float s1[kRowTreeThreads], s2[kRowTreeThreads];
    const int64_t vectors = h / kRowTreeVector;
    for (int t = 0; t < kRowTreeThreads; ++t) {
      layernorm::DxSums s{0.0f, 0.0f};
      for (int64_t j = t; j < vectors; j += kRowTreeThreads)
        for (int e = 0; e < kRowTreeVector; ++e) {
          const int64_t i = j * kRowTreeVector + e;
          s = layernorm::dx_sums_step(s, d_n[i], weight_at<T>(p.in.weight, i), to_float(xr[i]), mean, rstd);
        }
      s1[t] = s.s1;
      s2[t] = s.s2;
    }
    const float sum1 = layernorm::layernorm_block_sum(s1), sum2 = layernorm::layernorm_block_sum(s2);
    const float term1 = layernorm::dx_term1(rstd, h);
    for (int64_t i = 0; i < h; ++i)
      store(dx, i,
            from_float<T>(layernorm::dx_value(d_n[i], weight_at<T>(p.in.weight, i), to_float(xr[i]), mean, rstd,
                                              sum1, sum2, term1, h)));
  });
}

// One position's steps of the [d_shift | d_scale] partial acc (2H,):
// rn(acc + g_i) and fma(g_i, n_i, acc), n_i = R_Norm of the normalised value
// (recomputed from x and the saved mean and rstd: the forward's n_i).
template <typename T, typename M, bool kUpcast>
void table_steps(const LayernormBackwardParams& p, int64_t pos, int64_t hidden, float* acc) {
  using R = Recipe<T, M, kUpcast>;
  const T* xr = static_cast<const T*>(p.in.x.data) + pos * hidden;
  const int64_t grad_bytes = pos * hidden * static_cast<int64_t>(sizeof(typename R::Out));
  const void* grad = static_cast<const char*>(p.grad.data) + grad_bytes;
  const float mean = load<float>(p.mean.data, pos), rstd = load<float>(p.rstd.data, pos);
  for (int64_t i = 0; i < hidden; ++i) {
    const float g = to_float(load<typename R::Out>(grad, i));
    acc[i] = num::add32(acc[i], g);
    const float n =
        layernorm::modulation_input<typename R::Norm>(normalised_at<T>(p.in, to_float(xr[i]), mean, rstd, i));
    acc[hidden + i] = rowwise::scale_grad_step(g, n, acc[hidden + i]);
  }
}

template <typename T, typename M, bool kUpcast>
void backward_partials(const LayernormBackwardParams& p, const LayernormPartials& partials) {
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  const int64_t hidden = hidden_of(p.in.x);
  const int64_t positions = p.in.x.numel() / hidden;
  const int64_t chunks = (positions + kReductionChunk - 1) / kReductionChunk;
  const T* x = static_cast<const T*>(p.in.x.data);
  const ShiftScale m = modulation_of(p.in);
  if (partials.weight.present() || partials.bias.present()) {
    // d_weight / d_bias: one partial per chunk of 256 positions, an ascending
    // chain from +0.0 over the chunk's positions of d_n.
    parallel_for(0, chunks, [&](int64_t c) {
      const int64_t h = hidden;
      const int64_t begin = c * kReductionChunk, end = std::min(positions, begin + kReductionChunk);
      float* wacc = partials.weight.present() ? row_ptr<float>(partials.weight, c) : nullptr;  // (H,)
      float* bacc = partials.bias.present() ? row_ptr<float>(partials.bias, c) : nullptr;
      for (int64_t i = 0; i < h; ++i) {
        if (wacc) wacc[i] = 0.0f;
        if (bacc) bacc[i] = 0.0f;
      }
      for (int64_t pos = begin; pos < end; ++pos) {
        const T* xr = x + pos * h;
        const void* grad = static_cast<const char*>(p.grad.data) + pos * h * static_cast<int64_t>(sizeof(Out));
        const float mean = load<float>(p.mean.data, pos), rstd = load<float>(p.rstd.data, pos);
        const int64_t scale = m.on() ? m.scale_at(pos) : 0;
        for (int64_t i = 0; i < h; ++i) {
          const float d_n = m.grad_normalised<typename R::Factor, M>(scale, i, to_float(load<Out>(grad, i)));
          if (wacc) wacc[i] = layernorm::weight_grad_step(d_n, to_float(xr[i]), mean, rstd, wacc[i]);
          if (bacc) bacc[i] = num::add32(bacc[i], d_n);
        }
      }
    });
  }
  if (!m.on() || !partials.table.present()) return;
  if (m.mod.grouped()) {
    // [d_shift | d_scale] of a grouped form: chunk c of group g is positions
    // [g*L + 256c, min(g*L + 256(c + 1), (g + 1)*L)), partial row g*Cg + c.
    const int64_t len = m.mod.frame_len;
    const int64_t per_group = (len + kReductionChunk - 1) / kReductionChunk;
    parallel_for(0, m.mod.groups() * per_group, [&](int64_t row) {
      const int64_t g = row / per_group, c = row % per_group;
      float* acc = row_ptr<float>(partials.table, row);  // (2H,)
      for (int64_t j = 0; j < 2 * hidden; ++j) acc[j] = 0.0f;
      const int64_t begin = g * len + c * kReductionChunk;
      const int64_t end = std::min(begin + kReductionChunk, (g + 1) * len);
      for (int64_t pos = begin; pos < end; ++pos) table_steps<T, M, kUpcast>(p, pos, hidden, acc);
    });
    return;
  }
  // [d_shift | d_scale] indexed: one (2H,) partial per segment of the plan
  // (every chunk's segments, in plan order), its positions ascending.
  const PlanTables& tables = p.in.plan.host_tables();
  parallel_for(0, p.in.plan.num_segments(), [&](int64_t g) {
    float* acc = row_ptr<float>(partials.table, g);  // (2H,)
    for (int64_t j = 0; j < 2 * hidden; ++j) acc[j] = 0.0f;
    for (int32_t q = tables.segment_pos_begin[g]; q < tables.segment_pos_begin[g + 1]; ++q)
      table_steps<T, M, kUpcast>(p, tables.segment_positions[q], hidden, acc);
  });
}

}  // namespace

Status layernorm_forward(const LayernormParams& p, Stream) {
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    forward<decltype(t), decltype(m), decltype(up)::value>(p);
  });
  return Status();
}

Status layernorm_backward_rows(const LayernormBackwardParams& p, Stream) {
  if (!p.dx.present()) return Status();
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    backward_rows<decltype(t), decltype(m), decltype(up)::value>(p);
  });
  return Status();
}

Status layernorm_backward_partials(const LayernormBackwardParams& p, const LayernormPartials& partials, Stream) {
  if (!partials.weight.present() && !partials.bias.present() && !partials.table.present()) return Status();
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    backward_partials<decltype(t), decltype(m), decltype(up)::value>(p, partials);
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
