// RMSNorm (plain and AdaLN-modulated), CPU reference: the executable form of
// docs/numerics.md 5.6 (forward), 6.7 (backward), 7 (the row tree) and, for
// the modulation forms and recipes, 5.12 and 6.11.
//
// x, grad, out, dx are contiguous (M, H) rows, M = B*S; position p = row p
// reads its shift and scale row at modulation_offset (common/modulation_math.h:
// the indexed table row plan.row_of_seq[p % S], or its sample, frame or token
// row). Each kernel is a template over the recipe <T, M, upcast>
// (modulation_math.h Recipe): T = x's type, M = the modulation's. x, weight and out are aligned to
// their 4-element vectors (validation); every other tensor may sit at any
// byte address and is read and written through cpu::load / cpu::store
// (src/cpu/unaligned.h: the same moves, without a misaligned typed access).
// The backward is split into the row-local half (dx) and the partials half of
// the canonical reduction (d_weight chunk partials, [d_shift | d_scale]
// segment partials); the public rmsnorm_backward is literally rows +
// partials(every chunk) + folds (src/rowwise/backward.h), the same code the
// sequence-parallel region runs on a chunk subset.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/backends.h"
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

// rstd of one row: rsqrt_P(rn(rn(ss / H) + eps)), ss by the row tree of fma(x, x, s).
template <typename T>
float row_rstd(const T* x, int64_t hidden, float eps) {
  const float ss = row_tree_sum(hidden, [&](int64_t i, float* a, float* b) { *a = *b = to_float(x[i]); });
  const float ms = num::div32(ss, static_cast<float>(hidden));
  return num::portable_rsqrt(num::add32(ms, eps));
}

// The shift and scale of a call as the kernels address them.
ShiftScale modulation_of(const RmsnormInputs& in) {
  return ShiftScale(rowwise::rmsnorm_modulation(in), in.shift, in.scale, in.plan);
}

template <typename T, typename M, bool kUpcast>
void forward(const RmsnormParams& p) {
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  const int64_t rows = p.in.x.numel() / hidden;
  const T* x = static_cast<const T*>(p.in.x.data);
  const T* w = static_cast<const T*>(p.in.weight.data);
  Out* out = static_cast<Out*>(p.out.data);
  const ShiftScale m = modulation_of(p.in);
  parallel_for(0, rows, [&](int64_t pos) {
    const int64_t h = hidden;  // bounds and bases in locals (unaligned.h)
    const T* xr = x + pos * h;   // (H,) row pos
    Out* outr = out + pos * h;
    const float rstd = row_rstd(xr, h, p.in.eps);
    if (p.rstd.present()) store(p.rstd.data, pos, rstd);
    const bool on = m.on();
    const int64_t shift = on ? m.shift_at(pos) : 0, scale = on ? m.scale_at(pos) : 0;
    const void *shift_data = m.shift.data, *scale_data = m.scale.data;
    for (int64_t i = 0; i < h; ++i) {
      const float n = rowwise::normalised<typename R::Norm>(to_float(w[i]), rstd, to_float(xr[i]));
      outr[i] = from_float<Out>(on ? rowwise::modulated<typename R::Mid, typename R::Factor>(
                                         n, to_float(load<M>(scale_data, scale + i)),
                                         to_float(load<M>(shift_data, shift + i)))
                                   : n);
    }
  });
}

template <typename T, typename M, bool kUpcast>
void backward_rows(const RmsnormBackwardParams& p) {
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  const int64_t rows = p.in.x.numel() / hidden;
  const T* x = static_cast<const T*>(p.in.x.data);
  const T* w = static_cast<const T*>(p.in.weight.data);
  const ShiftScale m = modulation_of(p.in);
  parallel_for(0, rows, [&](int64_t pos) {
    const int64_t h = hidden;  // bounds and bases in locals (unaligned.h)
    const T* xr = x + pos * h;   // (H,) row pos; grad and dx row pos start at element pos * h
    const void* grad = static_cast<const char*>(p.grad.data) + pos * h * static_cast<int64_t>(sizeof(Out));
    void* dx = static_cast<char*>(p.dx.data) + pos * h * static_cast<int64_t>(sizeof(T));
    const int64_t scale = m.on() ? m.scale_at(pos) : 0;
    const float rstd = load<float>(p.rstd.data, pos);
    std::vector<float> d_n_row(static_cast<std::size_t>(h));
    float* d_n = d_n_row.data();
    for (int64_t i = 0; i < h; ++i)
      d_n[i] = m.grad_normalised<typename R::Factor, M>(scale, i, to_float(load<Out>(grad, i)));
    const float dot = row_tree_sum(h, [&](int64_t i, float* a, float* b) {
      *a = rowwise::dot_term(to_float(w[i]), d_n[i]);
      *b = to_float(xr[i]);
    });
    const float coef = rowwise::dx_coefficient(rstd, dot, h);
    for (int64_t i = 0; i < h; ++i)
      store(dx, i, from_float<T>(rowwise::dx_value(rstd, to_float(w[i]), d_n[i], to_float(xr[i]), coef)));
  });
}

// The operands of one position for the partials: its x and grad rows (the
// element index of the row's start in `x` / `grad`) and rstd, own or
// received (ExtraRows).
struct PositionRows {
  const void* x;
  const void* grad;
  int64_t first;
  float rstd;
};
PositionRows position_rows(const RmsnormBackwardParams& p, const ExtraRows& extra, const ChunkSelection& sel,
                           int64_t hidden, int64_t pos) {
  const DataRow d = data_row(sel, pos);
  const TensorView& x = d.extra ? extra.x : p.in.x;
  const TensorView& grad = d.extra ? extra.grad : p.grad;
  const TensorView& rstd = d.extra ? extra.rstd : p.rstd;
  return PositionRows{x.data, grad.data, d.row * hidden, load<float>(rstd.data, d.row)};
}

