// The sp_region ops: rmsnorm (plain and modulated) and gate_residual under
// sequence parallelism, byte-equal to WS1 (contract in include/detdit/parallel.h,
// plan in sp_plan.cc, walk-through in docs/parallel.md).
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
//      (global plan, ChunkSelection of its chunks, ExtraRows) straight into
//      its send block, padded to the most chunks/segments any rank owns;
//   4. ONE all-gather of the partials, copied into global chunk/segment order;
//   5. the outputs, after the last collective: row-local gradients with the
//      backends' *_rows halves (local plan), then every rank folds with the
//      WS1 folds (rmsnorm: the same rowwise::fold_rmsnorm_partials as the WS1
//      backward).
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
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace {

constexpr std::size_t kAlign = 256;  // every scratch piece starts on a 256-byte boundary
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

// ---------------------------------------------------------------- exchanges

// Step 2's buffers: the send block (field f's max_send rows at offset[f]),
// the world gathered blocks and each field's (world*max_send) unpacked rows.
// Empty when no rank sends a row (every rank knows max_send).
struct RowExchange {
  std::vector<std::size_t> row_bytes, offset;
  std::size_t block = 0;
  std::shared_ptr<void> memory;
};

Status allocate_rows(const SpPlan::Impl& sp, const Device& device, std::vector<std::size_t> row_bytes, Stream stream,
                     RowExchange* x) {
  if (sp.max_send == 0) return Status();
  const std::size_t world = static_cast<std::size_t>(sp.world);
  const std::size_t max_send = static_cast<std::size_t>(sp.max_send);
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
Status exchange_rows(Communicator& comm, const SpPlan::Impl& sp, const Device& device, DType dtype,
                     const std::vector<const void*>& rows, const RowExchange& x, Stream stream,
                     std::vector<void*>* extra) {
  extra->assign(rows.size(), nullptr);
  if (sp.max_send == 0) return Status();
  const std::size_t world = static_cast<std::size_t>(sp.world);
  const std::size_t max_send = static_cast<std::size_t>(sp.max_send);
  char* send = static_cast<char*>(x.memory.get());
  char* gathered = send + x.block;
  char* out = gathered + world * x.block;
  for (std::size_t f = 0; f < rows.size(); ++f) {
    const std::size_t rb = x.row_bytes[f];
    for (const SpRun& run : sp.send_runs)
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

// One family of partials: each rank's rows of `width` fp32 (its chunks or
// segments, padded to max_rows), `total` rows in global order after the
// exchange.
struct PartialFamily {
  int64_t max_rows, total, width;
  const std::vector<SpRun>* runs;
  float* send = nullptr;    // this rank's rows, written by the partials half
  float* global = nullptr;  // (total, width) in global order, after exchange_partials
};

// Step 4's buffers: one send block holding every family.
Status allocate_partials(const SpPlan::Impl& sp, const Device& device, std::vector<PartialFamily*> families,
                         Stream stream, std::size_t* block, std::shared_ptr<void>* owner) {
  *block = 0;
  std::size_t total = 0;
  for (const PartialFamily* f : families) {
    *block += aligned_size(static_cast<std::size_t>(f->max_rows * f->width) * sizeof(float));
    total += aligned_size(static_cast<std::size_t>(f->total * f->width) * sizeof(float));
  }
  DETDIT_RETURN_IF_ERROR(allocate_scratch(device, *block * (1 + sp.world) + total, stream, owner));
  char* base = static_cast<char*>(owner->get());
  char* global = base + *block * (1 + sp.world);
  std::size_t offset = 0;
  for (PartialFamily* f : families) {
    f->send = reinterpret_cast<float*>(base + offset);
    f->global = reinterpret_cast<float*>(global);
    offset += aligned_size(static_cast<std::size_t>(f->max_rows * f->width) * sizeof(float));
    global += aligned_size(static_cast<std::size_t>(f->total * f->width) * sizeof(float));
  }
  return Status();
}

// Step 5: gather every rank's block, copy each run into global order.
Status exchange_partials(Communicator& comm, const Device& device,
                         const std::vector<PartialFamily*>& families, std::size_t block, Stream stream) {
  char* send = reinterpret_cast<char*>(families.front()->send);
  char* gathered = send + block;
  DETDIT_RETURN_IF_ERROR(comm.all_gather(send, block, gathered, DType::kF32, stream));
  for (const PartialFamily* f : families) {
    const std::size_t row_bytes = static_cast<std::size_t>(f->width) * sizeof(float);
    const std::size_t in_block = reinterpret_cast<char*>(f->send) - send;
    for (const SpRun& run : *f->runs)
      DETDIT_RETURN_IF_ERROR(parallel_copy::copy(device, reinterpret_cast<char*>(f->global) + run.dst * row_bytes,
                                                 gathered + run.rank * block + in_block + run.src * row_bytes,
                                                 run.count * row_bytes, stream));
  }
  return Status();
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
  DETDIT_RETURN_IF_ERROR(check_global_plan(sp, params.in.plan, modulated));
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, params.in.x, "x"));
  RmsnormParams local = params;
  local.in.plan = sp.local_plan();
  return rmsnorm_forward(local, stream);
}

Status sp_gate_residual_forward(const SpPlan& sp, const GateResidualParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_global_plan(sp, params.in.plan, true));
  DETDIT_RETURN_IF_ERROR(check_local_rows(sp, params.in.residual, "residual"));
  GateResidualParams local = params;
  local.in.plan = sp.local_plan();
  return gate_residual_forward(local, stream);
}

Status sp_gate_residual_rmsnorm_forward(const SpPlan& sp, const GateResidualRmsnormParams& params, Stream stream) {
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
  PartialFamily weight{}, table{};
  std::vector<PartialFamily*> families;
  std::size_t block = 0;
  std::shared_ptr<void> partials;
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
  DETDIT_RETURN_IF_ERROR(allocate_rows(plan, device, {row_bytes, row_bytes, sizeof(float)}, stream, &n->rows));
  n->weight = PartialFamily{plan.max_chunks, plan.global.num_chunks(), hidden, &plan.chunk_runs};
  n->table = PartialFamily{plan.max_segments, plan.global.num_segments(), 2 * hidden, &plan.segment_runs};
  if (params.d_weight.present()) n->families.push_back(&n->weight);
  if (n->tables) n->families.push_back(&n->table);
  return allocate_partials(plan, device, n->families, stream, &n->block, &n->partials);
}

// Steps 2-5 of an agreed rmsnorm backward.
Status run_norm(Communicator& comm, const SpPlan& sp, NormBackward& n, Stream stream) {
  const Device device = n.local.in.x.device;
  if (n.gathers()) {
    const SpPlan::Impl& plan = sp.impl();
    const RmsnormBackwardParams& p = n.global;
    const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
    std::vector<void*> extra_rows;
    DETDIT_RETURN_IF_ERROR(
        exchange_rows(comm, plan, device, p.in.x.dtype, {p.in.x.data, p.grad.data, p.rstd.data}, n.rows, stream,
                      &extra_rows));
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
        weight_partials = TensorView::contiguous(n.weight.send, DType::kF32, {mine.chunks, hidden}, device);
      if (n.tables)
        table_partials = TensorView::contiguous(n.table.send, DType::kF32, {mine.segments, 2 * hidden}, device);
      DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_partials(device, p, owned_selection(plan), extra,
                                                                weight_partials, table_partials, stream));
    }
    DETDIT_RETURN_IF_ERROR(exchange_partials(comm, device, n.families, n.block, stream));
  }
  DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_rows(device, n.local, stream));
  if (!n.gathers()) return Status();
  const int64_t hidden = n.global.in.x.shape[n.global.in.x.rank - 1];
  TensorView weight_all, table_all;  // (C, H) chunk and (G, 2H) segment partials in global order
  if (n.global.d_weight.present())
    weight_all = TensorView::contiguous(n.weight.global, DType::kF32, {n.weight.total, hidden}, device);
  if (n.tables) table_all = TensorView::contiguous(n.table.global, DType::kF32, {n.table.total, 2 * hidden}, device);
  return rowwise::fold_rmsnorm_partials(n.global, weight_all, table_all, stream);
}

