// The sp_region ops: rmsnorm (plain and modulated) and gate_residual under
// sequence parallelism, byte-equal to WS1 (contract in include/detdit/parallel.h,
// plan in sp_plan.cc, walk-through in docs/parallel.md): the indexed form's
// H3 rule here; the other forms and recipes in sp_forms.cc.
//
// Forward = the public WS1 op on the local rows with the local plan.
// Backward =
//   1. validate locally and allocate every scratch buffer, then agree across
//      ranks on the outcome and on the call signature (the index plan's
//      fingerprint, the shapes and profile, which outputs are gathered): a bad
//      argument, a failed allocation or a different call on any rank fails
//      every rank here, before anything moves or is written;
//   2. ONE all-gather of the straddling rows: each rank packs its sent rows
//      (x, grad, rstd / grad, y) into a fixed send block of max_send rows; the
//      gathered blocks are unpacked per field into (world*max_send, ...) rows,
//      row owner*max_send + slot, as position_row expects;
//   3. the chunk owner computes its chunks' partials with the *_partials halves
//      (global plan, ChunkSelection of its chunks, ExtraRows), kept local;
//   4. the chain: the WS1 folds (ascending chunks; row r's segments
//      ascending) run link by link along the global chunk order, each link
//      (consecutive chunks of one owner) on its owner, from the running FP32
//      sums the link before it broadcast (the first from +0.0, as WS1); one
//      broadcast of the R x width sums (plus d_weight's H) per link, so the
//      bytes do not grow with S or the packing;
//   5. the outputs, after the last collective: row-local gradients with the
//      backends' *_rows halves (local plan), then every rank rounds the final
//      sums once to the output dtype, as the WS1 folds do.
// Every bit is decided by the WS1 backends; this file only moves bytes.
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "parallel/copy.h"
#include "parallel/sp_plan_impl.h"
#include "parallel/sp_region_impl.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace sp_detail {

std::size_t aligned_size(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// ---------------------------------------------------------------- validation

Status check_comm(const Communicator& comm, const SpPlan& sp) {
  if (!sp.valid()) return Status::value_error("sp is required, got an empty SpPlan");
  if (comm.world_size() != sp.world() || comm.rank() != sp.rank())
    return Status::value_error("the communicator is rank " + std::to_string(comm.rank()) + " of " +
                               std::to_string(comm.world_size()) + ", the SpPlan rank " + std::to_string(sp.rank()) +
                               " of " + std::to_string(sp.world()));
  return Status();
}

// params.in.plan must be the plan the SpPlan was built from (the full (S,) index),
// or absent where allowed.
Status check_global_plan(const SpPlan& sp, const IndexPlan& plan, bool required) {
  if (!sp.valid()) return Status::value_error("sp is required, got an empty SpPlan");
  if (!plan.valid()) {
    if (required) return Status::value_error("plan is required (the full (S,) row index), got an empty IndexPlan");
    return Status();
  }
  const IndexPlan& global = sp.global_plan();
  if (!global.valid())
    return Status::value_error("plan must be absent: the SpPlan was built without an index plan (seq_len and batch "
                               "only), so it runs the grouped forms; the indexed form needs the SpPlan of its plan");
  if (plan.seq_len() != global.seq_len())
    return Status::value_error("index must be the full (S,) row index with S = " + std::to_string(global.seq_len()) +
                               ", got a plan of seq_len " + std::to_string(plan.seq_len()) +
                               " (a sharded index is not accepted: the SP region needs the replicated index)");
  if (plan.host_tables().row_of_seq != global.host_tables().row_of_seq)
    return Status::value_error("plan must be the IndexPlan the SpPlan was built from (same index object)");
  return Status();
}

// An activation must be this rank's local rows: (B, S_local, H) or (B*S_local, H).
Status check_local_rows(const SpPlan& sp, const TensorView& t, const char* name) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  const int64_t rows = sp.batch() * sp.local_seq_len();
  const bool ok = (t.rank == 2 && t.shape[0] == rows) ||
                  (t.rank == 3 && t.shape[0] == sp.batch() && t.shape[1] == sp.local_seq_len());
  if (ok) return Status();
  return Status::value_error(std::string(name) + " must be this rank's (B, S_local, H) = (" +
                             std::to_string(sp.batch()) + ", " + std::to_string(sp.local_seq_len()) +
                             ", H) rows (positions [" + std::to_string(sp.local_begin()) + ", " +
                             std::to_string(sp.local_end()) + ") of every batch item), got " + t.describe());
}

}  // namespace sp_detail

