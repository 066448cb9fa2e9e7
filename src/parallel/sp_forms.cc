// The sp_region's grouped modulation forms (per sample, per frame, per token)
// and the plain ops of an SpPlan without an index, byte-equal to WS1
// (contract in include/detdit/parallel.h, walk-through in docs/parallel.md 6).
//
// Rank r holds positions [lo, hi) = [r*S/W, (r+1)*S/W) of every item. The
// modulation: per sample (B, H) / (B, 1, H) and per frame (B, F, H) /
// (B, F, 1, H) are replicated; per token is this rank's rows (B, S_local, H),
// like the activations (its gradients too).
//
// Forward: row-local. Per sample and per token it is the WS1 op on the local
// rows; per frame, the frames cut the local rows into pieces (a partial frame
// at either end of an item's rows, the whole frames between them as one
// piece), each a WS1 call whose modulation is per sample: the pieces' rows
// (k, n, H) with the (k, H) rows of their frames.
//
// Backward: the row-local gradients (dx, d_residual, d_y; per token also
// d_shift, d_scale, d_gate) by the same pieces. A gradient summed over
// positions is a list of chunks (d_weight: the canonical 256-position chunks
// of the B*S positions; a grouped d_shift / d_scale / d_gate: the chunks of
// 256 counted from each group's first position, numerics 6.11), each an
// ascending FP32 chain from +0.0; the chunk's owner is the holder of its
// first position. Per call:
//   1. validate, allocate every buffer, agree (as sp_region.cc);
//   2. ONE all-gather of the rows of chunks owned by another rank (x, grad,
//      rstd / grad, y; a per-token scale for d_weight);
//   3. the owner copies its chunks' rows, own and received, into contiguous
//      rows in its own order (its 256-position chunks ascending, then its
//      short chunks ascending): (k, 256, H) and (k, r, H), a batch of k
//      "items" whose per-sample partials are exactly the chunks' chains (the
//      backends' partials halves, any device, any recipe); d_weight's chunks
//      are consecutive rows (k*256 + r, H) with each position's scale copied
//      beside it (a per-token modulation of those rows);
//   4. ONE all-gather of every rank's chunk partials, put in global chunk
//      order on every rank;
//   5. every rank runs the WS1 fold (fold_chunk_partials,
//      fold_group_partials) over the same bytes: the replicated gradients
//      are WS1's, identical on every rank.
// Every bit is decided by the WS1 backends; this file only moves bytes.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/modulation.h"
#include "parallel/copy.h"
#include "parallel/sp_region_impl.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"
#include "rowwise/gate_residual_norm.h"