// One rank's gate_residual backward between validation and the agreement (as NormBackward).
struct GateBackward {
  GateResidualBackwardParams local, global;
  RowExchange rows;
  PartialFamily gate{};
  std::size_t block = 0;
  std::shared_ptr<void> partials;
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
  DETDIT_RETURN_IF_ERROR(allocate_rows(plan, device, {row_bytes, row_bytes}, stream, &g->rows));
  g->gate = PartialFamily{plan.max_segments, plan.global.num_segments(), hidden, &plan.segment_runs};
  return allocate_partials(plan, device, {&g->gate}, stream, &g->block, &g->partials);
}

// Steps 2-5 of an agreed gate_residual backward.
Status run_gate(Communicator& comm, const SpPlan& sp, GateBackward& g, Stream stream) {
  const GateResidualBackwardParams& p = g.global;
  const Device device = p.grad.device;
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  if (p.d_gate.present()) {
    const SpPlan::Impl& plan = sp.impl();
    std::vector<void*> extra_rows;
    DETDIT_RETURN_IF_ERROR(
        exchange_rows(comm, plan, device, p.grad.dtype, {p.grad.data, p.in.y.data}, g.rows, stream, &extra_rows));
    const int64_t received = sp.world() * plan.max_send;
    ExtraRows extra;
    if (plan.max_send > 0) {
      extra.grad = TensorView::contiguous(extra_rows[0], p.grad.dtype, {received, hidden}, device);
      extra.y = TensorView::contiguous(extra_rows[1], p.grad.dtype, {received, hidden}, device);
    }
    const SpPlan::RankTraffic& mine = plan.traffic[plan.rank];
    if (mine.chunks > 0) {
      const TensorView partials = TensorView::contiguous(g.gate.send, DType::kF32, {mine.segments, hidden}, device);
      DETDIT_RETURN_IF_ERROR(
          backend::gate_residual_backward_partials(device, p, owned_selection(plan), extra, partials, stream));
    }
    DETDIT_RETURN_IF_ERROR(exchange_partials(comm, device, {&g.gate}, g.block, stream));
  }
  DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_rows(device, g.local, stream));
  if (!p.d_gate.present()) return Status();
  const TensorView all = TensorView::contiguous(g.gate.global, DType::kF32, {g.gate.total, hidden}, device);
  return backend::fold_segment_partials(device, p.in.plan, all, p.d_gate, stream);
}

}  // namespace