namespace {

using namespace sp_detail;

// The start of every backward's agreed validation: the communicator and plan
// of the call and the rank's rows, then the WS1 validator of the local call.
template <typename Params, typename Validate>
Status validate_backward(const Communicator& comm, const SpPlan& sp, const Params& params, bool plan_required,
                         const TensorView& rows, const char* name, Validate validate) {
  DETDIT_RETURN_IF_ERROR(check_comm(comm, sp));
  DETDIT_RETURN_IF_ERROR(check_global_plan(sp, params.in.plan, plan_required));
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, rows, name));
  Params local = params;
  local.in.plan = sp.local_plan();
  return validate(local);
}

}  // namespace

// ---------------------------------------------------------------- exchanges

namespace sp_detail {

Status allocate_rows(int world_size, int64_t max_send_rows, const Device& device, std::vector<std::size_t> row_bytes,
                     Stream stream, RowExchange* x) {
  if (max_send_rows == 0) return Status();
  const std::size_t world = static_cast<std::size_t>(world_size);
  const std::size_t max_send = static_cast<std::size_t>(max_send_rows);
  x->row_bytes = std::move(row_bytes);
  std::size_t unpacked = 0;
  for (std::size_t bytes : x->row_bytes) {
    x->offset.push_back(x->block);
    x->block += aligned_size(max_send * bytes);
    unpacked += aligned_size(world * max_send * bytes);
  }
  return allocate_scratch(device, x->block + world * x->block + unpacked, stream, &x->memory);
}

// Every rank's straddling rows of each field (rows[f]: this rank's local
// rows), unpacked; extra[f] points at field f's rows (nullptr when no rank
// sends anything, then no collective runs).
Status exchange_rows(Communicator& comm, const std::vector<SpRun>& send_runs, int64_t max_send_rows,
                     const Device& device, DType dtype, const std::vector<const void*>& rows, const RowExchange& x,
                     Stream stream, std::vector<void*>* extra) {
  extra->assign(rows.size(), nullptr);
  if (max_send_rows == 0) return Status();
  const std::size_t world = static_cast<std::size_t>(comm.world_size());
  const std::size_t max_send = static_cast<std::size_t>(max_send_rows);
  char* send = static_cast<char*>(x.memory.get());
  char* gathered = send + x.block;
  char* out = gathered + world * x.block;
  for (std::size_t f = 0; f < rows.size(); ++f) {
    const std::size_t rb = x.row_bytes[f];
    for (const SpRun& run : send_runs)
      DETDIT_RETURN_IF_ERROR(parallel_copy::copy(device, send + x.offset[f] + run.dst * rb,
                                                 static_cast<const char*>(rows[f]) + run.src * rb, run.count * rb,
                                                 stream));
  }
  // Slots past a rank's send count are never read (position_row never names them).
  DETDIT_RETURN_IF_ERROR(comm.all_gather(send, x.block, gathered, dtype, stream));
  for (std::size_t f = 0; f < rows.size(); ++f) {
    const std::size_t width = max_send * x.row_bytes[f];
    DETDIT_RETURN_IF_ERROR(
        parallel_copy::copy_2d(device, out, width, gathered + x.offset[f], x.block, width, world, stream));
    (*extra)[f] = out;
    out += aligned_size(world * width);
  }
  return Status();
}

}  // namespace sp_detail