namespace detdit {
namespace sp_detail {
namespace {

int64_t hidden_of(const TensorView& t) { return t.shape[t.rank - 1]; }
std::size_t elem(const TensorView& t) { return dtype_size(t.dtype); }

// ---------------------------------------------------------------- the form

// The form of a call's modulation. A tensor whose leading dimensions are the
// local rows' (B, S_local) is per token (this rank's rows); any other is
// resolved against the global (B, S, H): per sample or per frame (a full
// (B, S, H) per-token tensor is refused at world > 1).
Status resolve_form(const SpPlan& sp, const TensorView& rows, const char* rows_name,
                    std::initializer_list<NamedModulation> tensors, ResolvedModulation* mod) {
  bool any = false;
  const TensorView* first = nullptr;
  for (const NamedModulation& t : tensors)
    if (t.tensor->present()) {
      any = true;
      if (first == nullptr) first = t.tensor;
    }
  ResolvedModulation r;
  r.dtype = rows.dtype;
  r.batch = sp.batch();
  r.seq_len = sp.seq_len();
  if (!any) {
    *mod = r;
    return Status();
  }
  if (rows.rank != 3)
    return Status::value_error(std::string(rows_name) + " must be this rank's (B, S_local, H) = (" +
                               std::to_string(sp.batch()) + ", " + std::to_string(sp.local_seq_len()) +
                               ", H) rows with a per-sample, per-frame or per-token modulation, got " +
                               rows.describe());
  ResolvedModulation local;
  if (resolve_modulation(rows, rows_name, tensors, IndexPlan(), &local).ok() &&
      local.form == ModulationForm::kPerToken) {
    *mod = local;
    return Status();
  }
  const TensorView global = TensorView::contiguous(rows.data, rows.dtype, {sp.batch(), sp.seq_len(), hidden_of(rows)},
                                                   rows.device);
  DETDIT_RETURN_IF_ERROR(resolve_modulation(global, rows_name, tensors, IndexPlan(), mod));
  if (mod->form == ModulationForm::kPerToken)
    return Status::value_error("a per-token modulation under sequence parallelism is this rank's rows (B, S_local, "
                               "H) = (" + std::to_string(sp.batch()) + ", " + std::to_string(sp.local_seq_len()) +
                               ", H), like the activations, got " + first->describe());
  return Status();
}

// The fused gate_residual_layernorm under SP takes no index plan (its
// indexed form is not part of the region; layernorm's is).
Status check_no_plan(const SpPlan& sp, const IndexPlan& plan) {
  if (!sp.valid()) return Status::value_error("sp is required, got an empty SpPlan");
  if (plan.valid())
    return Status::value_error("plan must be absent: sp_gate_residual_layernorm takes the plain ops and the "
                               "per-sample, per-frame and per-token forms; its indexed form is not implemented under "
                               "sequence parallelism");
  return Status();
}

// ---------------------------------------------------------------- pieces

// Rows [row0, row0 + groups*len) of the local rows as (groups, len, H): whole
// frames of one item (len = L) or part of one frame (groups = 1), item b,
// first frame `frame`.
struct Piece {
  int64_t row0 = 0, groups = 0, len = 0, b = 0, frame = 0;
};

// The pieces of a per-frame call: per item, the partial frames at either end
// of its rows and the whole frames between them.
std::vector<Piece> frame_pieces(const SpPlan& sp, const ResolvedModulation& mod) {
  std::vector<Piece> pieces;
  const int64_t lo = sp.local_begin(), hi = sp.local_end(), len = mod.frame_len, local = sp.local_seq_len();
  for (int64_t b = 0; b < sp.batch(); ++b) {
    for (int64_t s = lo; s < hi;) {
      const int64_t f = s / len, row0 = b * local + (s - lo);
      if (s % len == 0 && s + len <= hi) {
        const int64_t k = (hi - s) / len;
        pieces.push_back(Piece{row0, k, len, b, f});
        s += k * len;
      } else {
        const int64_t end = std::min((f + 1) * len, hi);
        pieces.push_back(Piece{row0, 1, end - s, b, f});
        s = end;
      }
    }
  }
  return pieces;
}

TensorView piece_rows(const TensorView& t, const Piece& pc) {
  if (!t.present()) return t;
  const int64_t h = hidden_of(t);
  return TensorView::contiguous(static_cast<char*>(t.data) + pc.row0 * h * static_cast<int64_t>(elem(t)), t.dtype,
                                {pc.groups, pc.len, h}, t.device);
}

TensorView piece_vector(const TensorView& t, const Piece& pc) {
  if (!t.present()) return t;
  return TensorView::contiguous(static_cast<char*>(t.data) + pc.row0 * static_cast<int64_t>(elem(t)), t.dtype,
                                {pc.groups * pc.len}, t.device);
}

// The (groups, H) frame rows of a piece: per-sample modulation of its rows.
TensorView piece_mod(const TensorView& m, const ResolvedModulation& mod, const Piece& pc) {
  if (!m.present()) return m;
  const ModulationOperand op = modulation_operand(m, mod);
  const int64_t offset = pc.b * op.stride_b + pc.frame * op.stride_f;
  return TensorView::strided(static_cast<char*>(m.data) + offset * static_cast<int64_t>(elem(m)), m.dtype,
                             {pc.groups, hidden_of(m)}, {op.stride_f, 1}, m.device);
}

// A (k, H) view of m's first row repeated: the modulation operand of a batch
// of chunk rows whose partials do not read it (d_shift, d_scale and d_gate
// partials read grad, x, y and the statistics only; the type is m's).
TensorView repeated_mod(const TensorView& m, int64_t k) {
  if (!m.present()) return m;
  return TensorView::strided(m.data, m.dtype, {k, hidden_of(m)}, {0, 1}, m.device);
}

// The rows of a piece of a norm's inputs (RmsnormInputs or LayernormInputs):
// x and its modulation rows.
template <typename NormInputs>
NormInputs norm_piece(const NormInputs& in, const ResolvedModulation& mod, const Piece& pc) {
  NormInputs q = in;
  q.x = piece_rows(in.x, pc);
  q.shift = piece_mod(in.shift, mod, pc);
  q.scale = piece_mod(in.scale, mod, pc);
  return q;
}

GateResidualInputs gate_piece(const GateResidualInputs& in, const ResolvedModulation& mod, const Piece& pc) {
  GateResidualInputs q = in;
  q.residual = piece_rows(in.residual, pc);
  q.y = piece_rows(in.y, pc);
  q.gate = piece_mod(in.gate, mod, pc);
  return q;
}

RmsnormParams piece_of(const RmsnormParams& p, const ResolvedModulation& mod, const Piece& pc) {
  RmsnormParams q = p;
  q.in = norm_piece(p.in, mod, pc);
  q.out = piece_rows(p.out, pc);
  q.rstd = piece_vector(p.rstd, pc);
  return q;
}

// The rows half of a piece: dx (the gradients summed over positions are absent).
RmsnormBackwardParams piece_of(const RmsnormBackwardParams& p, const ResolvedModulation& mod, const Piece& pc) {
  RmsnormBackwardParams q = p;
  q.in = norm_piece(p.in, mod, pc);
  q.rstd = piece_vector(p.rstd, pc);
  q.grad = piece_rows(p.grad, pc);
  q.dx = piece_rows(p.dx, pc);
  q.d_weight = q.d_shift = q.d_scale = TensorView();
  return q;
}

LayernormParams piece_of(const LayernormParams& p, const ResolvedModulation& mod, const Piece& pc) {
  LayernormParams q = p;
  q.in = norm_piece(p.in, mod, pc);
  q.out = piece_rows(p.out, pc);
  q.mean = piece_vector(p.mean, pc);
  q.rstd = piece_vector(p.rstd, pc);
  return q;
}

LayernormBackwardParams piece_of(const LayernormBackwardParams& p, const ResolvedModulation& mod, const Piece& pc) {
  LayernormBackwardParams q = p;
  q.in = norm_piece(p.in, mod, pc);
  q.mean = piece_vector(p.mean, pc);
  q.rstd = piece_vector(p.rstd, pc);
  q.grad = piece_rows(p.grad, pc);
  q.dx = piece_rows(p.dx, pc);
  q.d_weight = q.d_bias = q.d_shift = q.d_scale = TensorView();
  return q;
}

GateResidualParams piece_of(const GateResidualParams& p, const ResolvedModulation& mod, const Piece& pc) {
  GateResidualParams q = p;
  q.in = gate_piece(p.in, mod, pc);
  q.out = piece_rows(p.out, pc);
  return q;
}

GateResidualBackwardParams piece_of(const GateResidualBackwardParams& p, const ResolvedModulation& mod,
                                    const Piece& pc) {
  GateResidualBackwardParams q = p;
  q.in = gate_piece(p.in, mod, pc);
  q.grad = piece_rows(p.grad, pc);
  q.d_residual = piece_rows(p.d_residual, pc);
  q.d_y = piece_rows(p.d_y, pc);
  q.d_gate = TensorView();
  return q;
}

// ---------------------------------------------------------------- chunk reductions

// One gradient summed over chunks of positions (header): which rows move,
// where each owned chunk's rows go, and where every chunk's partial sits.
struct ChunkReduction {
  bool on = false;
  int64_t chunks = 0, short_len = 0;  // chunks of 256 positions, and of short_len (< 256) positions
  int64_t width = 0;                  // floats per partial
  int64_t planes = 1;                 // partials per chunk (layernorm: d_weight's and d_bias's)
  // This rank's sent rows (src: local row, dst: slot) and the largest send block.
  std::vector<SpRun> send_runs;
  int64_t max_send = 0;
  // This rank's chunk rows: `count` rows to row `dst`, from local row `src`
  // (rank < 0) or slot `src` of rank `rank`'s block; `position` is the
  // global position of the first.
  struct Source {
    int32_t rank = -1;
    int64_t src = 0, dst = 0, count = 0, position = 0;
  };
  std::vector<Source> sources;
  int64_t owned_full = 0, owned_short = 0, max_owned = 0;
  std::vector<int32_t> owner;   // (chunks,) the owner of chunk j
  std::vector<int64_t> index;   // (chunks,) its partial's row among its owner's
  // Buffers (allocated before the agreement).
  RowExchange rows;
  std::vector<std::size_t> field_bytes;  // per field, bytes per row of the chunk rows
  std::vector<void*> fields;             // per field, the chunk rows (owned_rows(), ...)
  float* partials = nullptr;             // (planes, max_owned, width) this rank's
  float* gathered = nullptr;             // world of them
  float* global = nullptr;               // (planes, chunks, width) in chunk order
  std::shared_ptr<void> memory;
  int64_t owned_rows() const { return owned_full * kReductionChunk + owned_short * short_len; }
};

// The layout of a reduction over `chunks` chunks: chunk j is the positions
// [start(j), start(j) + length(j)) of the flattened b-major order, inside
// one item or, for d_weight's, across items.
void plan_reduction(const SpPlan& sp, int64_t chunks, const std::function<int64_t(int64_t)>& start,
                    const std::function<int64_t(int64_t)>& length, ChunkReduction* r) {
  const int world = sp.world(), rank = sp.rank();
  const int64_t seq_len = sp.seq_len(), local = sp.local_seq_len(), lo = sp.local_begin();
  std::vector<int64_t> bound(static_cast<std::size_t>(world + 1));
  for (int q = 0; q <= world; ++q) bound[q] = q * seq_len / world;
  auto holder = [&](int64_t s) {
    return static_cast<int32_t>(std::upper_bound(bound.begin(), bound.end(), s) - bound.begin() - 1);
  };
  r->on = true;
  r->chunks = chunks;
  r->owner.assign(static_cast<std::size_t>(chunks), 0);
  r->index.assign(static_cast<std::size_t>(chunks), 0);
  std::vector<int64_t> full(static_cast<std::size_t>(world), 0), shorts(static_cast<std::size_t>(world), 0);
  for (int64_t j = 0; j < chunks; ++j) {
    const int32_t q = holder(start(j) % seq_len);
    r->owner[j] = q;
    if (length(j) == kReductionChunk) {
      r->index[j] = full[q]++;
    } else {
      r->short_len = length(j);
      r->index[j] = shorts[q]++;
    }
  }
  for (int64_t j = 0; j < chunks; ++j)
    if (length(j) != kReductionChunk) r->index[j] += full[r->owner[j]];
  for (int q = 0; q < world; ++q) r->max_owned = std::max(r->max_owned, full[q] + shorts[q]);
  r->owned_full = full[rank];
  r->owned_short = shorts[rank];

  std::vector<int64_t> sent(static_cast<std::size_t>(world), 0);
  auto add_source = [&](int32_t from, int64_t src, int64_t dst, int64_t count, int64_t position) {
    if (!r->sources.empty()) {
      ChunkReduction::Source& last = r->sources.back();
      if (last.rank == from && last.src + last.count == src && last.dst + last.count == dst &&
          last.position + last.count == position) {
        last.count += count;
        return;
      }
    }
    r->sources.push_back(ChunkReduction::Source{from, src, dst, count, position});
  };
  for (int64_t j = 0; j < chunks; ++j) {
    const int64_t first = start(j), end = first + length(j);
    const int32_t owner = r->owner[j];
    const int64_t row_of_chunk = r->index[j] < r->owned_full || owner != rank
                                     ? r->index[j] * kReductionChunk
                                     : r->owned_full * kReductionChunk + (r->index[j] - r->owned_full) * r->short_len;
    for (int64_t p = first; p < end;) {
      const int64_t b = p / seq_len, s = p % seq_len;
      const int32_t q = holder(s);
      const int64_t n = std::min(end, b * seq_len + bound[q + 1]) - p;
      const int64_t local_row = b * local + (s - lo);  // meaningful when q == rank
      const int64_t dst = row_of_chunk + (p - first);
      if (q == owner) {
        if (owner == rank) add_source(-1, local_row, dst, n, p);
      } else {
        const int64_t slot = sent[q];
        sent[q] += n;
        if (q == rank) {
          const bool continues = !r->send_runs.empty() &&
                                 r->send_runs.back().src + r->send_runs.back().count == local_row &&
                                 r->send_runs.back().dst + r->send_runs.back().count == slot;
          if (continues)
            r->send_runs.back().count += n;
          else
            r->send_runs.push_back(SpRun{rank, local_row, slot, n});
        }
        if (owner == rank) add_source(q, slot, dst, n, p);
      }
      p += n;
    }
  }
  for (int q = 0; q < world; ++q) r->max_send = std::max(r->max_send, sent[q]);
}

// d_weight's chunks: the canonical 256-position chunks of the B*S positions.
void plan_weight(const SpPlan& sp, ChunkReduction* r) {
  const int64_t positions = sp.batch() * sp.seq_len();
  plan_reduction(
      sp, (positions + kReductionChunk - 1) / kReductionChunk, [](int64_t j) { return j * kReductionChunk; },
      [=](int64_t j) { return std::min(kReductionChunk, positions - j * kReductionChunk); }, r);
}

// A grouped form's chunks: chunk c of group g at row g*Cg + c (numerics 6.11).
void plan_groups(const SpPlan& sp, const ResolvedModulation& mod, ChunkReduction* r) {
  const int64_t len = mod.frame_len, per_group = rowwise::chunks_per_group(mod);
  plan_reduction(
      sp, mod.groups() * per_group,
      [=](int64_t j) { return (j / per_group) * len + (j % per_group) * kReductionChunk; },
      [=](int64_t j) { return std::min(kReductionChunk, len - (j % per_group) * kReductionChunk); }, r);
}

// The buffers of a planned reduction: the exchange of `field_bytes` rows,
// the chunk rows of each field (field_bytes, then extra_field_bytes: rows
// filled otherwise), and `planes` partials of `width` floats per chunk.
Status allocate_reduction(const SpPlan& sp, const Device& device, std::vector<std::size_t> field_bytes,
                          std::vector<std::size_t> extra_field_bytes, int64_t width, Stream stream,
                          ChunkReduction* r, int64_t planes = 1) {
  DETDIT_RETURN_IF_ERROR(allocate_rows(sp.world(), r->max_send, device, field_bytes, stream, &r->rows));
  r->width = width;
  r->planes = planes;
  r->field_bytes = field_bytes;
  r->field_bytes.insert(r->field_bytes.end(), extra_field_bytes.begin(), extra_field_bytes.end());
  const std::size_t rows = static_cast<std::size_t>(r->owned_rows());
  const std::size_t floats = static_cast<std::size_t>(width * planes);
  const std::size_t own = aligned_size(static_cast<std::size_t>(r->max_owned) * floats * sizeof(float));
  std::size_t bytes = own + static_cast<std::size_t>(sp.world()) * own +
                      aligned_size(static_cast<std::size_t>(r->chunks) * floats * sizeof(float));
  for (std::size_t b : r->field_bytes) bytes += aligned_size(rows * b);
  DETDIT_RETURN_IF_ERROR(allocate_scratch(device, bytes, stream, &r->memory));
  char* base = static_cast<char*>(r->memory.get());
  r->partials = reinterpret_cast<float*>(base);
  r->gathered = reinterpret_cast<float*>(base + own);
  base += own + static_cast<std::size_t>(sp.world()) * own;
  r->global = reinterpret_cast<float*>(base);
  base += aligned_size(static_cast<std::size_t>(r->chunks) * floats * sizeof(float));
  r->fields.clear();
  for (std::size_t b : r->field_bytes) {
    r->fields.push_back(base);
    base += aligned_size(rows * b);
  }
  return Status();
}

// Steps 2-3: the exchange of the first own_rows.size() fields and their
// chunk rows, own and received.
Status gather_chunk_rows(Communicator& comm, const ChunkReduction& r, const Device& device, DType dtype,
                         const std::vector<const void*>& own_rows, Stream stream) {
  std::vector<void*> extra;
  DETDIT_RETURN_IF_ERROR(exchange_rows(comm, r.send_runs, r.max_send, device, dtype, own_rows, r.rows, stream, &extra));
  for (std::size_t f = 0; f < own_rows.size(); ++f) {
    const std::size_t rb = r.field_bytes[f];
    for (const ChunkReduction::Source& s : r.sources) {
      const char* src = s.rank < 0 ? static_cast<const char*>(own_rows[f]) + s.src * rb
                                   : static_cast<const char*>(extra[f]) + (s.rank * r.max_send + s.src) * rb;
      DETDIT_RETURN_IF_ERROR(
          parallel_copy::copy(device, static_cast<char*>(r.fields[f]) + s.dst * rb, src, s.count * rb, stream));
    }
  }
  return Status();
}

// n copies of one row (`bytes`) from src to dst: one copy, then doubling.
Status repeat_row(const Device& device, char* dst, const char* src, std::size_t bytes, int64_t n, Stream stream) {
  if (n <= 0) return Status();
  DETDIT_RETURN_IF_ERROR(parallel_copy::copy(device, dst, src, bytes, stream));
  for (int64_t done = 1; done < n;) {
    const int64_t m = std::min(done, n - done);
    DETDIT_RETURN_IF_ERROR(parallel_copy::copy(device, dst + done * bytes, dst, m * bytes, stream));
    done += m;
  }
  return Status();
}

// Field f of the chunk rows = each position's row of a replicated per-sample
// or per-frame modulation m (a per-token modulation of the chunk rows).
Status fill_modulation_rows(const ChunkReduction& r, std::size_t f, const TensorView& m,
                            const ResolvedModulation& mod, const Device& device, Stream stream) {
  const ModulationOperand op = modulation_operand(m, mod);
  const std::size_t rb = r.field_bytes[f];
  for (const ChunkReduction::Source& s : r.sources) {
    for (int64_t p = s.position; p < s.position + s.count;) {
      const int64_t b = p / mod.seq_len, frame = (p % mod.seq_len) / mod.frame_len;
      const int64_t n = std::min(s.position + s.count, b * mod.seq_len + (frame + 1) * mod.frame_len) - p;
      const char* row = static_cast<const char*>(m.data) + (b * op.stride_b + frame * op.stride_f) * elem(m);
      DETDIT_RETURN_IF_ERROR(
          repeat_row(device, static_cast<char*>(r.fields[f]) + (s.dst + (p - s.position)) * rb, row, rb, n, stream));
      p += n;
    }
  }
  return Status();
}

// Field f's chunk rows as (k, len, H): the full chunks (short = false) or the short ones.
TensorView chunk_rows(const ChunkReduction& r, std::size_t f, bool short_chunks, DType dtype, int64_t hidden,
                      const Device& device) {
  const int64_t k = short_chunks ? r.owned_short : r.owned_full;
  const int64_t len = short_chunks ? r.short_len : kReductionChunk;
  const int64_t first = short_chunks ? r.owned_full * kReductionChunk : 0;
  char* data = static_cast<char*>(r.fields[f]) + first * static_cast<int64_t>(r.field_bytes[f]);
  if (hidden == 0) return TensorView::contiguous(data, dtype, {k * len}, device);  // a per-row statistic
  return TensorView::contiguous(data, dtype, {k, len, hidden}, device);
}

// Plane `plane` of this rank's partials: all its chunks (k = -1), or its full or short ones.
TensorView own_partials(const ChunkReduction& r, bool short_chunks, const Device& device, int64_t plane = 0,
                        bool all = false) {
  const int64_t first = short_chunks && !all ? r.owned_full : 0;
  const int64_t k = all ? r.owned_full + r.owned_short : short_chunks ? r.owned_short : r.owned_full;
  return TensorView::contiguous(r.partials + (plane * r.max_owned + first) * r.width, DType::kF32, {k, r.width},
                                device);
}

// Steps 4-5's gather: every rank's partials, in chunk order, on every rank.
Status gather_partials(Communicator& comm, const ChunkReduction& r, const Device& device, Stream stream) {
  const std::size_t row = static_cast<std::size_t>(r.width) * sizeof(float);
  const std::size_t plane_bytes = static_cast<std::size_t>(r.max_owned) * row;
  const std::size_t own = aligned_size(static_cast<std::size_t>(r.planes) * plane_bytes);
  DETDIT_RETURN_IF_ERROR(comm.all_gather(r.partials, own, r.gathered, DType::kF32, stream));
  const char* gathered = reinterpret_cast<const char*>(r.gathered);
  char* global = reinterpret_cast<char*>(r.global);
  for (int64_t plane = 0; plane < r.planes; ++plane) {
    for (int64_t j = 0; j < r.chunks;) {
      // a run of consecutive chunks whose partials are consecutive rows of one owner
      int64_t n = 1;
      while (j + n < r.chunks && r.owner[j + n] == r.owner[j] && r.index[j + n] == r.index[j] + n) ++n;
      const char* src = gathered + r.owner[j] * own + plane * plane_bytes + r.index[j] * row;
      DETDIT_RETURN_IF_ERROR(
          parallel_copy::copy(device, global + (plane * r.chunks + j) * row, src, n * row, stream));
      j += n;
    }
  }
  return Status();
}

TensorView global_partials(const ChunkReduction& r, const Device& device, int64_t plane = 0) {
  return TensorView::contiguous(r.global + plane * r.chunks * r.width, DType::kF32, {r.chunks, r.width}, device);
}

// What decides the collectives and the replicated bits, agreed by every rank.
std::string signature(const char* op, const SpPlan& sp, const TensorView& rows, const ResolvedModulation& mod,
                      const std::string& recipe, std::initializer_list<bool> gathered) {
  std::string s = std::string(op) + "(S=" + std::to_string(sp.seq_len()) + " B=" + std::to_string(sp.batch()) +
                  " world=" + std::to_string(sp.world()) + ", " + dtype_name(rows.dtype) +
                  ", H=" + std::to_string(rows.rank > 0 ? hidden_of(rows) : 0) + ", " +
                  modulation_form_name(mod.form) +
                  // per token F is this rank's S_local: the call's F is S on every rank
                  " F=" + std::to_string(mod.form == ModulationForm::kPerToken ? sp.seq_len() : mod.frames) + " " +
                  dtype_name(mod.dtype) +
                  ", " + recipe + ", gathers";
  for (bool g : gathered) s += g ? " 1" : " 0";
  return s + ")";
}

std::string bits(float k) {
  uint32_t u;
  std::memcpy(&u, &k, sizeof u);
  return std::to_string(u);
}

// ---------------------------------------------------------------- rmsnorm

struct FormsNorm {
  RmsnormBackwardParams p;
  ResolvedModulation mod;
  std::vector<Piece> pieces;          // per frame: the rows half's pieces
  rowwise::RmsnormPartials token;     // per token: the local d_shift / d_scale partials
  ChunkReduction weight, table;       // d_weight; per sample / per frame [d_shift | d_scale]
};

Status validate_norm(const SpPlan& sp, const RmsnormBackwardParams& p, FormsNorm* n) {
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, p.in.x, "x"));
  DETDIT_RETURN_IF_ERROR(resolve_form(sp, p.in.x, "x", {{&p.in.shift, "shift"}, {&p.in.scale, "scale"}}, &n->mod));
  if (n->mod.form != ModulationForm::kPerFrame) return rowwise::validate_rmsnorm_backward(p, rowwise::Forms::kAll);
  n->pieces = frame_pieces(sp, n->mod);
  for (const Piece& pc : n->pieces) {
    RmsnormBackwardParams q = piece_of(p, n->mod, pc);
    q.d_weight = p.d_weight;
    DETDIT_RETURN_IF_ERROR(rowwise::validate_rmsnorm_backward(q, rowwise::Forms::kAll));
  }
  if (p.d_shift.present())
    DETDIT_RETURN_IF_ERROR(check_modulation_grad(p.d_shift, "d_shift", p.in.shift, "shift", n->mod));
  if (p.d_scale.present())
    DETDIT_RETURN_IF_ERROR(check_modulation_grad(p.d_scale, "d_scale", p.in.scale, "scale", n->mod));
  return rowwise::check_outputs_disjoint(
      {{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.shift, "shift"}, {&p.in.scale, "scale"}, {&p.rstd, "rstd"},
       {&p.grad, "grad"}},
      {{&p.dx, "dx"}, {&p.d_weight, "d_weight"}, {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
}

Status prepare_norm(const SpPlan& sp, FormsNorm* n, Stream stream) {
  const RmsnormBackwardParams& p = n->p;
  const Device device = p.in.x.device;
  const int64_t hidden = hidden_of(p.in.x);
  const std::size_t x_row = static_cast<std::size_t>(hidden) * elem(p.in.x);
  const std::size_t grad_row = static_cast<std::size_t>(hidden) * elem(p.grad);
  const bool tables = p.d_shift.present() || p.d_scale.present();
  if (n->mod.form == ModulationForm::kPerToken && tables) {
    RmsnormBackwardParams local = p;
    local.d_weight = TensorView();
    DETDIT_RETURN_IF_ERROR(rowwise::allocate_rmsnorm_partials(local, stream, &n->token));
  }
  if (p.d_weight.present()) {
    plan_weight(sp, &n->weight);
    std::vector<std::size_t> exchanged = {x_row, grad_row, sizeof(float)}, filled;
    // the scale of each position beside its row: exchanged (per token) or copied (replicated)
    const std::size_t scale_row = static_cast<std::size_t>(hidden) * dtype_size(n->mod.dtype);
    if (n->mod.form == ModulationForm::kPerToken) exchanged.push_back(scale_row);
    else if (n->mod.form != ModulationForm::kNone) filled.push_back(scale_row);
    DETDIT_RETURN_IF_ERROR(allocate_reduction(sp, device, exchanged, filled, hidden, stream, &n->weight));
  }
  if (tables && (n->mod.form == ModulationForm::kPerSample || n->mod.form == ModulationForm::kPerFrame)) {
    plan_groups(sp, n->mod, &n->table);
    DETDIT_RETURN_IF_ERROR(
        allocate_reduction(sp, device, {x_row, grad_row, sizeof(float)}, {}, 2 * hidden, stream, &n->table));
  }
  return Status();
}

// d_weight's chunk partials on this rank's chunk rows: a plain norm of the
// (rows, H) chunk rows, or a per-token modulated one of (1, rows, H).
Status norm_weight(Communicator& comm, FormsNorm& n, Stream stream) {
  ChunkReduction& r = n.weight;
  const RmsnormBackwardParams& p = n.p;
  const Device device = p.in.x.device;
  const int64_t hidden = hidden_of(p.in.x), rows = r.owned_rows();
  std::vector<const void*> own = {p.in.x.data, p.grad.data, p.rstd.data};
  if (n.mod.form == ModulationForm::kPerToken) own.push_back(p.in.scale.data);
  DETDIT_RETURN_IF_ERROR(gather_chunk_rows(comm, r, device, p.in.x.dtype, own, stream));
  const bool modulated = n.mod.form != ModulationForm::kNone;
  if (modulated && n.mod.form != ModulationForm::kPerToken)
    DETDIT_RETURN_IF_ERROR(fill_modulation_rows(r, 3, p.in.scale, n.mod, device, stream));
  if (rows > 0) {
    RmsnormBackwardParams w = p;
    w.in.plan = IndexPlan();
    w.in.x = TensorView::contiguous(r.fields[0], p.in.x.dtype, {1, rows, hidden}, device);
    w.grad = TensorView::contiguous(r.fields[1], p.grad.dtype, {1, rows, hidden}, device);
    w.rstd = TensorView::contiguous(r.fields[2], DType::kF32, {rows}, device);
    w.in.shift = w.in.scale =
        modulated ? TensorView::contiguous(r.fields[3], n.mod.dtype, {1, rows, hidden}, device) : TensorView();
    w.dx = w.d_weight = w.d_shift = w.d_scale = TensorView();
    const TensorView partials = TensorView::contiguous(r.partials, DType::kF32, {r.max_owned, hidden}, device)
                                    .narrow(0, 0, r.owned_full + r.owned_short);
    DETDIT_RETURN_IF_ERROR(
        backend::rmsnorm_backward_partials(device, w, ChunkSelection{}, ExtraRows{}, partials, TensorView(), stream));
  }
  return gather_partials(comm, r, device, stream);
}

// The [d_shift | d_scale] chunk partials of a per-sample or per-frame form:
// the full chunks' rows as (k, 256, H), the short ones' as (k, r, H).
Status norm_table(Communicator& comm, FormsNorm& n, Stream stream) {
  ChunkReduction& r = n.table;
  const RmsnormBackwardParams& p = n.p;
  const Device device = p.in.x.device;
  const int64_t hidden = hidden_of(p.in.x);
  DETDIT_RETURN_IF_ERROR(
      gather_chunk_rows(comm, r, device, p.in.x.dtype, {p.in.x.data, p.grad.data, p.rstd.data}, stream));
  for (bool short_chunks : {false, true}) {
    const int64_t k = short_chunks ? r.owned_short : r.owned_full;
    if (k == 0) continue;
    RmsnormBackwardParams t = p;
    t.in.x = chunk_rows(r, 0, short_chunks, p.in.x.dtype, hidden, device);
    t.grad = chunk_rows(r, 1, short_chunks, p.grad.dtype, hidden, device);
    t.rstd = chunk_rows(r, 2, short_chunks, DType::kF32, 0, device);
    t.in.shift = repeated_mod(p.in.shift, k);
    t.in.scale = repeated_mod(p.in.scale, k);
    t.dx = t.d_weight = t.d_shift = t.d_scale = TensorView();
    DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_partials(device, t, ChunkSelection{}, ExtraRows{}, TensorView(),
                                                              own_partials(r, short_chunks, device), stream));
  }
  return gather_partials(comm, r, device, stream);
}

Status run_norm(Communicator& comm, FormsNorm& n, Stream stream) {
  const RmsnormBackwardParams& p = n.p;
  const Device device = p.in.x.device;
  if (n.weight.on) DETDIT_RETURN_IF_ERROR(norm_weight(comm, n, stream));
  if (n.table.on) DETDIT_RETURN_IF_ERROR(norm_table(comm, n, stream));
  // Every collective has run: the outputs.
  if (n.token.table.present()) {
    RmsnormBackwardParams local = p;
    local.d_weight = TensorView();
    DETDIT_RETURN_IF_ERROR(rowwise::rmsnorm_rows_and_partials(local, n.token, stream));
    DETDIT_RETURN_IF_ERROR(rowwise::fold_rmsnorm_partials(local, TensorView(), n.token.table, stream));
  } else if (p.dx.present()) {
    if (n.mod.form == ModulationForm::kPerFrame) {
      for (const Piece& pc : n.pieces)
        DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_rows(device, piece_of(p, n.mod, pc), stream));
    } else {
      DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_rows(device, p, stream));
    }
  }
  if (n.weight.on)
    DETDIT_RETURN_IF_ERROR(backend::fold_chunk_partials(device, global_partials(n.weight, device), p.d_weight, stream));
  if (n.table.on)
    DETDIT_RETURN_IF_ERROR(rowwise::fold_modulation_partials(IndexPlan(), n.mod, global_partials(n.table, device),
                                                             p.d_shift, p.d_scale, stream));
  return Status();
}

// ---------------------------------------------------------------- gate_residual

struct FormsGate {
  GateResidualBackwardParams p;
  ResolvedModulation mod;
  std::vector<Piece> pieces;
  rowwise::GatePartials token;  // per token: the local d_gate partials
  ChunkReduction table;         // per sample / per frame d_gate
};

Status validate_gate(const SpPlan& sp, const GateResidualBackwardParams& p, FormsGate* g) {
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, p.in.y, "y"));
  DETDIT_RETURN_IF_ERROR(resolve_form(sp, p.in.y, "y", {{&p.in.gate, "gate"}}, &g->mod));
  if (g->mod.form != ModulationForm::kPerFrame)
    return rowwise::validate_gate_residual_backward(p, rowwise::Forms::kAll);
  g->pieces = frame_pieces(sp, g->mod);
  for (const Piece& pc : g->pieces)
    DETDIT_RETURN_IF_ERROR(rowwise::validate_gate_residual_backward(piece_of(p, g->mod, pc), rowwise::Forms::kAll));
  if (p.d_gate.present()) DETDIT_RETURN_IF_ERROR(check_modulation_grad(p.d_gate, "d_gate", p.in.gate, "gate", g->mod));
  return rowwise::check_outputs_disjoint({{&p.grad, "grad"}, {&p.in.y, "y"}, {&p.in.gate, "gate"}},
                                         {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}});
}