// One position's steps of the [d_shift | d_scale] partial acc (2H,):
// rn(acc + g_i) and fma(g_i, n_i, acc), n_i the forward's normalised value
// (R_Norm, recomputed from x, w and the saved rstd).
template <typename T, typename M, bool kUpcast>
void table_steps(const T* w, const PositionRows& in, int64_t hidden, float* acc) {
  using R = Recipe<T, M, kUpcast>;
  for (int64_t i = 0; i < hidden; ++i) {
    const float g_i = to_float(load<typename R::Out>(in.grad, in.first + i));
    acc[i] = num::add32(acc[i], g_i);
    const float n =
        rowwise::normalised<typename R::Norm>(to_float(w[i]), in.rstd, to_float(load<T>(in.x, in.first + i)));
    acc[hidden + i] = rowwise::scale_grad_step(g_i, n, acc[hidden + i]);
  }
}

template <typename T, typename M, bool kUpcast>
void backward_partials(const RmsnormBackwardParams& p, const ChunkSelection& sel, const ExtraRows& extra,
                       const TensorView& weight_partials, const TensorView& table_partials) {
  using R = Recipe<T, M, kUpcast>;
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  // positions: the plan's B*S; a norm without a plan reduces its own rows.
  const int64_t positions = p.in.plan.valid() ? p.in.plan.positions() : p.in.x.numel() / hidden;
  const int64_t num_chunks = (positions + kReductionChunk - 1) / kReductionChunk;
  const ShiftScale m = modulation_of(p.in);
  const SelectedChunks selected = select_chunks(p.in.plan, num_chunks, sel);
  const T* w = static_cast<const T*>(p.in.weight.data);
  if (weight_partials.present()) {
    parallel_for(0, static_cast<int64_t>(selected.chunk.size()), [&](int64_t k) {
      // d_weight: one segment per chunk, all its positions ascending.
      const int64_t c = selected.chunk[k];
      float* acc = row_ptr<float>(weight_partials, k);  // (H,)
      for (int64_t i = 0; i < hidden; ++i) acc[i] = 0.0f;
      const int64_t end = std::min(positions, (c + 1) * kReductionChunk);
      for (int64_t pos = c * kReductionChunk; pos < end; ++pos) {
        const PositionRows in = position_rows(p, extra, sel, hidden, pos);
        const int64_t scale = m.on() ? m.scale_at(pos) : 0;
        for (int64_t i = 0; i < hidden; ++i) {
          const float g = to_float(load<typename R::Out>(in.grad, in.first + i));
          const float d_n = m.grad_normalised<typename R::Factor, M>(scale, i, g);
          acc[i] = rowwise::weight_grad_step(d_n, to_float(load<T>(in.x, in.first + i)), in.rstd, acc[i]);
        }
      }
    });
  }
  if (!m.on() || !table_partials.present()) return;
  if (m.mod.grouped()) {
    // [d_shift | d_scale] of a grouped form: chunk c of group g is positions
    // [g*L + 256c, min(g*L + 256(c + 1), (g + 1)*L)), partial row g*Cg + c.
    const int64_t len = m.mod.frame_len;
    const int64_t per_group = (len + kReductionChunk - 1) / kReductionChunk;
    parallel_for(0, m.mod.groups() * per_group, [&](int64_t row) {
      const int64_t g = row / per_group, c = row % per_group;
      float* acc = row_ptr<float>(table_partials, row);  // (2H,)
      for (int64_t j = 0; j < 2 * hidden; ++j) acc[j] = 0.0f;
      const int64_t begin = g * len + c * kReductionChunk;
      const int64_t end = std::min(begin + kReductionChunk, (g + 1) * len);
      for (int64_t pos = begin; pos < end; ++pos)
        table_steps<T, M, kUpcast>(w, position_rows(p, extra, sel, hidden, pos), hidden, acc);
    });
    return;
  }
  // [d_shift | d_scale] indexed: one (2H,) partial per segment of the chunk.
  const PlanTables& tables = p.in.plan.host_tables();
  parallel_for(0, static_cast<int64_t>(selected.chunk.size()), [&](int64_t k) {
    const int64_t c = selected.chunk[k];
    int64_t out_row = selected.segment_offset[k];
    for (int32_t g = tables.chunk_segment_begin[c]; g < tables.chunk_segment_begin[c + 1]; ++g, ++out_row) {
      float* acc = row_ptr<float>(table_partials, out_row);  // (2H,)
      for (int64_t j = 0; j < 2 * hidden; ++j) acc[j] = 0.0f;
      for (int32_t q = tables.segment_pos_begin[g]; q < tables.segment_pos_begin[g + 1]; ++q)
        table_steps<T, M, kUpcast>(w, position_rows(p, extra, sel, hidden, tables.segment_positions[q]), hidden,
                                   acc);
    }
  });
}

}  // namespace

Status rmsnorm_forward(const RmsnormParams& p, Stream) {
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    forward<decltype(t), decltype(m), decltype(up)::value>(p);
  });
  return Status();
}

Status rmsnorm_backward_rows(const RmsnormBackwardParams& p, Stream) {
  if (!p.dx.present()) return Status();
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    backward_rows<decltype(t), decltype(m), decltype(up)::value>(p);
  });
  return Status();
}

Status rmsnorm_backward_partials(const RmsnormBackwardParams& p, const ChunkSelection& sel, const ExtraRows& extra,
                                 const TensorView& weight_partials, const TensorView& table_partials, Stream) {
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    backward_partials<decltype(t), decltype(m), decltype(up)::value>(p, sel, extra, weight_partials, table_partials);
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