namespace {

// Steps 3-4's buffers: this rank's partials of its own chunks (its chunks
// and their segments ascending, written by the partials half) and the
// running sums of the chain, [weight (H) | table (R, table_width)] FP32, the
// payload of every broadcast.
struct ChainFold {
  int64_t hidden = 0, rows = 0, table_width = 0;  // table_width 0: no table family
  bool weight = false;
  float* weight_partials = nullptr;  // (own chunks, H)
  float* table_partials = nullptr;   // (own segments, table_width)
  float* sums = nullptr;
  std::shared_ptr<void> memory;
  bool table() const { return table_width > 0; }
  int64_t sum_floats() const { return (weight ? hidden : 0) + rows * table_width; }
  TensorView weight_sums(const Device& device) const {
    return weight ? TensorView::contiguous(sums, DType::kF32, {hidden}, device) : TensorView();
  }
  TensorView table_sums(const Device& device) const {
    if (!table()) return TensorView();
    return TensorView::contiguous(sums + (weight ? hidden : 0), DType::kF32, {rows, table_width}, device);
  }
};

Status allocate_chain(const SpPlan::Impl& sp, const Device& device, int64_t hidden, bool weight, int64_t table_width,
                      Stream stream, ChainFold* f) {
  const SpPlan::RankTraffic& mine = sp.traffic[sp.rank];
  f->hidden = hidden;
  f->rows = sp.global.num_rows();
  f->table_width = table_width;
  f->weight = weight;
  const std::size_t weight_bytes = weight ? static_cast<std::size_t>(mine.chunks * hidden) * sizeof(float) : 0;
  const std::size_t table_bytes = static_cast<std::size_t>(mine.segments * table_width) * sizeof(float);
  const std::size_t sum_bytes = static_cast<std::size_t>(f->sum_floats()) * sizeof(float);
  DETDIT_RETURN_IF_ERROR(allocate_scratch(
      device, aligned_size(weight_bytes) + aligned_size(table_bytes) + aligned_size(sum_bytes), stream, &f->memory));
  char* base = static_cast<char*>(f->memory.get());
  f->weight_partials = reinterpret_cast<float*>(base);
  f->table_partials = reinterpret_cast<float*>(base + aligned_size(weight_bytes));
  f->sums = reinterpret_cast<float*>(base + aligned_size(weight_bytes) + aligned_size(table_bytes));
  return Status();
}

// Step 4, the chain: the global chunk order is cut into links (runs of
// consecutive chunks of one owner). For each link in order, its owner
// continues the running sums with its partials of the link's chunks (the
// WS1 folds' next steps: ascending chunks, row r's segments ascending), then
// broadcasts them. The first link (rank 0's, holding chunk 0) starts from
// +0.0 exactly as the WS1 fold does; every later one from the sums broadcast
// after the link before it. After the last broadcast every rank holds the
// WS1 folds' final FP32 sums.
Status run_chain(Communicator& comm, const SpPlan::Impl& sp, const Device& device, const ChainFold& f,
                 Stream stream) {
  const TensorView weight_sums = f.weight_sums(device), table_sums = f.table_sums(device);
  const std::size_t bytes = static_cast<std::size_t>(f.sum_floats()) * sizeof(float);
  for (std::size_t k = 0; k < sp.links.size(); ++k) {
    const SpLink& link = sp.links[k];
    if (link.rank == sp.rank) {
      const bool first = k == 0;
      if (f.weight) {
        const TensorView partials = TensorView::contiguous(f.weight_partials + link.chunk_src * f.hidden, DType::kF32,
                                                           {link.chunks, f.hidden}, device);
        DETDIT_RETURN_IF_ERROR(
            backend::continue_chunk_fold(device, partials, first ? TensorView() : weight_sums, weight_sums, stream));
      }
      if (f.table()) {
        const TensorView partials = TensorView::contiguous(f.table_partials + link.segment_src * f.table_width,
                                                           DType::kF32, {link.segments, f.table_width}, device);
        DETDIT_RETURN_IF_ERROR(backend::continue_segment_fold(device, sp.global, partials, link.segment_begin,
                                                              first ? TensorView() : table_sums, table_sums, stream));
      }
    }
    DETDIT_RETURN_IF_ERROR(comm.broadcast(f.sums, bytes, link.rank, DType::kF32, stream));
  }
  return Status();
}

// Step 5's rounding: out = R(sums), columns [column, column + out's width)
// of the table sums (no partials left to add).
Status round_table(const SpPlan::Impl& sp, const Device& device, const ChainFold& f, int64_t column,
                   const TensorView& out, Stream stream) {
  const int64_t width = out.shape[1];
  const TensorView none = TensorView::contiguous(f.sums, DType::kF32, {0, width}, device);
  return backend::continue_segment_fold(device, sp.global, none, 0, f.table_sums(device).narrow(1, column, width),
                                        out, stream);
}

Status round_weight(const Device& device, const ChainFold& f, const TensorView& out, Stream stream) {
  const TensorView none = TensorView::contiguous(f.sums, DType::kF32, {0, f.hidden}, device);
  return backend::continue_chunk_fold(device, none, f.weight_sums(device), out, stream);
}

// What decides this rank's collectives and the bits of the replicated
// gradients: every rank must agree on it. The index enters through the
// plan's fingerprint: ranks holding different indexes of one length would
// exchange blocks of equal sizes and fold different "replicated" results.
// `norm`: the norm's profile and modulation (norm_call), empty for the gate alone.
std::string call_signature(const char* op, const SpPlan& sp, const TensorView& rows, const std::string& norm,
                           std::initializer_list<bool> gathered) {
  char index[96] = "no plan";
  if (sp.valid()) {
    const IndexPlan& plan = sp.global_plan();
    std::snprintf(index, sizeof index, "index %016llx S=%lld B=%lld R=%lld world=%d",
                  static_cast<unsigned long long>(plan.fingerprint()), static_cast<long long>(plan.seq_len()),
                  static_cast<long long>(plan.batch()), static_cast<long long>(plan.num_rows()), sp.world());
  }
  std::string signature = std::string(op) + "(" + index + ", " + dtype_name(rows.dtype) +
                          ", H=" + std::to_string(rows.rank > 0 ? rows.shape[rows.rank - 1] : 0) +
                          (norm.empty() ? "" : ", " + norm) + ", gathers";
  for (bool g : gathered) signature += g ? " 1" : " 0";
  return signature + ")";
}

std::string norm_call(Numerics numerics, bool modulated) {
  return std::string(numerics_name(numerics)) + (modulated ? ", modulated" : ", plain");
}

ChunkSelection owned_selection(const SpPlan::Impl& sp) {
  ChunkSelection sel;
  sel.chunks = sp.owned_chunks_on_device;
  sel.num_chunks = static_cast<int64_t>(sp.owned_chunks.size());
  sel.position_row = sp.position_row_on_device;
  return sel;
}

}  // namespace

