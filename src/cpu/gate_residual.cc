// Gated residual, CPU reference: docs/numerics.md 5.7 (forward) and 6.8
// (backward). residual, y, out, grad, d_residual, d_y are contiguous (M, H)
// rows, M = B*S; position p uses gate row plan.row_of_seq[p % S]. The backward
// is rows (d_residual, d_y) + segment partials of d_gate + fold, the split the
// sequence-parallel region runs on a chunk subset. No tensor of the op has an
// alignment rule: every element moves through cpu::load / cpu::store
// (src/cpu/unaligned.h), never a typed access at a misaligned address.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/backends.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/reduction.h"
#include "cpu/unaligned.h"

namespace detdit {
namespace cpu {
namespace {

template <typename T>
void forward(const GateResidualParams& p) {
  const int64_t hidden = p.in.residual.shape[p.in.residual.rank - 1];
  const int64_t rows = p.in.residual.numel() / hidden;
  const int32_t* row_of_seq = p.in.plan.host_tables().row_of_seq;
  const int64_t seq_len = p.in.plan.seq_len();
  parallel_for(0, rows, [&](int64_t m) {
    // Everything the loop reads in locals of the block: a cpu::store may alias
    // any memory (the captures included), and reloading them every iteration
    // would keep the loop from vectorising.
    const int64_t n = hidden, row = m * n;  // (H,) row m of residual, y and out
    const int64_t gate = rowwise::table_row(row_of_seq, m, seq_len) * p.in.gate.strides[0];
    const void *residual = p.in.residual.data, *y = p.in.y.data, *gate_table = p.in.gate.data;
    void* out = p.out.data;
    for (int64_t i = 0; i < n; ++i)
      store(out, row + i,
            from_float<T>(rowwise::gated_sum<T>(to_float(load<T>(residual, row + i)),
                                                to_float(load<T>(gate_table, gate + i)),
                                                to_float(load<T>(y, row + i)))));
  });
}

template <typename T>
void backward_rows(const GateResidualBackwardParams& p) {
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  const int64_t rows = p.grad.numel() / hidden;
  if (p.d_residual.present()) std::memcpy(p.d_residual.data, p.grad.data, p.grad.nbytes());
  if (!p.d_y.present()) return;
  const int32_t* row_of_seq = p.in.plan.host_tables().row_of_seq;
  const int64_t seq_len = p.in.plan.seq_len();
  parallel_for(0, rows, [&](int64_t m) {
    const int64_t n = hidden, row = m * n;  // (H,) row m of grad and d_y; locals, as in the forward
    const int64_t gate = rowwise::table_row(row_of_seq, m, seq_len) * p.in.gate.strides[0];
    const void *grad = p.grad.data, *gate_table = p.in.gate.data;
    void* d_y = p.d_y.data;
    for (int64_t i = 0; i < n; ++i)
      store(d_y, row + i,
            from_float<T>(rowwise::gated_grad(to_float(load<T>(grad, row + i)), to_float(load<T>(gate_table, gate + i)))));
  });
}

// d_gate segment partials: fma(grad_i, y_i, acc) over each segment's positions.
template <typename T>
void backward_partials(const GateResidualBackwardParams& p, const ChunkSelection& sel, const ExtraRows& extra,
                       const TensorView& partials) {
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  const PlanTables& tables = p.in.plan.host_tables();
  const SelectedChunks selected = select_chunks(p.in.plan, p.in.plan.num_chunks(), sel);
  parallel_for(0, static_cast<int64_t>(selected.chunk.size()), [&](int64_t k) {
    const int64_t c = selected.chunk[k];
    int64_t out_row = selected.segment_offset[k];
    for (int32_t g = tables.chunk_segment_begin[c]; g < tables.chunk_segment_begin[c + 1]; ++g, ++out_row) {
      float* acc = row_ptr<float>(partials, out_row);  // (H,)
      for (int64_t i = 0; i < hidden; ++i) acc[i] = 0.0f;
      for (int32_t q = tables.segment_pos_begin[g]; q < tables.segment_pos_begin[g + 1]; ++q) {
        const DataRow d = data_row(sel, tables.segment_positions[q]);
        // the position's rows and the bound in locals (unaligned.h; the step calls fmaf)
        const int64_t n = hidden, offset = d.row * n * static_cast<int64_t>(sizeof(T));
        const char* grad = static_cast<const char*>((d.extra ? extra.grad : p.grad).data) + offset;
        const char* y = static_cast<const char*>((d.extra ? extra.y : p.in.y).data) + offset;
        for (int64_t i = 0; i < n; ++i)
          acc[i] = rowwise::gate_grad_step(to_float(load<T>(grad, i)), to_float(load<T>(y, i)), acc[i]);
      }
    }
  });
}

}  // namespace

Status gate_residual_forward(const GateResidualParams& p, Stream) {
  dispatch_float_dtype(p.in.residual.dtype, [&](auto tag) { forward<decltype(tag)>(p); });
  return Status();
}

Status gate_residual_backward_rows(const GateResidualBackwardParams& p, Stream) {
  dispatch_float_dtype(p.grad.dtype, [&](auto tag) { backward_rows<decltype(tag)>(p); });
  return Status();
}

Status gate_residual_backward_partials(const GateResidualBackwardParams& p, const ChunkSelection& sel,
                                       const ExtraRows& extra, const TensorView& partials, Stream) {
  dispatch_float_dtype(p.grad.dtype, [&](auto tag) { backward_partials<decltype(tag)>(p, sel, extra, partials); });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
