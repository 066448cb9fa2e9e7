// The sp_region ops: rmsnorm (plain and modulated) and gate_residual under
// sequence parallelism, byte-equal to WS1 (contract in include/detdit/parallel.h,
// plan in sp_plan.cc, walk-through in docs/parallel.md).
//
// Forward = the public WS1 op on the local rows with the local plan.
// Backward =
//   1. validate locally, then agree across ranks (every rank fails together);
//   2. row-local gradients with the backends' *_rows halves (local plan);
//   3. ONE all-gather of the straddling rows: each rank packs its sent rows
//      (x, grad, rstd / grad, y) into a fixed send block of max_send rows; the
//      gathered blocks are unpacked per field into (world*max_send, ...) rows,
//      row owner*max_send + slot, as position_row expects;
//   4. the chunk owner computes its chunks' partials with the *_partials halves
//      (global plan, ChunkSelection of its chunks, ExtraRows) straight into
//      its send block, padded to the most chunks/segments any rank owns;
//   5. ONE all-gather of the partials, copied into global chunk/segment order;
//   6. every rank folds with the WS1 folds (rmsnorm: the same
//      rowwise::fold_rmsnorm_partials as the WS1 backward).
// Every bit is decided by the WS1 backends; this file only moves bytes.
#include <algorithm>
#include <initializer_list>
#include <string>
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

// ---------------------------------------------------------------- exchanges

// One field of the row exchange: own local rows of `row_bytes` each.
struct RowField {
  const void* rows;
  std::size_t row_bytes;
};

