// Gated residual, CPU reference: docs/numerics.md 5.7 (forward) and 6.8
// (backward), with the modulation forms and recipes of 5.12 and 6.11.
// residual, y, out, grad, d_residual, d_y are contiguous (M, H) rows,
// M = B*S; position p reads its gate row at modulation_offset
// (common/modulation_math.h: the indexed row plan.row_of_seq[p % S], or its
// sample, frame or token row); without a gate out = R_T(rn(res + y)). Each
// kernel is a template over the recipe <T, M, upcast> (modulation_math.h). The backward
// is rows (d_residual, d_y) + segment partials of d_gate + fold, the split the
// sequence-parallel region runs on a chunk subset. No tensor of the op has an
// alignment rule: every element moves through cpu::load / cpu::store
// (src/cpu/unaligned.h), never a typed access at a misaligned address.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/backends.h"
#include "common/modulation_math.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/reduction.h"
#include "cpu/unaligned.h"
#include "rowwise/checks.h"

namespace detdit {
namespace cpu {
namespace {

// The gate of a call as the kernels address it.
struct Gate {
  ResolvedModulation mod;
  ModulationOperand gate;
  const int32_t* row_of_seq = nullptr;  // the plan's (indexed form)
  bool has_k = false;
  float k = 0.0f;
  bool on() const { return mod.form != ModulationForm::kNone; }
  int64_t at(int64_t p) const { return modulation_offset(gate, mod.form, mod.seq_len, mod.frame_len, row_of_seq, p); }
};
Gate gate_of(const GateResidualInputs& in) {
  Gate g;
  g.mod = rowwise::gate_modulation(in);
  g.gate = modulation_operand(in.gate, g.mod);
  if (g.mod.form == ModulationForm::kIndexed) g.row_of_seq = in.plan.host_tables().row_of_seq;
  g.has_k = in.has_k;
  g.k = in.k;
  return g;
}

// The gate term of element i at offset `at`: gate, or R_Factor(rn(k + gate)).
template <typename Factor, typename M>
float gate_term(const void* gate, int64_t at, bool has_k, float k) {
  const float v = to_float(load<M>(gate, at));
  return has_k ? rowwise::gate_with_constant<Factor>(k, v) : v;
}

template <typename T, typename M, bool kUpcast>
void forward(const GateResidualParams& p) {
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  const int64_t hidden = p.in.residual.shape[p.in.residual.rank - 1];
  const int64_t rows = p.in.residual.numel() / hidden;
  const Gate g = gate_of(p.in);
  parallel_for(0, rows, [&](int64_t m) {
    // Everything the loop reads in locals of the block: a cpu::store may alias
    // any memory (the captures included), and reloading them every iteration
    // would keep the loop from vectorising.
    const int64_t n = hidden, row = m * n;  // (H,) row m of residual, y and out
    const bool on = g.on(), has_k = g.has_k;
    const float k = g.k;
    const int64_t gate = on ? g.at(m) : 0;
    const void *residual = p.in.residual.data, *y = p.in.y.data, *gate_table = g.gate.data;
    void* out = p.out.data;
    for (int64_t i = 0; i < n; ++i) {
      const float r = to_float(load<T>(residual, row + i)), yv = to_float(load<T>(y, row + i));
      const float v = on ? rowwise::gated_sum<typename R::Mid>(
                               r, gate_term<typename R::Factor, M>(gate_table, gate + i, has_k, k), yv)
                         : num::add32(r, yv);
      store(out, row + i, from_float<Out>(v));
    }
  });
}

template <typename T, typename M, bool kUpcast>
void backward_rows(const GateResidualBackwardParams& p) {
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  const int64_t rows = p.grad.numel() / hidden;
  if (p.d_residual.present()) {
    // d_residual = R_T(grad): a byte copy when grad has the rows' dtype.
    if (std::is_same<Out, T>::value) {
      std::memcpy(p.d_residual.data, p.grad.data, p.grad.nbytes());
    } else {
      parallel_for(0, rows, [&](int64_t m) {
        const int64_t n = hidden, row = m * n;
        const void* grad = p.grad.data;
        void* d_residual = p.d_residual.data;
        for (int64_t i = 0; i < n; ++i) store(d_residual, row + i, from_float<T>(to_float(load<Out>(grad, row + i))));
      });
    }
  }
  if (!p.d_y.present()) return;
  const Gate g = gate_of(p.in);
  parallel_for(0, rows, [&](int64_t m) {
    const int64_t n = hidden, row = m * n;  // (H,) row m of grad and d_y; locals, as in the forward
    const bool on = g.on(), has_k = g.has_k;
    const float k = g.k;
    const int64_t gate = on ? g.at(m) : 0;
    const void *grad = p.grad.data, *gate_table = g.gate.data;
    void* d_y = p.d_y.data;
    for (int64_t i = 0; i < n; ++i) {
      const float gr = to_float(load<Out>(grad, row + i));
      const float v =
          on ? rowwise::gated_grad(gr, gate_term<typename R::Factor, M>(gate_table, gate + i, has_k, k)) : gr;
      store(d_y, row + i, from_float<T>(v));
    }
  });
}

// d_gate partials: fma(grad_i, y_i, acc) over each segment's positions
// (indexed) or over each chunk of each group (grouped forms, partial row
// g*Cg + c holding positions [g*L + 256c, min(g*L + 256(c + 1), (g + 1)*L))).
template <typename T, typename M, bool kUpcast>
void backward_partials(const GateResidualBackwardParams& p, const ChunkSelection& sel, const ExtraRows& extra,
                       const TensorView& partials) {
  using Out = typename Recipe<T, M, kUpcast>::Out;
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  // One position's steps into acc (H,).
  auto steps = [&](int64_t pos, float* acc) {
    const DataRow d = data_row(sel, pos);
    // the position's rows and the bound in locals (unaligned.h; the step calls fmaf)
    const int64_t n = hidden, offset = d.row * n;
    const void* grad = (d.extra ? extra.grad : p.grad).data;
    const void* y = (d.extra ? extra.y : p.in.y).data;
    for (int64_t i = 0; i < n; ++i)
      acc[i] = rowwise::gate_grad_step(to_float(load<Out>(grad, offset + i)), to_float(load<T>(y, offset + i)), acc[i]);
  };
  const ResolvedModulation mod = rowwise::gate_modulation(p.in);
  if (mod.grouped()) {
    const int64_t len = mod.frame_len;
    const int64_t per_group = (len + kReductionChunk - 1) / kReductionChunk;
    parallel_for(0, mod.groups() * per_group, [&](int64_t row) {
      const int64_t g = row / per_group, c = row % per_group;
      float* acc = row_ptr<float>(partials, row);  // (H,)
      for (int64_t i = 0; i < hidden; ++i) acc[i] = 0.0f;
      const int64_t begin = g * len + c * kReductionChunk;
      const int64_t end = std::min(begin + kReductionChunk, (g + 1) * len);
      for (int64_t pos = begin; pos < end; ++pos) steps(pos, acc);
    });
    return;
  }
  const PlanTables& tables = p.in.plan.host_tables();
  const SelectedChunks selected = select_chunks(p.in.plan, p.in.plan.num_chunks(), sel);
  parallel_for(0, static_cast<int64_t>(selected.chunk.size()), [&](int64_t k) {
    const int64_t c = selected.chunk[k];
    int64_t out_row = selected.segment_offset[k];
    for (int32_t g = tables.chunk_segment_begin[c]; g < tables.chunk_segment_begin[c + 1]; ++g, ++out_row) {
      float* acc = row_ptr<float>(partials, out_row);  // (H,)
      for (int64_t i = 0; i < hidden; ++i) acc[i] = 0.0f;
      for (int32_t q = tables.segment_pos_begin[g]; q < tables.segment_pos_begin[g + 1]; ++q)
        steps(tables.segment_positions[q], acc);
    }
  });
}

DType gate_dtype(const GateResidualInputs& in) { return in.gate.present() ? in.gate.dtype : in.y.dtype; }

}  // namespace

Status gate_residual_forward(const GateResidualParams& p, Stream) {
  dispatch_recipe(p.in.residual.dtype, gate_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    forward<decltype(t), decltype(m), decltype(up)::value>(p);
  });
  return Status();
}

Status gate_residual_backward_rows(const GateResidualBackwardParams& p, Stream) {
  dispatch_recipe(p.in.y.dtype, gate_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    backward_rows<decltype(t), decltype(m), decltype(up)::value>(p);
  });
  return Status();
}

Status gate_residual_backward_partials(const GateResidualBackwardParams& p, const ChunkSelection& sel,
                                       const ExtraRows& extra, const TensorView& partials, Stream) {
  dispatch_recipe(p.in.y.dtype, gate_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    backward_partials<decltype(t), decltype(m), decltype(up)::value>(p, sel, extra, partials);
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