// ---------------------------------------------------------------- forward

Status sp_rmsnorm_forward(const SpPlan& sp, const RmsnormParams& params, Stream stream) {
  const bool modulated = params.in.shift.present() || params.in.scale.present();
  if (forms_call(sp, params.in.plan, modulated)) return forms_rmsnorm_forward(sp, params, stream);
  DETDIT_RETURN_IF_ERROR(check_global_plan(sp, params.in.plan, modulated));
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, params.in.x, "x"));
  RmsnormParams local = params;
  local.in.plan = sp.local_plan();
  return rmsnorm_forward(local, stream);
}

Status sp_gate_residual_forward(const SpPlan& sp, const GateResidualParams& params, Stream stream) {
  if (forms_call(sp, params.in.plan, true)) return forms_gate_residual_forward(sp, params, stream);
  DETDIT_RETURN_IF_ERROR(check_global_plan(sp, params.in.plan, true));
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, params.in.residual, "residual"));
  GateResidualParams local = params;
  local.in.plan = sp.local_plan();
  return gate_residual_forward(local, stream);
}

Status sp_gate_residual_rmsnorm_forward(const SpPlan& sp, const GateResidualRmsnormParams& params, Stream stream) {
  if (!h3_rule(params.in)) return recipe_gate_residual_rmsnorm_forward(sp, params, stream);
  DETDIT_RETURN_IF_ERROR(check_global_plan(sp, params.in.plan, true));
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, params.in.residual, "residual"));
  GateResidualRmsnormParams local = params;
  local.in.plan = sp.local_plan();
  return gate_residual_rmsnorm_forward(local, stream);
}

