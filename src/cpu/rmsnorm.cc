// RMSNorm (plain and AdaLN-modulated), CPU reference: the executable form of
// docs/numerics.md 5.6 (forward), 6.7 (backward) and 7 (the row tree).
//
// x, grad, out, dx are contiguous (M, H) rows, M = B*S; position p = row p
// uses table row plan.row_of_seq[p % S]. x, weight and out are aligned to
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
#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/reduction.h"
#include "cpu/unaligned.h"

namespace detdit {
namespace cpu {
namespace {

bool is_modulated(const TensorView& shift) { return shift.present(); }

// rstd of one row: rsqrt_P(rn(rn(ss / H) + eps)), ss by the row tree of fma(x, x, s).
template <typename T>
float row_rstd(const T* x, int64_t hidden, float eps) {
  const float ss = row_tree_sum(hidden, [&](int64_t i, float* a, float* b) { *a = *b = to_float(x[i]); });
  const float ms = num::div32(ss, static_cast<float>(hidden));
  return num::portable_rsqrt(num::add32(ms, eps));
}

// d_n_i = g_i (plain: scale_row null) or rn(g_i * t1_i) (modulated; t1 from
// the scale row at scale_row).
template <typename T>
float grad_normalised(const void* scale_row, int64_t i, float g) {
  if (scale_row == nullptr) return g;
  return rowwise::modulated_grad<T>(g, to_float(load<T>(scale_row, i)));
}

// The scale row of position p's table row, or null for a plain norm.
const void* scale_row(const RmsnormBackwardParams& p, const int32_t* row_of_seq, int64_t pos, int64_t seq_len) {
  if (!is_modulated(p.in.shift)) return nullptr;
  return row_address(p.in.scale, rowwise::table_row(row_of_seq, pos, seq_len));
}

template <typename T>
void forward(const RmsnormParams& p) {
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  const int64_t rows = p.in.x.numel() / hidden;
  const T* x = static_cast<const T*>(p.in.x.data);
  const T* w = static_cast<const T*>(p.in.weight.data);
  T* out = static_cast<T*>(p.out.data);
  const int32_t* row_of_seq = is_modulated(p.in.shift) ? p.in.plan.host_tables().row_of_seq : nullptr;
  const int64_t seq_len = p.in.plan.valid() ? p.in.plan.seq_len() : 1;
  parallel_for(0, rows, [&](int64_t m) {
    const int64_t h = hidden;  // bounds and bases in locals (unaligned.h)
    const T* xr = x + m * h;   // (H,) row m
    T* outr = out + m * h;
    const float rstd = row_rstd(xr, h, p.in.eps);
    if (p.rstd.present()) store(p.rstd.data, m, rstd);
    const int64_t table_row = row_of_seq ? rowwise::table_row(row_of_seq, m, seq_len) : 0;
    const void* shift = row_of_seq ? row_address(p.in.shift, table_row) : nullptr;
    const void* scale = row_of_seq ? row_address(p.in.scale, table_row) : nullptr;
    for (int64_t i = 0; i < h; ++i) {
      const float n = rowwise::normalised<T>(to_float(w[i]), rstd, to_float(xr[i]));
      outr[i] = from_float<T>(
          row_of_seq ? rowwise::modulated<T>(n, to_float(load<T>(scale, i)), to_float(load<T>(shift, i))) : n);
    }
  });
}

template <typename T>
void backward_rows(const RmsnormBackwardParams& p) {
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  const int64_t rows = p.in.x.numel() / hidden;
  const T* x = static_cast<const T*>(p.in.x.data);
  const T* w = static_cast<const T*>(p.in.weight.data);
  const int32_t* row_of_seq = is_modulated(p.in.shift) ? p.in.plan.host_tables().row_of_seq : nullptr;
  const int64_t seq_len = p.in.plan.valid() ? p.in.plan.seq_len() : 1;
  parallel_for(0, rows, [&](int64_t m) {
    const int64_t h = hidden;  // bounds and bases in locals (unaligned.h)
    const T* xr = x + m * h;   // (H,) row m; grad and dx row m start at element m * h
    const void* grad = static_cast<const char*>(p.grad.data) + m * h * static_cast<int64_t>(sizeof(T));
    void* dx = static_cast<char*>(p.dx.data) + m * h * static_cast<int64_t>(sizeof(T));
    const void* scale = scale_row(p, row_of_seq, m, seq_len);
    const float rstd = load<float>(p.rstd.data, m);
    std::vector<float> d_n_row(static_cast<std::size_t>(h));
    float* d_n = d_n_row.data();
    for (int64_t i = 0; i < h; ++i) d_n[i] = grad_normalised<T>(scale, i, to_float(load<T>(grad, i)));
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

template <typename T>
void backward_partials(const RmsnormBackwardParams& p, const ChunkSelection& sel, const ExtraRows& extra,
                       const TensorView& weight_partials, const TensorView& table_partials) {
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  // positions: the plan's B*S; a plain norm without a plan reduces its own rows.
  const int64_t positions = p.in.plan.valid() ? p.in.plan.positions() : p.in.x.numel() / hidden;
  const int64_t num_chunks = (positions + kReductionChunk - 1) / kReductionChunk;
  const bool modulated = is_modulated(p.in.shift);
  const SelectedChunks selected = select_chunks(p.in.plan, num_chunks, sel);
  const T* w = static_cast<const T*>(p.in.weight.data);
  const int32_t* row_of_seq = p.in.plan.valid() ? p.in.plan.host_tables().row_of_seq : nullptr;
  const int64_t seq_len = p.in.plan.valid() ? p.in.plan.seq_len() : 1;
  parallel_for(0, static_cast<int64_t>(selected.chunk.size()), [&](int64_t k) {
    const int64_t c = selected.chunk[k];
    if (weight_partials.present()) {
      // d_weight: one segment per chunk, all its positions ascending.
      float* acc = row_ptr<float>(weight_partials, k);  // (H,)
      for (int64_t i = 0; i < hidden; ++i) acc[i] = 0.0f;
      const int64_t end = std::min(positions, (c + 1) * kReductionChunk);
      for (int64_t pos = c * kReductionChunk; pos < end; ++pos) {
        const PositionRows in = position_rows(p, extra, sel, hidden, pos);
        const void* scale = scale_row(p, row_of_seq, pos, seq_len);
        for (int64_t i = 0; i < hidden; ++i) {
          const float d_n = grad_normalised<T>(scale, i, to_float(load<T>(in.grad, in.first + i)));
          acc[i] = rowwise::weight_grad_step(d_n, to_float(load<T>(in.x, in.first + i)), in.rstd, acc[i]);
        }
      }
    }
    if (modulated && table_partials.present()) {
      // [d_shift | d_scale]: one (2H,) partial per segment of the chunk.
      const PlanTables& tables = p.in.plan.host_tables();
      int64_t out_row = selected.segment_offset[k];
      for (int32_t g = tables.chunk_segment_begin[c]; g < tables.chunk_segment_begin[c + 1]; ++g, ++out_row) {
        float* acc = row_ptr<float>(table_partials, out_row);  // (2H,)
        for (int64_t j = 0; j < 2 * hidden; ++j) acc[j] = 0.0f;
        for (int32_t q = tables.segment_pos_begin[g]; q < tables.segment_pos_begin[g + 1]; ++q) {
          const PositionRows in = position_rows(p, extra, sel, hidden, tables.segment_positions[q]);
          for (int64_t i = 0; i < hidden; ++i) {
            const float g_i = to_float(load<T>(in.grad, in.first + i));
            acc[i] = num::add32(acc[i], g_i);
            const float n = rowwise::normalised<T>(to_float(w[i]), in.rstd, to_float(load<T>(in.x, in.first + i)));
            acc[hidden + i] = rowwise::scale_grad_step(g_i, n, acc[hidden + i]);
          }
        }
      }
    }
  });
}

}  // namespace

Status rmsnorm_forward(const RmsnormParams& p, Stream) {
  dispatch_float_dtype(p.in.x.dtype, [&](auto tag) { forward<decltype(tag)>(p); });
  return Status();
}

Status rmsnorm_backward_rows(const RmsnormBackwardParams& p, Stream) {
  if (!p.dx.present()) return Status();
  dispatch_float_dtype(p.in.x.dtype, [&](auto tag) { backward_rows<decltype(tag)>(p); });
  return Status();
}

Status rmsnorm_backward_partials(const RmsnormBackwardParams& p, const ChunkSelection& sel, const ExtraRows& extra,
                                 const TensorView& weight_partials, const TensorView& table_partials, Stream) {
  dispatch_float_dtype(p.in.x.dtype, [&](auto tag) {
    backward_partials<decltype(tag)>(p, sel, extra, weight_partials, table_partials);
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