Status prepare_gate(const SpPlan& sp, FormsGate* g, Stream stream) {
  const GateResidualBackwardParams& p = g->p;
  if (!p.d_gate.present()) return Status();
  if (g->mod.form == ModulationForm::kPerToken) return rowwise::allocate_gate_partials(p, stream, &g->token);
  const int64_t hidden = hidden_of(p.grad);
  plan_groups(sp, g->mod, &g->table);
  return allocate_reduction(
      sp, p.grad.device,
      {static_cast<std::size_t>(hidden) * elem(p.grad), static_cast<std::size_t>(hidden) * elem(p.in.y)}, {}, hidden,
      stream, &g->table);
}

Status run_gate(Communicator& comm, FormsGate& g, Stream stream) {
  const GateResidualBackwardParams& p = g.p;
  const Device device = p.grad.device;
  ChunkReduction& r = g.table;
  if (r.on) {
    const int64_t hidden = hidden_of(p.grad);
    DETDIT_RETURN_IF_ERROR(gather_chunk_rows(comm, r, device, p.grad.dtype, {p.grad.data, p.in.y.data}, stream));
    for (bool short_chunks : {false, true}) {
      const int64_t k = short_chunks ? r.owned_short : r.owned_full;
      if (k == 0) continue;
      GateResidualBackwardParams t = p;
      t.grad = chunk_rows(r, 0, short_chunks, p.grad.dtype, hidden, device);
      t.in.y = chunk_rows(r, 1, short_chunks, p.in.y.dtype, hidden, device);
      t.in.residual = TensorView();
      t.in.gate = repeated_mod(p.in.gate, k);
      t.d_residual = t.d_y = t.d_gate = TensorView();
      DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_partials(device, t, ChunkSelection{}, ExtraRows{},
                                                                      own_partials(r, short_chunks, device), stream));
    }
    DETDIT_RETURN_IF_ERROR(gather_partials(comm, r, device, stream));
  }
  // Every collective has run: the outputs.
  if (g.token.gate.present()) {
    DETDIT_RETURN_IF_ERROR(rowwise::gate_rows_and_partials(p, g.token, stream));
    return rowwise::fold_gate_partials(p, g.token, stream);
  }
  if (g.mod.form == ModulationForm::kPerFrame) {
    for (const Piece& pc : g.pieces)
      DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_rows(device, piece_of(p, g.mod, pc), stream));
  } else {
    DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_rows(device, p, stream));
  }
  if (!r.on) return Status();
  return backend::fold_group_partials(device, global_partials(r, device), rowwise::chunks_per_group(g.mod), g.mod,
                                      p.d_gate, stream);
}


