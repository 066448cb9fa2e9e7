// The device-generic backward compositions of the row-wise ops
// (src/rowwise/backward.h): the scratch, the backend's halves, the folds.
#include "rowwise/backward.h"

#include <memory>
#include <utility>

#include "common/backends.h"
#include "common/scratch.h"
#include "detdit/plan.h"
#include "rowwise/checks.h"

namespace detdit {
namespace rowwise {

Status fold_rmsnorm_partials(const RmsnormBackwardParams& p, const TensorView& weight_partials,
                             const TensorView& table_partials, Stream stream) {
  const Device device = p.in.x.device;
  if (p.d_weight.present())
    DETDIT_RETURN_IF_ERROR(backend::fold_chunk_partials(device, weight_partials, p.d_weight, stream));
  if (!table_partials.present()) return Status();
  return fold_modulation_partials(p.in.plan, rmsnorm_modulation(p.in), table_partials, p.d_shift, p.d_scale, stream);
}

Status fold_modulation_partials(const IndexPlan& plan, const ResolvedModulation& mod, const TensorView& table_partials,
                                const TensorView& d_shift, const TensorView& d_scale, Stream stream) {
  const Device device = table_partials.device;
  const int64_t hidden = table_partials.shape[1] / 2;
  // d_shift from columns [0, H), d_scale from [H, 2H) of the (G, 2H) partials.
  const std::pair<const TensorView*, int64_t> outputs[] = {{&d_shift, 0}, {&d_scale, hidden}};
  for (const auto& [out, column] : outputs) {
    if (!out->present()) continue;
    const TensorView part = table_partials.narrow(1, column, hidden);
    if (mod.grouped())
      DETDIT_RETURN_IF_ERROR(backend::fold_group_partials(device, part, chunks_per_group(mod), mod, *out, stream));
    else
      DETDIT_RETURN_IF_ERROR(backend::fold_segment_partials(device, plan, part, *out, stream));
  }
  return Status();
}

int64_t chunks_per_group(const ResolvedModulation& mod) {
  return (mod.frame_len + kReductionChunk - 1) / kReductionChunk;
}

int64_t table_partial_rows(const IndexPlan& plan, const ResolvedModulation& mod) {
  if (mod.grouped()) return mod.groups() * chunks_per_group(mod);
  return mod.form == ModulationForm::kIndexed ? plan.num_segments() : 0;
}

Status allocate_rmsnorm_partials(const RmsnormBackwardParams& p, Stream stream, RmsnormPartials* partials) {
  const Device device = p.in.x.device;
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  // positions: the plan's B*S; a plain norm without a plan reduces its own rows.
  const int64_t positions = p.in.plan.valid() ? p.in.plan.positions() : p.in.x.numel() / hidden;
  const int64_t chunks = (positions + kReductionChunk - 1) / kReductionChunk;
  const bool tables = p.in.shift.present() && (p.d_shift.present() || p.d_scale.present());
  const int64_t table_rows = tables ? table_partial_rows(p.in.plan, rmsnorm_modulation(p.in)) : 0;
  const int64_t weight_floats = p.d_weight.present() ? chunks * hidden : 0;
  const int64_t table_floats = table_rows * 2 * hidden;
  *partials = RmsnormPartials();
  if (weight_floats + table_floats == 0) return Status();
  TensorView scratch;
  DETDIT_RETURN_IF_ERROR(
      scratch_tensor(device, DType::kF32, {weight_floats + table_floats}, stream, &partials->owner, &scratch));
  if (p.d_weight.present())
    partials->weight = TensorView::contiguous(scratch.ptr<float>(), DType::kF32, {chunks, hidden}, device);
  if (tables)
    partials->table = TensorView::contiguous(scratch.ptr<float>() + weight_floats, DType::kF32,
                                             {table_rows, 2 * hidden}, device);
  return Status();
}

Status rmsnorm_rows_and_partials(const RmsnormBackwardParams& p, const RmsnormPartials& partials, Stream stream) {
  const Device device = p.in.x.device;
  DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_rows(device, p, stream));
  if (!partials.weight.present() && !partials.table.present()) return Status();
  const ChunkSelection every_chunk;
  return backend::rmsnorm_backward_partials(device, p, every_chunk, ExtraRows{}, partials.weight, partials.table,
                                            stream);
}

Status run_rmsnorm_backward(const RmsnormBackwardParams& p, Stream stream) {
  // The scratch first, so a failed allocation writes nothing.
  RmsnormPartials partials;
  DETDIT_RETURN_IF_ERROR(allocate_rmsnorm_partials(p, stream, &partials));
  DETDIT_RETURN_IF_ERROR(rmsnorm_rows_and_partials(p, partials, stream));
  return fold_rmsnorm_partials(p, partials.weight, partials.table, stream);
}

Status allocate_gate_partials(const GateResidualBackwardParams& p, Stream stream, GatePartials* partials) {
  *partials = GatePartials();
  if (!p.d_gate.present()) return Status();
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  return scratch_tensor(p.grad.device, DType::kF32, {table_partial_rows(p.in.plan, gate_modulation(p.in)), hidden},
                        stream, &partials->owner, &partials->gate);
}

Status gate_rows_and_partials(const GateResidualBackwardParams& p, const GatePartials& partials, Stream stream) {
  const Device device = p.grad.device;
  DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_rows(device, p, stream));
  if (!partials.gate.present()) return Status();
  const ChunkSelection every_chunk;
  return backend::gate_residual_backward_partials(device, p, every_chunk, ExtraRows{}, partials.gate, stream);
}

Status run_gate_residual_backward(const GateResidualBackwardParams& p, Stream stream) {
  // The scratch first, so a failed allocation writes nothing.
  GatePartials partials;
  DETDIT_RETURN_IF_ERROR(allocate_gate_partials(p, stream, &partials));
  DETDIT_RETURN_IF_ERROR(gate_rows_and_partials(p, partials, stream));
  return fold_gate_partials(p, partials, stream);
}

Status fold_gate_partials(const GateResidualBackwardParams& p, const GatePartials& partials, Stream stream) {
  if (!p.d_gate.present()) return Status();
  const ResolvedModulation mod = gate_modulation(p.in);
  if (mod.grouped())
    return backend::fold_group_partials(p.grad.device, partials.gate, chunks_per_group(mod), mod, p.d_gate, stream);
  return backend::fold_segment_partials(p.grad.device, p.in.plan, partials.gate, p.d_gate, stream);
}

RmsnormInputs norm_inputs(const GateResidualRmsnormInputs& in, const TensorView& h) {
  return RmsnormInputs{h, in.weight, in.shift, in.scale, in.plan, in.eps, in.numerics, in.upcast};
}

GateResidualInputs gate_inputs(const GateResidualRmsnormInputs& in) {
  return GateResidualInputs{in.residual, in.y, in.gate, in.plan, in.has_k, in.k, in.upcast};
}

RmsnormBackwardParams norm_backward(const GateResidualRmsnormBackwardParams& p, const TensorView& g) {
  return RmsnormBackwardParams{norm_inputs(p.in, p.h), p.rstd,    p.d_out,  g, p.d_weight,
                               p.d_shift,                p.d_scale};
}

GateResidualBackwardParams gate_backward(const GateResidualRmsnormBackwardParams& p, const TensorView& g) {
  return GateResidualBackwardParams{gate_inputs(p.in), g, TensorView(), p.d_y, p.d_gate};
}

}  // namespace rowwise
}  // namespace detdit