Status sp_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params, Stream stream) {
  const bool modulated = params.in.shift.present() || params.in.scale.present();
  NormBackward norm;
  Status valid = validate_backward(comm, sp, params, modulated, params.in.x, "x", rowwise::validate_rmsnorm_backward);
  if (valid.ok()) valid = prepare_norm(sp, params, stream, &norm);
  const bool tables = modulated && (params.d_shift.present() || params.d_scale.present());
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, call_signature("sp_rmsnorm_backward", sp, params.in.x,
                                                          norm_call(params.in.numerics, modulated),
                                                          {params.d_weight.present(), tables})));
  return run_norm(comm, sp, norm, stream);
}

Status sp_gate_residual_backward(Communicator& comm, const SpPlan& sp, const GateResidualBackwardParams& params,
                                 Stream stream) {
  GateBackward gate;
  Status valid =
      validate_backward(comm, sp, params, true, params.grad, "grad", rowwise::validate_gate_residual_backward);
  if (valid.ok()) valid = prepare_gate(sp, params, stream, &gate);
  DETDIT_RETURN_IF_ERROR(
      comm.agree(valid, call_signature("sp_gate_residual_backward", sp, params.grad, "", {params.d_gate.present()})));
  return run_gate(comm, sp, gate, stream);
}

// Both halves validated, allocated and agreed as one call (one agreement), so
// neither half can fail on one rank after the other has written its outputs.
Status sp_gate_residual_rmsnorm_backward(Communicator& comm, const SpPlan& sp,
                                         const GateResidualRmsnormBackwardParams& params, Stream stream) {
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