// ---------------------------------------------------------------- layernorm

struct FormsLayernorm {
  LayernormBackwardParams p;
  ResolvedModulation mod;
  std::vector<Piece> pieces;
  std::shared_ptr<void> token_memory;  // per token: the local d_shift / d_scale partials
  TensorView token;
  ChunkReduction params, table;  // d_weight and d_bias (one plane each); per sample / per frame [d_shift | d_scale]
};

Status validate_layernorm(const SpPlan& sp, const LayernormBackwardParams& p, FormsLayernorm* n) {
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, p.in.x, "x"));
  DETDIT_RETURN_IF_ERROR(resolve_form(sp, p.in.x, "x", {{&p.in.shift, "shift"}, {&p.in.scale, "scale"}}, &n->mod));
  if (n->mod.form != ModulationForm::kPerFrame) return rowwise::validate_layernorm_backward(p);
  n->pieces = frame_pieces(sp, n->mod);
  for (const Piece& pc : n->pieces) {
    LayernormBackwardParams q = piece_of(p, n->mod, pc);
    q.d_weight = p.d_weight;
    q.d_bias = p.d_bias;
    DETDIT_RETURN_IF_ERROR(rowwise::validate_layernorm_backward(q));
  }
  if (p.d_shift.present())
    DETDIT_RETURN_IF_ERROR(check_modulation_grad(p.d_shift, "d_shift", p.in.shift, "shift", n->mod));
  if (p.d_scale.present())
    DETDIT_RETURN_IF_ERROR(check_modulation_grad(p.d_scale, "d_scale", p.in.scale, "scale", n->mod));
  return rowwise::check_outputs_disjoint(
      {{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.bias, "bias"}, {&p.in.shift, "shift"},
       {&p.in.scale, "scale"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}, {&p.grad, "grad"}},
      {{&p.dx, "dx"}, {&p.d_weight, "d_weight"}, {&p.d_bias, "d_bias"}, {&p.d_shift, "d_shift"},
       {&p.d_scale, "d_scale"}});
}

Status prepare_layernorm(const SpPlan& sp, FormsLayernorm* n, Stream stream) {
  const LayernormBackwardParams& p = n->p;
  const Device device = p.in.x.device;
  const int64_t hidden = hidden_of(p.in.x);
  const std::size_t x_row = static_cast<std::size_t>(hidden) * elem(p.in.x);
  const std::size_t grad_row = static_cast<std::size_t>(hidden) * elem(p.grad);
  const bool tables = p.d_shift.present() || p.d_scale.present();
  if (n->mod.form == ModulationForm::kPerToken && tables)
    DETDIT_RETURN_IF_ERROR(
        scratch_tensor(device, DType::kF32,
                       {rowwise::table_partial_rows(IndexPlan(), rowwise::layernorm_modulation(p.in)), 2 * hidden},
                       stream, &n->token_memory, &n->token));
  const int64_t planes = (p.d_weight.present() ? 1 : 0) + (p.d_bias.present() ? 1 : 0);
  if (planes > 0) {
    plan_weight(sp, &n->params);
    std::vector<std::size_t> exchanged = {x_row, grad_row, sizeof(float), sizeof(float)}, filled;
    const std::size_t scale_row = static_cast<std::size_t>(hidden) * dtype_size(n->mod.dtype);
    if (n->mod.form == ModulationForm::kPerToken) exchanged.push_back(scale_row);
    else if (n->mod.form != ModulationForm::kNone) filled.push_back(scale_row);
    DETDIT_RETURN_IF_ERROR(allocate_reduction(sp, device, exchanged, filled, hidden, stream, &n->params, planes));
  }
  if (tables && (n->mod.form == ModulationForm::kPerSample || n->mod.form == ModulationForm::kPerFrame)) {
    plan_groups(sp, n->mod, &n->table);
    DETDIT_RETURN_IF_ERROR(allocate_reduction(sp, device, {x_row, grad_row, sizeof(float), sizeof(float)}, {},
                                              2 * hidden, stream, &n->table));
  }
  return Status();
}

// d_weight's and d_bias's chunk partials on this rank's chunk rows (as rmsnorm's d_weight).
Status layernorm_params(Communicator& comm, FormsLayernorm& n, Stream stream) {
  ChunkReduction& r = n.params;
  const LayernormBackwardParams& p = n.p;
  const Device device = p.in.x.device;
  const int64_t hidden = hidden_of(p.in.x), rows = r.owned_rows();
  std::vector<const void*> own = {p.in.x.data, p.grad.data, p.mean.data, p.rstd.data};
  if (n.mod.form == ModulationForm::kPerToken) own.push_back(p.in.scale.data);
  DETDIT_RETURN_IF_ERROR(gather_chunk_rows(comm, r, device, p.in.x.dtype, own, stream));
  const bool modulated = n.mod.form != ModulationForm::kNone;
  if (modulated && n.mod.form != ModulationForm::kPerToken)
    DETDIT_RETURN_IF_ERROR(fill_modulation_rows(r, 4, p.in.scale, n.mod, device, stream));
  if (rows > 0) {
    LayernormBackwardParams w = p;
    w.in.plan = IndexPlan();
    w.in.x = TensorView::contiguous(r.fields[0], p.in.x.dtype, {1, rows, hidden}, device);
    w.grad = TensorView::contiguous(r.fields[1], p.grad.dtype, {1, rows, hidden}, device);
    w.mean = TensorView::contiguous(r.fields[2], DType::kF32, {rows}, device);
    w.rstd = TensorView::contiguous(r.fields[3], DType::kF32, {rows}, device);
    w.in.shift = w.in.scale =
        modulated ? TensorView::contiguous(r.fields[4], n.mod.dtype, {1, rows, hidden}, device) : TensorView();
    w.dx = w.d_weight = w.d_bias = w.d_shift = w.d_scale = TensorView();
    LayernormPartials partials;
    int64_t plane = 0;
    if (p.d_weight.present()) partials.weight = own_partials(r, false, device, plane++, true);
    if (p.d_bias.present()) partials.bias = own_partials(r, false, device, plane++, true);
    DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_partials(device, w, partials, stream));
  }
  return gather_partials(comm, r, device, stream);
}