// ---------------------------------------------------------------- backward

namespace {

// One rank's rmsnorm backward between validation and the agreement: the
// local and global forms of the call and every scratch buffer, allocated
// before the agreement so that a failed allocation is agreed like a bad
// argument (no rank is left in a collective its peers never enter).
struct NormBackward {
  RmsnormBackwardParams local, global;  // the rows half on the local plan; partials and folds on the global one
  bool tables = false;                  // d_shift / d_scale gathered
  RowExchange rows;
  ChainFold chain;  // d_weight: H; [d_shift | d_scale]: (R, 2H)
  bool gathers() const { return local.d_weight.present() || tables; }
};

Status prepare_norm(const SpPlan& sp, const RmsnormBackwardParams& params, Stream stream, NormBackward* n) {
  const SpPlan::Impl& plan = sp.impl();
  n->local = n->global = params;
  n->local.in.plan = plan.local;
  n->global.in.plan = plan.global;
  n->tables = params.in.shift.present() && (params.d_shift.present() || params.d_scale.present());
  if (!n->gathers()) return Status();
  const Device device = params.in.x.device;
  const int64_t hidden = params.in.x.shape[params.in.x.rank - 1];
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(params.in.x.dtype);
  DETDIT_RETURN_IF_ERROR(
      allocate_rows(plan.world, plan.max_send, device, {row_bytes, row_bytes, sizeof(float)}, stream, &n->rows));
  return allocate_chain(plan, device, hidden, params.d_weight.present(), n->tables ? 2 * hidden : 0, stream,
                        &n->chain);
}

// Steps 2-5 of an agreed rmsnorm backward.
Status run_norm(Communicator& comm, const SpPlan& sp, NormBackward& n, Stream stream) {
  const Device device = n.local.in.x.device;
  const SpPlan::Impl& plan = sp.impl();
  if (n.gathers()) {
    const RmsnormBackwardParams& p = n.global;
    const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
    std::vector<void*> extra_rows;
    DETDIT_RETURN_IF_ERROR(exchange_rows(comm, plan.send_runs, plan.max_send, device, p.in.x.dtype,
                                         {p.in.x.data, p.grad.data, p.rstd.data}, n.rows, stream, &extra_rows));
    const int64_t received = sp.world() * plan.max_send;
    ExtraRows extra;
    if (plan.max_send > 0) {
      extra.x = TensorView::contiguous(extra_rows[0], p.in.x.dtype, {received, hidden}, device);
      extra.grad = TensorView::contiguous(extra_rows[1], p.in.x.dtype, {received, hidden}, device);
      extra.rstd = TensorView::contiguous(extra_rows[2], DType::kF32, {received}, device);
    }
    const SpPlan::RankTraffic& mine = plan.traffic[plan.rank];
    if (mine.chunks > 0) {
      TensorView weight_partials, table_partials;
      if (p.d_weight.present())
        weight_partials = TensorView::contiguous(n.chain.weight_partials, DType::kF32, {mine.chunks, hidden}, device);
      if (n.tables)
        table_partials =
            TensorView::contiguous(n.chain.table_partials, DType::kF32, {mine.segments, 2 * hidden}, device);
      DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_partials(device, p, owned_selection(plan), extra,
                                                                weight_partials, table_partials, stream));
    }
    DETDIT_RETURN_IF_ERROR(run_chain(comm, plan, device, n.chain, stream));
  }
  DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_rows(device, n.local, stream));
  if (!n.gathers()) return Status();
  const RmsnormBackwardParams& p = n.global;
  if (p.d_weight.present()) DETDIT_RETURN_IF_ERROR(round_weight(device, n.chain, p.d_weight, stream));
  if (!n.tables) return Status();
  // d_shift from columns [0, H), d_scale from [H, 2H) of the (R, 2H) sums.
  if (p.d_shift.present()) DETDIT_RETURN_IF_ERROR(round_table(plan, device, n.chain, 0, p.d_shift, stream));
  if (p.d_scale.present())
    DETDIT_RETURN_IF_ERROR(round_table(plan, device, n.chain, n.chain.hidden, p.d_scale, stream));
  return Status();
}