// Step 3: every rank's straddling rows, unpacked per field into
// (world*max_send) rows; extra[f] points at field f's rows (nullptr when no
// rank sends anything, then no collective runs: every rank knows max_send).
Status exchange_rows(Communicator& comm, const SpPlan::Impl& sp, const Device& device, DType dtype,
                     const std::vector<RowField>& fields, Stream stream, std::vector<void*>* extra,
                     std::shared_ptr<void>* owner) {
  extra->assign(fields.size(), nullptr);
  if (sp.max_send == 0) return Status();
  const std::size_t world = static_cast<std::size_t>(sp.world);
  const std::size_t max_send = static_cast<std::size_t>(sp.max_send);
  // Send block: field f at offset[f], max_send rows each.
  std::vector<std::size_t> offset(fields.size());
  std::size_t block = 0;
  for (std::size_t f = 0; f < fields.size(); ++f) {
    offset[f] = block;
    block += aligned_size(max_send * fields[f].row_bytes);
  }
  std::size_t unpacked = 0;
  for (const RowField& field : fields) unpacked += aligned_size(world * max_send * field.row_bytes);
  DETDIT_RETURN_IF_ERROR(allocate_scratch(device, block + world * block + unpacked, stream, owner));
  char* send = static_cast<char*>(owner->get());
  char* gathered = send + block;
  char* out = gathered + world * block;

  for (std::size_t f = 0; f < fields.size(); ++f) {
    const std::size_t rb = fields[f].row_bytes;
    for (const SpRun& run : sp.send_runs)
      DETDIT_RETURN_IF_ERROR(parallel_copy::copy(device, send + offset[f] + run.dst * rb,
                                                 static_cast<const char*>(fields[f].rows) + run.src * rb,
                                                 run.count * rb, stream));
  }
  // Slots past a rank's send count are never read (position_row never names them).
  DETDIT_RETURN_IF_ERROR(comm.all_gather(send, block, gathered, dtype, stream));
  for (std::size_t f = 0; f < fields.size(); ++f) {
    const std::size_t width = max_send * fields[f].row_bytes;
    DETDIT_RETURN_IF_ERROR(
        parallel_copy::copy_2d(device, out, width, gathered + offset[f], block, width, world, stream));
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

// What decides this rank's collectives: every rank must agree on it.
std::string call_signature(const char* op, const TensorView& rows, std::initializer_list<bool> gathered) {
  std::string signature = std::string(op) + "(" + dtype_name(rows.dtype) +
                          ", H=" + std::to_string(rows.rank > 0 ? rows.shape[rows.rank - 1] : 0) + ", gathers";
  for (bool g : gathered) signature += g ? " 1" : " 0";
  return signature + ")";
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

Status sp_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_comm(comm, sp));
  const bool modulated = params.in.shift.present() || params.in.scale.present();
  RmsnormBackwardParams local = params;
  local.in.plan = sp.local_plan();
  Status valid = check_global_plan(sp, params.in.plan, modulated);
  if (valid.ok()) valid = check_local_rows(sp, params.in.x, "x");
  if (valid.ok()) valid = rowwise::validate_rmsnorm_backward(local);
  const bool tables = modulated && (params.d_shift.present() || params.d_scale.present());
  DETDIT_RETURN_IF_ERROR(
      comm.agree(valid, call_signature("sp_rmsnorm_backward", params.in.x, {params.d_weight.present(), tables})));

  const Device device = params.in.x.device;
  DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_rows(device, local, stream));
  if (!params.d_weight.present() && !tables) return Status();

  const SpPlan::Impl& plan = sp.impl();
  const int64_t hidden = params.in.x.shape[params.in.x.rank - 1];
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(params.in.x.dtype);
  std::vector<void*> extra_rows;
  std::shared_ptr<void> rows_memory;
  DETDIT_RETURN_IF_ERROR(exchange_rows(comm, plan, device, params.in.x.dtype,
                                       {{params.in.x.data, row_bytes}, {params.grad.data, row_bytes},
                                        {params.rstd.data, sizeof(float)}},
                                       stream, &extra_rows, &rows_memory));
  const int64_t received = sp.world() * plan.max_send;
  ExtraRows extra;
  if (plan.max_send > 0) {
    extra.x = TensorView::contiguous(extra_rows[0], params.in.x.dtype, {received, hidden}, device);
    extra.grad = TensorView::contiguous(extra_rows[1], params.in.x.dtype, {received, hidden}, device);
    extra.rstd = TensorView::contiguous(extra_rows[2], DType::kF32, {received}, device);
  }

  PartialFamily weight{plan.max_chunks, plan.global.num_chunks(), hidden, &plan.chunk_runs};
  PartialFamily table{plan.max_segments, plan.global.num_segments(), 2 * hidden, &plan.segment_runs};
  std::vector<PartialFamily*> families;
  if (params.d_weight.present()) families.push_back(&weight);
  if (tables) families.push_back(&table);
  std::size_t block = 0;
  std::shared_ptr<void> partials_memory;
  DETDIT_RETURN_IF_ERROR(allocate_partials(plan, device, families, stream, &block, &partials_memory));

  RmsnormBackwardParams global = params;
  global.in.plan = plan.global;
  const SpPlan::RankTraffic& mine = plan.traffic[plan.rank];
  if (mine.chunks > 0) {
    TensorView weight_partials, table_partials;
    if (params.d_weight.present())
      weight_partials = TensorView::contiguous(weight.send, DType::kF32, {mine.chunks, hidden}, device);
    if (tables) table_partials = TensorView::contiguous(table.send, DType::kF32, {mine.segments, 2 * hidden}, device);
    const ChunkSelection sel = owned_selection(plan);
    DETDIT_RETURN_IF_ERROR(
        backend::rmsnorm_backward_partials(device, global, sel, extra, weight_partials, table_partials, stream));
  }
  DETDIT_RETURN_IF_ERROR(exchange_partials(comm, device, families, block, stream));

  TensorView weight_all, table_all;  // (C, H) chunk and (G, 2H) segment partials in global order
  if (params.d_weight.present())
    weight_all = TensorView::contiguous(weight.global, DType::kF32, {weight.total, hidden}, device);
  if (tables) table_all = TensorView::contiguous(table.global, DType::kF32, {table.total, 2 * hidden}, device);
  return rowwise::fold_rmsnorm_partials(global, weight_all, table_all, stream);
}