Status layernorm_table(Communicator& comm, FormsLayernorm& n, Stream stream) {
  ChunkReduction& r = n.table;
  const LayernormBackwardParams& p = n.p;
  const Device device = p.in.x.device;
  const int64_t hidden = hidden_of(p.in.x);
  DETDIT_RETURN_IF_ERROR(gather_chunk_rows(comm, r, device, p.in.x.dtype,
                                           {p.in.x.data, p.grad.data, p.mean.data, p.rstd.data}, stream));
  for (bool short_chunks : {false, true}) {
    const int64_t k = short_chunks ? r.owned_short : r.owned_full;
    if (k == 0) continue;
    LayernormBackwardParams t = p;
    t.in.x = chunk_rows(r, 0, short_chunks, p.in.x.dtype, hidden, device);
    t.grad = chunk_rows(r, 1, short_chunks, p.grad.dtype, hidden, device);
    t.mean = chunk_rows(r, 2, short_chunks, DType::kF32, 0, device);
    t.rstd = chunk_rows(r, 3, short_chunks, DType::kF32, 0, device);
    t.in.shift = repeated_mod(p.in.shift, k);
    t.in.scale = repeated_mod(p.in.scale, k);
    t.dx = t.d_weight = t.d_bias = t.d_shift = t.d_scale = TensorView();
    LayernormPartials partials;
    partials.table = own_partials(r, short_chunks, device);
    DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_partials(device, t, partials, stream));
  }
  return gather_partials(comm, r, device, stream);
}

Status run_layernorm(Communicator& comm, FormsLayernorm& n, Stream stream) {
  const LayernormBackwardParams& p = n.p;
  const Device device = p.in.x.device;
  if (n.params.on) DETDIT_RETURN_IF_ERROR(layernorm_params(comm, n, stream));
  if (n.table.on) DETDIT_RETURN_IF_ERROR(layernorm_table(comm, n, stream));
  // Every collective has run: the outputs.
  if (n.mod.form == ModulationForm::kPerFrame) {
    for (const Piece& pc : n.pieces)
      DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_rows(device, piece_of(p, n.mod, pc), stream));
  } else {
    DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_rows(device, p, stream));
  }
  if (n.token.present()) {
    LayernormPartials partials;
    partials.table = n.token;
    DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_partials(device, p, partials, stream));
    DETDIT_RETURN_IF_ERROR(rowwise::fold_modulation_partials(IndexPlan(), rowwise::layernorm_modulation(p.in), n.token,
                                                             p.d_shift, p.d_scale, stream));
  }
  int64_t plane = 0;
  if (p.d_weight.present())
    DETDIT_RETURN_IF_ERROR(
        backend::fold_chunk_partials(device, global_partials(n.params, device, plane++), p.d_weight, stream));
  if (p.d_bias.present())
    DETDIT_RETURN_IF_ERROR(
        backend::fold_chunk_partials(device, global_partials(n.params, device, plane++), p.d_bias, stream));
  if (n.table.on)
    DETDIT_RETURN_IF_ERROR(rowwise::fold_modulation_partials(IndexPlan(), n.mod, global_partials(n.table, device),
                                                             p.d_shift, p.d_scale, stream));
  return Status();
}


// ---------------------------------------------------------------- layernorm, indexed

// The indexed form: the SpPlan's chunks (canonical, owner = holder of the
// first position), their rows gathered as d_weight's, and the WS1 partials
// on the plan of this rank's own chunks (SpPlan::Impl::owned: its segments
// are those chunks' segments, in order); the segment partials gathered into
// global segment order and folded by the WS1 segment fold.
struct IndexedLayernorm {
  LayernormBackwardParams p, local;  // the call on the global plan; on the local plan (the rows half)
  ChunkReduction rows;               // the chunks' rows; d_weight and d_bias planes
  ChunkReduction segments;           // [d_shift | d_scale] segment partials (no rows of their own)
  bool tables = false;
};

// The reductions of the indexed form: the SpPlan's chunks' rows (`fields`
// bytes per row) with `planes` chunk partials of H floats, and, with
// `table_width` > 0, the segment partials of table_width floats. Nothing
// when neither is asked for.
Status prepare_indexed_reductions(const SpPlan& sp, const Device& device, std::vector<std::size_t> fields,
                                  int64_t hidden, int64_t planes, int64_t table_width, Stream stream,
                                  ChunkReduction* rows, ChunkReduction* segments) {
  if (planes == 0 && table_width == 0) return Status();
  const SpPlan::Impl& plan = sp.impl();
  plan_weight(sp, rows);
  DETDIT_RETURN_IF_ERROR(allocate_reduction(sp, device, std::move(fields), {}, hidden, stream, rows, planes));
  if (table_width == 0) return Status();
  // Segment g of chunk c: owner = c's, index = its place among the owner's segments.
  ChunkReduction& r = *segments;
  const PlanTables& tables = plan.global.host_tables();
  r.on = true;
  r.chunks = plan.global.num_segments();
  r.owner.assign(static_cast<std::size_t>(r.chunks), 0);
  r.index.assign(static_cast<std::size_t>(r.chunks), 0);
  std::vector<int64_t> next(static_cast<std::size_t>(sp.world()), 0);
  for (int64_t c = 0; c < plan.global.num_chunks(); ++c) {
    const int32_t q = rows->owner[c];
    for (int32_t g = tables.chunk_segment_begin[c]; g < tables.chunk_segment_begin[c + 1]; ++g) {
      r.owner[g] = q;
      r.index[g] = next[q]++;
    }
  }
  r.max_owned = plan.max_segments;
  return allocate_reduction(sp, device, {}, {}, table_width, stream, &r);
}

// This rank's segment partials (its chunks' segments, in order).
TensorView own_segment_partials(const SpPlan& sp, const ChunkReduction& segments, const Device& device) {
  const SpPlan::Impl& plan = sp.impl();
  return TensorView::contiguous(segments.partials, DType::kF32, {plan.traffic[plan.rank].segments, segments.width},
                                device);
}

// The agreed signature's index part: the plan's fingerprint and R.
std::string index_signature(const SpPlan& sp) {
  char index[64] = "no plan";
  if (sp.valid() && sp.global_plan().valid())
    std::snprintf(index, sizeof index, "index %016llx R=%lld",
                  static_cast<unsigned long long>(sp.global_plan().fingerprint()),
                  static_cast<long long>(sp.global_plan().num_rows()));
  return index;
}

Status prepare_indexed(const SpPlan& sp, IndexedLayernorm* n, Stream stream) {
  const LayernormBackwardParams& p = n->p;
  const int64_t hidden = hidden_of(p.in.x);
  n->tables = p.d_shift.present() || p.d_scale.present();
  const int64_t planes = (p.d_weight.present() ? 1 : 0) + (p.d_bias.present() ? 1 : 0);
  return prepare_indexed_reductions(sp, p.in.x.device,
                                    {static_cast<std::size_t>(hidden) * elem(p.in.x),
                                     static_cast<std::size_t>(hidden) * elem(p.grad), sizeof(float), sizeof(float)},
                                    hidden, planes, n->tables ? 2 * hidden : 0, stream, &n->rows, &n->segments);
}

Status run_indexed(Communicator& comm, const SpPlan& sp, IndexedLayernorm& n, Stream stream) {
  const LayernormBackwardParams& p = n.p;
  const SpPlan::Impl& plan = sp.impl();
  const Device device = p.in.x.device;
  const int64_t hidden = hidden_of(p.in.x);
  ChunkReduction& r = n.rows;
  if (r.on) {
    DETDIT_RETURN_IF_ERROR(gather_chunk_rows(comm, r, device, p.in.x.dtype,
                                             {p.in.x.data, p.grad.data, p.mean.data, p.rstd.data}, stream));
    const int64_t rows = r.owned_rows();
    if (rows > 0) {
      LayernormBackwardParams w = p;
      w.in.plan = plan.owned;
      w.in.x = TensorView::contiguous(r.fields[0], p.in.x.dtype, {rows, hidden}, device);
      w.grad = TensorView::contiguous(r.fields[1], p.grad.dtype, {rows, hidden}, device);
      w.mean = TensorView::contiguous(r.fields[2], DType::kF32, {rows}, device);
      w.rstd = TensorView::contiguous(r.fields[3], DType::kF32, {rows}, device);
      w.dx = w.d_weight = w.d_bias = w.d_shift = w.d_scale = TensorView();
      LayernormPartials partials;
      int64_t plane = 0;
      if (p.d_weight.present()) partials.weight = own_partials(r, false, device, plane++, true);
      if (p.d_bias.present()) partials.bias = own_partials(r, false, device, plane++, true);
      if (n.tables) partials.table = own_segment_partials(sp, n.segments, device);
      DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_partials(device, w, partials, stream));
    }
    if (r.planes > 0) DETDIT_RETURN_IF_ERROR(gather_partials(comm, r, device, stream));
    if (n.tables) DETDIT_RETURN_IF_ERROR(gather_partials(comm, n.segments, device, stream));
  }
  // Every collective has run: the outputs.
  DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_rows(device, n.local, stream));
  int64_t plane = 0;
  if (p.d_weight.present())
    DETDIT_RETURN_IF_ERROR(
        backend::fold_chunk_partials(device, global_partials(r, device, plane++), p.d_weight, stream));
  if (p.d_bias.present())
    DETDIT_RETURN_IF_ERROR(backend::fold_chunk_partials(device, global_partials(r, device, plane++), p.d_bias, stream));
  if (!n.tables) return Status();
  return rowwise::fold_modulation_partials(plan.global, rowwise::layernorm_modulation(p.in),
                                           global_partials(n.segments, device), p.d_shift, p.d_scale, stream);
}

Status indexed_layernorm_backward(Communicator& comm, const SpPlan& sp, const LayernormBackwardParams& params,
                                  Stream stream) {
  IndexedLayernorm n;
  n.p = n.local = params;
  Status valid = check_comm(comm, sp);
  if (valid.ok()) valid = check_global_plan(sp, params.in.plan, true);
  if (valid.ok()) valid = check_local_rows(sp, params.in.x, "x");
  if (valid.ok()) {
    n.local.in.plan = sp.local_plan();
    valid = rowwise::validate_layernorm_backward(n.local);
  }
  if (valid.ok()) valid = prepare_indexed(sp, &n, stream);
  const std::string index = index_signature(sp);
  ResolvedModulation mod;
  mod.form = params.in.shift.present() ? ModulationForm::kIndexed : ModulationForm::kNone;
  mod.dtype = params.in.shift.present() ? params.in.shift.dtype : params.in.x.dtype;
  const std::string recipe = index + ", " + numerics_name(params.in.numerics) +
                             (params.in.upcast ? " upcast" : "") + (params.in.weight.present() ? " weight" : "") +
                             (params.in.bias.present() ? " bias" : "");
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, signature("sp_layernorm_backward", sp, params.in.x, mod, recipe,
                                                     {params.d_weight.present(), params.d_bias.present(), n.tables})));
  return run_indexed(comm, sp, n, stream);
}

// ---------------------------------------------------------------- rmsnorm and gate_residual, indexed recipes

// The indexed form beyond the H3 rule (an fp32 table, upcast, the gate's k):
// layernorm's indexed steps, the WS1 partials halves on the plan of the
// rank's own chunks (their chunk selections take the H3 rule only on CUDA).
struct IndexedNorm {
  RmsnormBackwardParams p, local;  // the call on the global plan; on the local plan (the rows half)
  ChunkReduction rows, segments;
  bool tables = false;
};