// One rank's gate_residual backward between validation and the agreement (as NormBackward).
struct GateBackward {
  GateResidualBackwardParams local, global;
  RowExchange rows;
  ChainFold chain;  // d_gate: (R, H)
};

Status prepare_gate(const SpPlan& sp, const GateResidualBackwardParams& params, Stream stream, GateBackward* g) {
  const SpPlan::Impl& plan = sp.impl();
  g->local = g->global = params;
  g->local.in.plan = plan.local;
  g->global.in.plan = plan.global;
  if (!params.d_gate.present()) return Status();
  const Device device = params.grad.device;
  const int64_t hidden = params.grad.shape[params.grad.rank - 1];
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(params.grad.dtype);
  DETDIT_RETURN_IF_ERROR(allocate_rows(plan.world, plan.max_send, device, {row_bytes, row_bytes}, stream, &g->rows));
  return allocate_chain(plan, device, hidden, false, hidden, stream, &g->chain);
}

// Steps 2-5 of an agreed gate_residual backward.
Status run_gate(Communicator& comm, const SpPlan& sp, GateBackward& g, Stream stream) {
  const GateResidualBackwardParams& p = g.global;
  const Device device = p.grad.device;
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  const SpPlan::Impl& plan = sp.impl();
  if (p.d_gate.present()) {
    std::vector<void*> extra_rows;
    DETDIT_RETURN_IF_ERROR(exchange_rows(comm, plan.send_runs, plan.max_send, device, p.grad.dtype,
                                         {p.grad.data, p.in.y.data}, g.rows, stream, &extra_rows));
    const int64_t received = sp.world() * plan.max_send;
    ExtraRows extra;
    if (plan.max_send > 0) {
      extra.grad = TensorView::contiguous(extra_rows[0], p.grad.dtype, {received, hidden}, device);
      extra.y = TensorView::contiguous(extra_rows[1], p.grad.dtype, {received, hidden}, device);
    }
    const SpPlan::RankTraffic& mine = plan.traffic[plan.rank];
    if (mine.chunks > 0) {
      const TensorView partials =
          TensorView::contiguous(g.chain.table_partials, DType::kF32, {mine.segments, hidden}, device);
      DETDIT_RETURN_IF_ERROR(
          backend::gate_residual_backward_partials(device, p, owned_selection(plan), extra, partials, stream));
    }
    DETDIT_RETURN_IF_ERROR(run_chain(comm, plan, device, g.chain, stream));
  }
  DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_rows(device, g.local, stream));
  if (!p.d_gate.present()) return Status();
  return round_table(plan, device, g.chain, 0, p.d_gate, stream);
}

}  // namespace