Status sp_gate_residual_backward(Communicator& comm, const SpPlan& sp, const GateResidualBackwardParams& params,
                                 Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_comm(comm, sp));
  GateResidualBackwardParams local = params;
  local.in.plan = sp.local_plan();
  Status valid = check_global_plan(sp, params.in.plan, true);
  if (valid.ok()) valid = check_local_rows(sp, params.grad, "grad");
  if (valid.ok()) valid = rowwise::validate_gate_residual_backward(local);
  DETDIT_RETURN_IF_ERROR(
      comm.agree(valid, call_signature("sp_gate_residual_backward", params.grad, {params.d_gate.present()})));

  const Device device = params.grad.device;
  DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_rows(device, local, stream));
  if (!params.d_gate.present()) return Status();

  const SpPlan::Impl& plan = sp.impl();
  const int64_t hidden = params.grad.shape[params.grad.rank - 1];
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(params.grad.dtype);
  std::vector<void*> extra_rows;
  std::shared_ptr<void> rows_memory;
  DETDIT_RETURN_IF_ERROR(exchange_rows(comm, plan, device, params.grad.dtype,
                                       {{params.grad.data, row_bytes}, {params.in.y.data, row_bytes}}, stream,
                                       &extra_rows, &rows_memory));
  const int64_t received = sp.world() * plan.max_send;
  ExtraRows extra;
  if (plan.max_send > 0) {
    extra.grad = TensorView::contiguous(extra_rows[0], params.grad.dtype, {received, hidden}, device);
    extra.y = TensorView::contiguous(extra_rows[1], params.grad.dtype, {received, hidden}, device);
  }

  PartialFamily gate{plan.max_segments, plan.global.num_segments(), hidden, &plan.segment_runs};
  std::size_t block = 0;
  std::shared_ptr<void> partials_memory;
  DETDIT_RETURN_IF_ERROR(allocate_partials(plan, device, {&gate}, stream, &block, &partials_memory));
  const SpPlan::RankTraffic& mine = plan.traffic[plan.rank];
  if (mine.chunks > 0) {
    GateResidualBackwardParams global = params;
    global.in.plan = plan.global;
    const TensorView partials = TensorView::contiguous(gate.send, DType::kF32, {mine.segments, hidden}, device);
    const ChunkSelection sel = owned_selection(plan);
    DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_partials(device, global, sel, extra, partials, stream));
  }
  DETDIT_RETURN_IF_ERROR(exchange_partials(comm, device, {&gate}, block, stream));
  const TensorView all = TensorView::contiguous(gate.global, DType::kF32, {gate.total, hidden}, device);
  return backend::fold_segment_partials(device, plan.global, all, params.d_gate, stream);
}

Status sp_gate_residual_rmsnorm_backward(Communicator& comm, const SpPlan& sp,
                                         const GateResidualRmsnormBackwardParams& params, Stream stream) {
  const GateResidualRmsnormBackwardParams& p = params;
  const GateResidualRmsnormInputs& in = p.in;
  // g, the gradient of h: d_residual when kept, else scratch (allocated
  // before the first collective, like the halves' own scratch).
  TensorView g = p.d_residual;
  std::shared_ptr<void> owner;
  if (!g.present() && p.h.present() && (p.d_y.present() || p.d_gate.present())) {
    g = p.h;
    DETDIT_RETURN_IF_ERROR(allocate_scratch(p.h.device, p.h.nbytes(), stream, &owner));
    g.data = owner.get();
  }
  const RmsnormBackwardParams norm{{p.h, in.weight, in.shift, in.scale, in.plan, in.eps, in.numerics},
                                   p.rstd,
                                   p.d_out,
                                   g,
                                   p.d_weight,
                                   p.d_shift,
                                   p.d_scale};
  DETDIT_RETURN_IF_ERROR(sp_rmsnorm_backward(comm, sp, norm, stream));
  if (!g.present()) return Status();
  if (p.d_h.present()) {
    DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.d_h, "d_h", p.h, "h"));
    DETDIT_RETURN_IF_ERROR(backend::add(g.device, g, p.d_h, g, stream));
  }
  return sp_gate_residual_backward(comm, sp, {{in.residual, in.y, in.gate, in.plan}, g, TensorView(), p.d_y, p.d_gate},
                                   stream);
}

}  // namespace detdit