// The reductions of a validated call (n->p, n->local set).
Status prepare_indexed_norm(const SpPlan& sp, IndexedNorm* n, Stream stream) {
  const RmsnormBackwardParams& p = n->p;
  const int64_t hidden = hidden_of(p.in.x);
  n->tables = (p.in.shift.present() || p.in.scale.present()) && (p.d_shift.present() || p.d_scale.present());
  return prepare_indexed_reductions(sp, p.in.x.device,
                                    {static_cast<std::size_t>(hidden) * elem(p.in.x),
                                     static_cast<std::size_t>(hidden) * elem(p.grad), sizeof(float)},
                                    hidden, p.d_weight.present() ? 1 : 0, n->tables ? 2 * hidden : 0, stream, &n->rows,
                                    &n->segments);
}

// The agreed signature's form of an indexed call: indexed when modulated, in the table's dtype.
ResolvedModulation indexed_form(const TensorView& table, const TensorView& rows) {
  ResolvedModulation mod;
  mod.form = table.present() ? ModulationForm::kIndexed : ModulationForm::kNone;
  mod.dtype = table.present() ? table.dtype : rows.dtype;
  return mod;
}

// After the agreement: the exchanges, then the outputs.
Status run_indexed_norm(Communicator& comm, const SpPlan& sp, IndexedNorm& n, Stream stream) {
  const RmsnormBackwardParams& p = n.p;
  const SpPlan::Impl& plan = sp.impl();
  const Device device = p.in.x.device;
  const int64_t hidden = hidden_of(p.in.x);
  ChunkReduction& r = n.rows;
  if (r.on) {
    DETDIT_RETURN_IF_ERROR(
        gather_chunk_rows(comm, r, device, p.in.x.dtype, {p.in.x.data, p.grad.data, p.rstd.data}, stream));
    const int64_t rows = r.owned_rows();
    if (rows > 0) {
      RmsnormBackwardParams w = p;
      w.in.plan = plan.owned;
      w.in.x = TensorView::contiguous(r.fields[0], p.in.x.dtype, {rows, hidden}, device);
      w.grad = TensorView::contiguous(r.fields[1], p.grad.dtype, {rows, hidden}, device);
      w.rstd = TensorView::contiguous(r.fields[2], DType::kF32, {rows}, device);
      w.dx = w.d_weight = w.d_shift = w.d_scale = TensorView();
      const TensorView weight = p.d_weight.present() ? own_partials(r, false, device, 0, true) : TensorView();
      const TensorView table = n.tables ? own_segment_partials(sp, n.segments, device) : TensorView();
      DETDIT_RETURN_IF_ERROR(
          backend::rmsnorm_backward_partials(device, w, ChunkSelection{}, ExtraRows{}, weight, table, stream));
    }
    if (r.planes > 0) DETDIT_RETURN_IF_ERROR(gather_partials(comm, r, device, stream));
    if (n.tables) DETDIT_RETURN_IF_ERROR(gather_partials(comm, n.segments, device, stream));
  }
  // Every collective has run: the outputs.
  DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_rows(device, n.local, stream));
  if (p.d_weight.present())
    DETDIT_RETURN_IF_ERROR(backend::fold_chunk_partials(device, global_partials(r, device), p.d_weight, stream));
  if (!n.tables) return Status();
  return rowwise::fold_modulation_partials(plan.global, rowwise::rmsnorm_modulation(p.in),
                                           global_partials(n.segments, device), p.d_shift, p.d_scale, stream);
}

Status indexed_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params,
                                Stream stream) {
  IndexedNorm n;
  n.p = n.local = params;
  Status valid = check_comm(comm, sp);
  if (valid.ok()) valid = check_global_plan(sp, params.in.plan, true);
  if (valid.ok()) valid = check_local_rows(sp, params.in.x, "x");
  if (valid.ok()) {
    n.local.in.plan = sp.local_plan();
    valid = rowwise::validate_rmsnorm_backward(n.local, rowwise::Forms::kAll);
  }
  if (valid.ok()) valid = prepare_indexed_norm(sp, &n, stream);
  const bool modulated = params.in.shift.present() || params.in.scale.present();
  const bool tables = modulated && (params.d_shift.present() || params.d_scale.present());
  const std::string recipe = index_signature(sp) + ", " + numerics_name(params.in.numerics) +
                             (params.in.upcast ? " upcast" : "");
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, signature("sp_rmsnorm_backward", sp, params.in.x,
                                                     indexed_form(params.in.shift, params.in.x), recipe,
                                                     {params.d_weight.present(), tables})));
  return run_indexed_norm(comm, sp, n, stream);
}

struct IndexedGate {
  GateResidualBackwardParams p, local;  // the call on the global plan; on the local plan (the rows half)
  ChunkReduction rows, segments;
};

// The reductions of a validated call (g->p, g->local set).
Status prepare_indexed_gate(const SpPlan& sp, IndexedGate* g, Stream stream) {
  const GateResidualBackwardParams& p = g->p;
  if (!p.d_gate.present()) return Status();
  const int64_t hidden = hidden_of(p.grad);
  return prepare_indexed_reductions(
      sp, p.grad.device,
      {static_cast<std::size_t>(hidden) * elem(p.grad), static_cast<std::size_t>(hidden) * elem(p.in.y)}, hidden, 0,
      hidden, stream, &g->rows, &g->segments);
}

// After the agreement: the exchanges, then the outputs.
Status run_indexed_gate(Communicator& comm, const SpPlan& sp, IndexedGate& g, Stream stream) {
  const GateResidualBackwardParams& p = g.p;
  const SpPlan::Impl& plan = sp.impl();
  const Device device = p.grad.device;
  ChunkReduction& rows = g.rows;
  if (rows.on) {
    const int64_t hidden = hidden_of(p.grad);
    DETDIT_RETURN_IF_ERROR(
        gather_chunk_rows(comm, rows, device, p.grad.dtype, {p.grad.data, p.in.y.data}, stream));
    const int64_t count = rows.owned_rows();
    if (count > 0) {
      GateResidualBackwardParams t = p;
      t.in.plan = plan.owned;
      t.grad = TensorView::contiguous(rows.fields[0], p.grad.dtype, {count, hidden}, device);
      t.in.y = TensorView::contiguous(rows.fields[1], p.in.y.dtype, {count, hidden}, device);
      t.in.residual = TensorView();
      t.d_residual = t.d_y = t.d_gate = TensorView();
      DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_partials(
          device, t, ChunkSelection{}, ExtraRows{}, own_segment_partials(sp, g.segments, device), stream));
    }
    DETDIT_RETURN_IF_ERROR(gather_partials(comm, g.segments, device, stream));
  }
  // Every collective has run: the outputs.
  DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_rows(device, g.local, stream));
  if (!p.d_gate.present()) return Status();
  return backend::fold_segment_partials(device, plan.global, global_partials(g.segments, device), p.d_gate, stream);
}

Status indexed_gate_residual_backward(Communicator& comm, const SpPlan& sp, const GateResidualBackwardParams& params,
                                      Stream stream) {
  IndexedGate g;
  g.p = g.local = params;
  Status valid = check_comm(comm, sp);
  if (valid.ok()) valid = check_global_plan(sp, params.in.plan, true);
  if (valid.ok()) valid = check_local_rows(sp, params.grad, "grad");
  if (valid.ok()) {
    g.local.in.plan = sp.local_plan();
    valid = rowwise::validate_gate_residual_backward(g.local, rowwise::Forms::kAll);
  }
  if (valid.ok()) valid = prepare_indexed_gate(sp, &g, stream);
  const std::string recipe = index_signature(sp) + (params.in.upcast ? ", upcast" : ", each op") +
                             (params.in.has_k ? " k=" + bits(params.in.k) : "");
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, signature("sp_gate_residual_backward", sp, params.grad,
                                                     indexed_form(params.in.gate, params.in.y), recipe,
                                                     {params.d_gate.present()})));
  return run_indexed_gate(comm, sp, g, stream);
}

// ---------------------------------------------------------------- gate_residual_layernorm

GateResidualInputs gate_inputs(const GateResidualLayernormInputs& in) {
  return GateResidualInputs{in.residual, in.y, in.gate, in.plan, in.has_k, in.k, in.upcast};
}

LayernormInputs norm_inputs(const GateResidualLayernormInputs& in, const TensorView& h) {
  return LayernormInputs{h, in.weight, in.bias, in.shift, in.scale, in.plan, in.eps, in.numerics, in.upcast};
}

// The gate and the norm's shift and scale in one form (as the WS1 ops).
Status check_one_form(const TensorView& gate_tensor, const TensorView& shift, const ResolvedModulation& gate,
                      const ResolvedModulation& norm) {
  if (!gate_tensor.present() || !shift.present() || gate.form == norm.form) return Status();
  return Status::value_error(std::string("gate, shift and scale must have one modulation form, got gate ") +
                             gate_tensor.describe() + " (" + modulation_form_name(gate.form) + ") and shift " +
                             shift.describe() + " (" + modulation_form_name(norm.form) + ")");
}

// The grouped region of a fused forward (gate_residual then a norm of h):
// whether it runs in per-frame pieces, and the pieces.
struct FramedRegion {
  bool frames = false;        // the gate's or the norm's form is per frame
  ResolvedModulation mod;     // that per-frame form (with frames)
  std::vector<Piece> pieces;  // the local rows cut at frame bounds (with frames)
};

// The region's forms (GateResidualRmsnormInputs or GateResidualLayernormInputs,
// h the norm's rows): the gate's resolved on the residual rows, the norm's on
// h, each after its rows' check, then one form; per frame, the pieces both
// halves run on. The order of the checks is the order of their errors.
template <typename RegionInputs>
Status resolve_region(const SpPlan& sp, const RegionInputs& in, const TensorView& h, FramedRegion* region) {
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, in.residual, "residual"));
  ResolvedModulation gate, norm;
  DETDIT_RETURN_IF_ERROR(resolve_form(sp, in.residual, "residual", {{&in.gate, "gate"}}, &gate));
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, h, "h"));
  DETDIT_RETURN_IF_ERROR(resolve_form(sp, h, "h", {{&in.shift, "shift"}, {&in.scale, "scale"}}, &norm));
  DETDIT_RETURN_IF_ERROR(check_one_form(in.gate, in.shift, gate, norm));
  // either half per frame: its frames cut the rows of both halves
  region->frames = gate.form == ModulationForm::kPerFrame || norm.form == ModulationForm::kPerFrame;
  if (!region->frames) return Status();
  region->mod = gate.form == ModulationForm::kPerFrame ? gate : norm;
  region->pieces = frame_pieces(sp, region->mod);
  return Status();
}

// The region's backward checks before the agreement (both fused ops, the
// grouped forms), in the order of their errors: d_out, d_h like h, the norm
// half by `validate_half` (validate_norm or validate_layernorm, on n->p), the
// gate half `gate` with h standing for g (d_residual checked against y),
// then one form.
template <typename RegionParams, typename NormParams, typename NormForms>
Status validate_region_backward(const SpPlan& sp, const RegionParams& p, const GateResidualBackwardParams& gate,
                                Status (*validate_half)(const SpPlan&, const NormParams&, NormForms*), NormForms* n,
                                FormsGate* g) {
  DETDIT_RETURN_IF_ERROR(check::present(p.d_out, "d_out"));
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.d_h, "d_h", p.h, "h"));
  DETDIT_RETURN_IF_ERROR(validate_half(sp, n->p, n));
  GateResidualBackwardParams checked = gate;
  checked.d_residual = p.d_residual;
  DETDIT_RETURN_IF_ERROR(validate_gate(sp, checked, g));
  return check_one_form(p.in.gate, p.in.shift, g->mod, n->mod);
}