Status sp_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params, Stream stream) {
  const bool modulated = params.in.shift.present() || params.in.scale.present();
  if (forms_call(sp, params.in.plan, modulated)) return forms_rmsnorm_backward(comm, sp, params, stream);
  if (params.in.plan.valid() && !h3_rule(params.in)) return indexed_recipe_rmsnorm_backward(comm, sp, params, stream);
  NormBackward norm;
  Status valid = validate_backward(comm, sp, params, modulated, params.in.x, "x", [](const RmsnormBackwardParams& p) {
    // the indexed form only: the region's exchanges and chains are the plan's
    return rowwise::validate_rmsnorm_backward(p, rowwise::Forms::kIndexedOnly);
  });
  if (valid.ok()) valid = prepare_norm(sp, params, stream, &norm);
  const bool tables = modulated && (params.d_shift.present() || params.d_scale.present());
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, call_signature("sp_rmsnorm_backward", sp, params.in.x,
                                                          norm_call(params.in.numerics, modulated),
                                                          {params.d_weight.present(), tables})));
  return run_norm(comm, sp, norm, stream);
}

Status sp_gate_residual_backward(Communicator& comm, const SpPlan& sp, const GateResidualBackwardParams& params,
                                 Stream stream) {
  if (forms_call(sp, params.in.plan, true)) return forms_gate_residual_backward(comm, sp, params, stream);
  if (!h3_rule(params.in)) return indexed_recipe_gate_residual_backward(comm, sp, params, stream);
  GateBackward gate;
  Status valid =
      validate_backward(comm, sp, params, true, params.grad, "grad", [](const GateResidualBackwardParams& p) {
    // the indexed form only: the region's exchanges and chains are the plan's
    return rowwise::validate_gate_residual_backward(p, rowwise::Forms::kIndexedOnly);
  });
  if (valid.ok()) valid = prepare_gate(sp, params, stream, &gate);
  DETDIT_RETURN_IF_ERROR(
      comm.agree(valid, call_signature("sp_gate_residual_backward", sp, params.grad, "", {params.d_gate.present()})));
  return run_gate(comm, sp, gate, stream);
}

// Both halves validated, allocated and agreed as one call (one agreement), so
// neither half can fail on one rank after the other has written its outputs.
Status sp_gate_residual_rmsnorm_backward(Communicator& comm, const SpPlan& sp,
                                         const GateResidualRmsnormBackwardParams& params, Stream stream) {
  if (!h3_rule(params.in)) return recipe_gate_residual_rmsnorm_backward(comm, sp, params, stream);
  const GateResidualRmsnormBackwardParams& p = params;
  const bool modulated = p.in.shift.present() || p.in.scale.present();
  Status valid = validate_backward(comm, sp, p, true, p.h, "h", rowwise::validate_gate_residual_rmsnorm_backward);
  // g, the gradient of h: d_residual when kept, else scratch when d_y or d_gate need it.
  TensorView g = p.d_residual;
  std::shared_ptr<void> g_memory;
  if (valid.ok() && !g.present() && (p.d_y.present() || p.d_gate.present())) {
    g = p.h;
    valid = allocate_scratch(p.h.device, p.h.nbytes(), stream, &g_memory);
    g.data = g_memory.get();
  }
  NormBackward norm;
  GateBackward gate;
  if (valid.ok()) valid = prepare_norm(sp, rowwise::norm_backward(p, g), stream, &norm);
  if (valid.ok() && g.present()) valid = prepare_gate(sp, rowwise::gate_backward(p, g), stream, &gate);
  const bool tables = modulated && (p.d_shift.present() || p.d_scale.present());
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, call_signature("sp_gate_residual_rmsnorm_backward", sp, p.h,
                                                          norm_call(p.in.numerics, modulated),
                                                          {p.d_weight.present(), tables, p.d_gate.present()})));
  DETDIT_RETURN_IF_ERROR(run_norm(comm, sp, norm, stream));
  if (!g.present()) return Status();
  // autograd's sum of h's two gradients: rn(d_h + dx), rounded once to T
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(backend::add(g.device, g, p.d_h, g, stream));
  return run_gate(comm, sp, gate, stream);
}

}  // namespace detdit