// g, the gradient of h (both fused backward ops, when the gate half runs):
// d_residual when it has h's dtype (the caller's g_in_d_residual), else
// scratch like h, held by *memory.
Status region_gradient(const TensorView& h, const TensorView& d_residual, bool g_in_d_residual, Stream stream,
                       std::shared_ptr<void>* memory, TensorView* g) {
  if (g_in_d_residual) {
    *g = d_residual;
    return Status();
  }
  *g = h;
  const Status allocated = allocate_scratch(h.device, h.nbytes(), stream, memory);
  g->data = memory->get();
  return allocated;
}

}  // namespace

bool h3_rule(const RmsnormInputs& in) {
  return !in.upcast && (!in.shift.present() || in.shift.dtype == in.x.dtype);
}

bool h3_rule(const GateResidualInputs& in) {
  return !in.upcast && !in.has_k && (!in.gate.present() || in.gate.dtype == in.y.dtype);
}

Status indexed_recipe_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params,
                                       Stream stream) {
  return indexed_rmsnorm_backward(comm, sp, params, stream);
}

Status indexed_recipe_gate_residual_backward(Communicator& comm, const SpPlan& sp,
                                             const GateResidualBackwardParams& params, Stream stream) {
  return indexed_gate_residual_backward(comm, sp, params, stream);
}

bool forms_call(const SpPlan& sp, const IndexPlan& call_plan, bool modulated) {
  return !call_plan.valid() && (modulated || (sp.valid() && !sp.global_plan().valid()));
}

Status forms_rmsnorm_forward(const SpPlan& sp, const RmsnormParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, params.in.x, "x"));
  ResolvedModulation mod;
  DETDIT_RETURN_IF_ERROR(
      resolve_form(sp, params.in.x, "x", {{&params.in.shift, "shift"}, {&params.in.scale, "scale"}}, &mod));
  if (mod.form != ModulationForm::kPerFrame) return rmsnorm_forward(params, stream);
  const std::vector<Piece> pieces = frame_pieces(sp, mod);
  for (const Piece& pc : pieces)
    DETDIT_RETURN_IF_ERROR(rowwise::validate_rmsnorm_forward(piece_of(params, mod, pc), rowwise::Forms::kAll));
  const RmsnormParams& p = params;
  DETDIT_RETURN_IF_ERROR(rowwise::check_outputs_disjoint(
      {{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.shift, "shift"}, {&p.in.scale, "scale"}},
      {{&p.out, "out"}, {&p.rstd, "rstd"}}));
  for (const Piece& pc : pieces)
    DETDIT_RETURN_IF_ERROR(backend::rmsnorm_forward(p.in.x.device, piece_of(params, mod, pc), stream));
  return Status();
}

Status forms_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params,
                              Stream stream) {
  FormsNorm n;
  n.p = params;
  Status valid = check_comm(comm, sp);
  if (valid.ok()) valid = validate_norm(sp, params, &n);
  if (valid.ok()) valid = prepare_norm(sp, &n, stream);
  const std::string recipe = std::string(numerics_name(params.in.numerics)) + (params.in.upcast ? " upcast" : "");
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, signature("sp_rmsnorm_backward", sp, params.in.x, n.mod, recipe,
                                                     {params.d_weight.present(), n.table.on})));
  return run_norm(comm, n, stream);
}

Status forms_gate_residual_forward(const SpPlan& sp, const GateResidualParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, params.in.residual, "residual"));
  ResolvedModulation mod;
  DETDIT_RETURN_IF_ERROR(resolve_form(sp, params.in.residual, "residual", {{&params.in.gate, "gate"}}, &mod));
  if (mod.form != ModulationForm::kPerFrame) return gate_residual_forward(params, stream);
  const std::vector<Piece> pieces = frame_pieces(sp, mod);
  for (const Piece& pc : pieces)
    DETDIT_RETURN_IF_ERROR(rowwise::validate_gate_residual_forward(piece_of(params, mod, pc), rowwise::Forms::kAll));
  const GateResidualParams& p = params;
  DETDIT_RETURN_IF_ERROR(rowwise::check_outputs_disjoint(
      {{&p.in.residual, "residual"}, {&p.in.y, "y"}, {&p.in.gate, "gate"}}, {{&p.out, "out"}}));
  for (const Piece& pc : pieces)
    DETDIT_RETURN_IF_ERROR(backend::gate_residual_forward(p.in.residual.device, piece_of(params, mod, pc), stream));
  return Status();
}

Status forms_gate_residual_backward(Communicator& comm, const SpPlan& sp, const GateResidualBackwardParams& params,
                                    Stream stream) {
  FormsGate g;
  g.p = params;
  Status valid = check_comm(comm, sp);
  if (valid.ok()) valid = validate_gate(sp, params, &g);
  if (valid.ok()) valid = prepare_gate(sp, &g, stream);
  const std::string recipe = std::string(params.in.upcast ? "upcast" : "each op") +
                             (params.in.has_k ? " k=" + bits(params.in.k) : "");
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, signature("sp_gate_residual_backward", sp, params.grad, g.mod, recipe,
                                                     {params.d_gate.present()})));
  return run_gate(comm, g, stream);
}

// ---------------------------------------------------------------- gate_residual_rmsnorm

bool h3_rule(const GateResidualRmsnormInputs& in) {
  const DType rows = in.y.dtype;
  const auto in_rows_dtype = [rows](const TensorView& m) { return !m.present() || m.dtype == rows; };
  return in.plan.valid() && in.gate.present() && in.gate.dtype == rows && in_rows_dtype(in.shift) &&
         in_rows_dtype(in.scale) && !in.upcast && !in.has_k;
}

// Beyond the H3 rule, the composition of the SP ops, as the WS1 op composes
// its halves (rowwise/gate_residual_norm.h): indexed (a plan), the WS1 op on
// the local index; the grouped forms, sp_gate_residual_layernorm's pieces.
Status recipe_gate_residual_rmsnorm_forward(const SpPlan& sp, const GateResidualRmsnormParams& params,
                                            Stream stream) {
  const GateResidualRmsnormParams& p = params;
  if (!sp.valid()) return Status::value_error("sp is required, got an empty SpPlan");
  if (p.in.plan.valid()) {
    DETDIT_RETURN_IF_ERROR(check_global_plan(sp, p.in.plan, true));
    DETDIT_RETURN_IF_ERROR(check_local_rows(sp, p.in.residual, "residual"));
    GateResidualRmsnormParams local = p;
    local.in.plan = sp.local_plan();
    return gate_residual_rmsnorm_forward(local, stream);
  }
  FramedRegion region;
  DETDIT_RETURN_IF_ERROR(resolve_region(sp, p.in, p.h, &region));
  if (!region.frames) return gate_residual_rmsnorm_forward(params, stream);
  const ResolvedModulation& mod = region.mod;
  const std::vector<Piece>& pieces = region.pieces;
  const GateResidualParams gate_call{rowwise::gate_inputs(p.in), p.h};
  const RmsnormParams norm_call{rowwise::norm_inputs(p.in, p.h), p.out, p.rstd};
  DETDIT_RETURN_IF_ERROR(check::present(p.rstd, "rstd"));
  for (const Piece& pc : pieces) {
    const GateResidualParams g = piece_of(gate_call, mod, pc);
    DETDIT_RETURN_IF_ERROR(rowwise::check_region_h(g.out, g.in.residual, "residual", g.in));
    DETDIT_RETURN_IF_ERROR(rowwise::check_gate_residual_forward_arguments(g, rowwise::Forms::kAll));
    DETDIT_RETURN_IF_ERROR(
        rowwise::check_rmsnorm_forward_arguments(piece_of(norm_call, mod, pc), rowwise::Forms::kAll, "h"));
  }
  const GateResidualRmsnormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(rowwise::check_outputs_disjoint(
      {{&in.residual, "residual"}, {&in.y, "y"}, {&in.gate, "gate"}, {&in.weight, "weight"}, {&in.shift, "shift"},
       {&in.scale, "scale"}},
      {{&p.h, "h"}, {&p.out, "out"}, {&p.rstd, "rstd"}}));
  const Device device = p.h.device;
  for (const Piece& pc : pieces) {
    DETDIT_RETURN_IF_ERROR(backend::gate_residual_forward(device, piece_of(gate_call, mod, pc), stream));
    DETDIT_RETURN_IF_ERROR(backend::rmsnorm_forward(device, piece_of(norm_call, mod, pc), stream));
  }
  return Status();
}

namespace {

// The indexed call's validation on the local rows with the local plan: the
// WS1 composed route's checks (src/gate_residual_rmsnorm.cc), h named h.
Status validate_indexed_region(const GateResidualRmsnormBackwardParams& p) {
  const GateResidualRmsnormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(rowwise::check_region_h(p.h, in.y, "y", rowwise::gate_inputs(in)));
  DETDIT_RETURN_IF_ERROR(check::present(p.d_out, "d_out"));
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.d_h, "d_h", p.h, "h"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_rmsnorm_backward_arguments(rowwise::norm_backward(p, TensorView()),
                                                                   rowwise::Forms::kAll, "h"));
  GateResidualBackwardParams gate = rowwise::gate_backward(p, p.h);  // h standing for g
  gate.d_residual = p.d_residual;
  DETDIT_RETURN_IF_ERROR(rowwise::check_gate_residual_backward_arguments(gate, rowwise::Forms::kAll));
  DETDIT_RETURN_IF_ERROR(rowwise::check_one_form(
      rowwise::gate_inputs(in), rowwise::rmsnorm_modulation(rowwise::norm_inputs(in, p.h)), in.shift));
  return rowwise::check_outputs_disjoint(
      {{&in.y, "y"}, {&in.gate, "gate"}, {&in.weight, "weight"}, {&in.shift, "shift"}, {&in.scale, "scale"},
       {&p.h, "h"}, {&p.rstd, "rstd"}, {&p.d_out, "d_out"}, {&p.d_h, "d_h"}},
      {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}, {&p.d_weight, "d_weight"},
       {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
}

}  // namespace

// The backward (as sp_gate_residual_layernorm's): g, the gradient of h, is
// d_residual when it has h's dtype, else scratch when the gate half runs; the
// norm half with dx = g, g = R(rn(g + d_h)), the gate half of g. Both halves
// validated, allocated and agreed as one call.
Status recipe_gate_residual_rmsnorm_backward(Communicator& comm, const SpPlan& sp,
                                             const GateResidualRmsnormBackwardParams& params, Stream stream) {
  const GateResidualRmsnormBackwardParams& p = params;
  const GateResidualRmsnormInputs& in = p.in;
  const bool indexed = in.plan.valid();
  const bool gate_half = p.d_residual.present() || p.d_y.present() || p.d_gate.present();
  const bool g_in_d_residual = p.d_residual.present() && p.d_residual.dtype == p.h.dtype;
  IndexedNorm in_norm;
  IndexedGate in_gate;
  FormsNorm n;
  FormsGate g;
  const RmsnormBackwardParams norm_params = rowwise::norm_backward(p, TensorView());
  GateResidualBackwardParams gate_params = rowwise::gate_backward(p, p.h);
  gate_params.d_residual = g_in_d_residual ? TensorView() : p.d_residual;
  Status valid = check_comm(comm, sp);
  if (valid.ok()) valid = check_global_plan(sp, in.plan, false);
  if (valid.ok()) valid = check_local_rows(sp, p.h, "h");
  if (indexed) {
    GateResidualRmsnormBackwardParams local = p;
    local.in.plan = sp.local_plan();
    if (valid.ok()) valid = validate_indexed_region(local);
  } else {
    n.p = norm_params;
    if (valid.ok()) valid = validate_region_backward(sp, p, gate_params, validate_norm, &n, &g);
    if (valid.ok())
      valid = rowwise::check_outputs_disjoint(
          {{&in.y, "y"}, {&in.gate, "gate"}, {&in.weight, "weight"}, {&in.shift, "shift"}, {&in.scale, "scale"},
           {&p.h, "h"}, {&p.rstd, "rstd"}, {&p.d_out, "d_out"}, {&p.d_h, "d_h"}},
          {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}, {&p.d_weight, "d_weight"},
           {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
  }
  std::shared_ptr<void> g_memory;
  TensorView grad;  // g
  if (valid.ok() && gate_half) valid = region_gradient(p.h, p.d_residual, g_in_d_residual, stream, &g_memory, &grad);
  gate_params.grad = grad;
  if (valid.ok() && indexed) {
    in_norm.p = in_norm.local = norm_params;
    in_norm.p.dx = in_norm.local.dx = grad;
    in_norm.local.in.plan = sp.local_plan();
    in_gate.p = in_gate.local = gate_params;
    in_gate.local.in.plan = sp.local_plan();
    valid = prepare_indexed_norm(sp, &in_norm, stream);
    if (valid.ok() && gate_half) valid = prepare_indexed_gate(sp, &in_gate, stream);
  } else if (valid.ok()) {
    n.p.dx = grad;
    g.p = gate_params;
    valid = prepare_norm(sp, &n, stream);
    if (valid.ok() && gate_half) valid = prepare_gate(sp, &g, stream);
  }
  const bool modulated = in.shift.present() || in.scale.present();
  const bool tables = modulated && (p.d_shift.present() || p.d_scale.present());
  ResolvedModulation mod = indexed ? indexed_form(in.gate.present() ? in.gate : in.shift, p.h)
                                   : (n.mod.form != ModulationForm::kNone ? n.mod : g.mod);
  const std::string recipe = index_signature(sp) + ", " + numerics_name(in.numerics) +
                             (in.upcast ? " upcast" : "") + (in.has_k ? " k=" + bits(in.k) : "") +
                             (in.gate.present() ? " gate " + std::string(dtype_name(in.gate.dtype)) : " no gate") +
                             (modulated ? " modulated" : " plain") +
                             (in.shift.present() ? " shift " + std::string(dtype_name(in.shift.dtype)) : "");
  DETDIT_RETURN_IF_ERROR(
      comm.agree(valid, signature("sp_gate_residual_rmsnorm_backward", sp, p.h, mod, recipe,
                                  {p.d_weight.present(), tables, p.d_gate.present(), gate_half})));
  if (indexed) {
    DETDIT_RETURN_IF_ERROR(run_indexed_norm(comm, sp, in_norm, stream));
  } else {
    DETDIT_RETURN_IF_ERROR(run_norm(comm, n, stream));
  }
  if (!gate_half) return Status();
  // autograd's sum of h's two gradients: rn(d_h + dx), rounded once to h's dtype
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(backend::add(p.h.device, grad, p.d_h, grad, stream));
  if (indexed) return run_indexed_gate(comm, sp, in_gate, stream);
  return run_gate(comm, g, stream);
}

}  // namespace sp_detail

// layernorm: every form; the indexed one (a plan) on the SpPlan's chunks.
Status sp_layernorm_forward(const SpPlan& sp, const LayernormParams& params, Stream stream) {
  using namespace sp_detail;
  if (!sp.valid()) return Status::value_error("sp is required, got an empty SpPlan");
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, params.in.x, "x"));
  if (params.in.plan.valid()) {
    DETDIT_RETURN_IF_ERROR(check_global_plan(sp, params.in.plan, true));
    LayernormParams local = params;
    local.in.plan = sp.local_plan();
    return layernorm_forward(local, stream);
  }
  ResolvedModulation mod;
  DETDIT_RETURN_IF_ERROR(
      resolve_form(sp, params.in.x, "x", {{&params.in.shift, "shift"}, {&params.in.scale, "scale"}}, &mod));
  if (mod.form != ModulationForm::kPerFrame) return layernorm_forward(params, stream);
  const std::vector<Piece> pieces = frame_pieces(sp, mod);
  for (const Piece& pc : pieces) DETDIT_RETURN_IF_ERROR(rowwise::validate_layernorm_forward(piece_of(params, mod, pc)));
  const LayernormParams& p = params;
  DETDIT_RETURN_IF_ERROR(rowwise::check_outputs_disjoint(
      {{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.bias, "bias"}, {&p.in.shift, "shift"}, {&p.in.scale, "scale"}},
      {{&p.out, "out"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}}));
  for (const Piece& pc : pieces)
    DETDIT_RETURN_IF_ERROR(backend::layernorm_forward(p.in.x.device, piece_of(params, mod, pc), stream));
  return Status();
}

Status sp_layernorm_backward(Communicator& comm, const SpPlan& sp, const LayernormBackwardParams& params,
                             Stream stream) {
  using namespace sp_detail;
  if (params.in.plan.valid()) return indexed_layernorm_backward(comm, sp, params, stream);
  FormsLayernorm n;
  n.p = params;
  Status valid = check_comm(comm, sp);
  if (valid.ok()) valid = validate_layernorm(sp, params, &n);
  if (valid.ok()) valid = prepare_layernorm(sp, &n, stream);
  const std::string recipe = std::string(numerics_name(params.in.numerics)) + (params.in.upcast ? " upcast" : "") +
                             (params.in.weight.present() ? " weight" : "") + (params.in.bias.present() ? " bias" : "");
  DETDIT_RETURN_IF_ERROR(
      comm.agree(valid, signature("sp_layernorm_backward", sp, params.in.x, n.mod, recipe,
                                  {params.d_weight.present(), params.d_bias.present(), n.table.on})));
  return run_layernorm(comm, n, stream);
}

// gate_residual_layernorm: the composition of the two SP ops, as the WS1 op is
// of the two ops (gate_residual_layernorm.h), both halves validated,
// allocated and agreed as one call.
Status sp_gate_residual_layernorm_forward(const SpPlan& sp, const GateResidualLayernormParams& params,
                                          Stream stream) {
  using namespace sp_detail;
  const GateResidualLayernormParams& p = params;
  DETDIT_RETURN_IF_ERROR(check_no_plan(sp, p.in.plan));
  FramedRegion region;
  DETDIT_RETURN_IF_ERROR(resolve_region(sp, p.in, p.h, &region));
  if (!region.frames) return gate_residual_layernorm_forward(params, stream);
  const ResolvedModulation& mod = region.mod;
  const std::vector<Piece>& pieces = region.pieces;
  const GateResidualParams gate_call{gate_inputs(p.in), p.h};
  const LayernormParams norm_call{norm_inputs(p.in, p.h), p.out, p.mean, p.rstd};
  for (const Piece& pc : pieces) {
    DETDIT_RETURN_IF_ERROR(
        rowwise::check_gate_residual_forward_arguments(piece_of(gate_call, mod, pc), rowwise::Forms::kAll));
    DETDIT_RETURN_IF_ERROR(rowwise::check_layernorm_forward_arguments(piece_of(norm_call, mod, pc)));
  }
  const GateResidualLayernormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(rowwise::check_outputs_disjoint(
      {{&in.residual, "residual"}, {&in.y, "y"}, {&in.gate, "gate"}, {&in.weight, "weight"}, {&in.bias, "bias"},
       {&in.shift, "shift"}, {&in.scale, "scale"}},
      {{&p.h, "h"}, {&p.out, "out"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}}));
  const Device device = p.h.device;
  for (const Piece& pc : pieces) {
    DETDIT_RETURN_IF_ERROR(backend::gate_residual_forward(device, piece_of(gate_call, mod, pc), stream));
    DETDIT_RETURN_IF_ERROR(backend::layernorm_forward(device, piece_of(norm_call, mod, pc), stream));
  }
  return Status();
}

Status sp_gate_residual_layernorm_backward(Communicator& comm, const SpPlan& sp,
                                           const GateResidualLayernormBackwardParams& params, Stream stream) {
  using namespace sp_detail;
  const GateResidualLayernormBackwardParams& p = params;
  const GateResidualLayernormInputs& in = p.in;
  FormsLayernorm n;
  FormsGate g;
  n.p = LayernormBackwardParams{norm_inputs(in, p.h), p.mean, p.rstd, p.d_out, TensorView(),
                                p.d_weight, p.d_bias, p.d_shift, p.d_scale};
  // g, the gradient of h: d_residual when it has h's dtype, else scratch when the gate half runs
  const bool gate_half = p.d_residual.present() || p.d_y.present() || p.d_gate.present();
  const bool g_in_d_residual = p.d_residual.present() && p.d_residual.dtype == p.h.dtype;
  g.p = GateResidualBackwardParams{gate_inputs(in), p.h, g_in_d_residual ? TensorView() : p.d_residual, p.d_y,
                                   p.d_gate};
  Status valid = check_comm(comm, sp);
  if (valid.ok()) valid = check_no_plan(sp, in.plan);
  if (valid.ok()) valid = validate_region_backward(sp, p, g.p, validate_layernorm, &n, &g);
  if (valid.ok())
    valid = rowwise::check_outputs_disjoint(
        {{&in.y, "y"}, {&in.gate, "gate"}, {&in.weight, "weight"}, {&in.bias, "bias"}, {&in.shift, "shift"},
         {&in.scale, "scale"}, {&p.h, "h"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}, {&p.d_out, "d_out"},
         {&p.d_h, "d_h"}},
        {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}, {&p.d_weight, "d_weight"},
         {&p.d_bias, "d_bias"}, {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
  std::shared_ptr<void> g_memory;
  if (valid.ok() && gate_half) {
    TensorView grad;
    valid = region_gradient(p.h, p.d_residual, g_in_d_residual, stream, &g_memory, &grad);
    n.p.dx = g.p.grad = grad;
  }
  if (valid.ok()) valid = prepare_layernorm(sp, &n, stream);
  if (valid.ok() && gate_half) valid = prepare_gate(sp, &g, stream);
  const std::string recipe = std::string(numerics_name(in.numerics)) + (in.upcast ? " upcast" : "") +
                             (in.weight.present() ? " weight" : "") + (in.bias.present() ? " bias" : "") +
                             (in.has_k ? " k=" + bits(in.k) : "");
  DETDIT_RETURN_IF_ERROR(comm.agree(
      valid,
      signature("sp_gate_residual_layernorm_backward", sp, p.h, n.mod.form != ModulationForm::kNone ? n.mod : g.mod,
                recipe, {p.d_weight.present(), p.d_bias.present(), n.table.on, p.d_gate.present()})));
  DETDIT_RETURN_IF_ERROR(run_layernorm(comm, n, stream));
  if (!gate_half) return Status();
  // autograd's sum of h's two gradients: rn(d_h + dx), rounded once to h's dtype
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(backend::add(p.h.device, g.p.grad, p.d_h, g.p.grad, stream));
  return run_gate(comm, g, stream);
}

}  // namespace detdit
