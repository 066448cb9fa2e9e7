// Public gate_residual_rmsnorm entry points (include/detdit/gate_residual_rmsnorm.h,
// docs/numerics.md 5.11, 6.10): validate both halves and the outputs against
// every input, allocate the scratch, then run the backend on the tensors'
// device. Nothing is written on error.
//
// Two routes, decided by the arguments before anything is checked:
//   - the H3 rule (h3_rule below: the indexed gate, shift and scale indexed
//     or absent, the modulation in the rows' dtype, upcast = false, no k): the
//     fused forward backend and the backward below, the kernels' own rule;
//   - every other call (the other forms, fp32 modulation, upcast, k, no
//     gate): the two ops' backends composed, as gate_residual_layernorm
//     composes its halves (src/rowwise/gate_residual_norm.h): gate_residual
//     into h, rmsnorm of h; the rmsnorm backward with dx into g,
//     g = R(rn(g + d_h)), the gate_residual backward of g. Each half is
//     validated for every form (its own messages, h named h), the one form
//     of the call checked, the overlaps checked once under the op's names.
// Both routes are the separate ops' bits, so the route changes no output.
//
// The H3 rule's backward is the composition autograd runs through the two
// ops, written once for both devices: the rmsnorm backward of d_out (dx, the
// partials of d_weight, d_shift, d_scale), g = R_T(rn(dx + d_h)), then the
// gate_residual backward of g (d_y, the d_gate partials), with d_residual = g
// itself (g lives in d_residual when the caller wants it); then the folds.
// Its kernel path, one rule (docs/ops.md), every path the same bits:
//   1. the row walk (src/cuda/gate_residual_rmsnorm_row_walk.cu), on CUDA
//      sm_90 and later, when the norm is modulated, the dtype is bf16 or fp16,
//      H is a multiple of 8 and at most 5632, every tensor is 16-byte aligned
//      (table row strides in whole 8-element vectors), every 256-position chunk
//      has at most 4 segments, there are at least as many chunks as SMs and the
//      staged rows fit the block's shared memory: one kernel per chunk over
//      whole rows, each tensor read once;
//   2. else the column-block walk, on CUDA, when the norm is modulated, H is a
//      multiple of 4, every row and table row is in whole 4-element vectors
//      and every chunk has at most 10 segments: each row's dx coefficient,
//      then one walk per chunk and 512 columns;
//   3. else (and always on the CPU) the halves: one rows call (g and d_y, h,
//      d_out and d_h read once), then the partials of both ops.
// The launch tunables region_row_walk and region_backward_walk (tests only)
// turn paths 1 and 2 off.
#include "detdit/gate_residual_rmsnorm.h"

#include <memory>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/gate_residual.h"
#include "detdit/modulation.h"
#include "detdit/rmsnorm.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"
#include "rowwise/gate_residual_norm.h"

namespace detdit {
namespace {

// The calls of the H3 rule (detdit/modulation.h), which the fused kernels
// implement: the indexed gate (a plan), shift and scale indexed or absent,
// every modulation tensor in the rows' dtype, upcast = false, no k. Decided
// from the arguments alone; the route's validation then checks them all.
bool h3_rule(const GateResidualRmsnormInputs& in) {
  const DType rows = in.y.dtype;
  const auto in_rows_dtype = [rows](const TensorView& m) { return !m.present() || m.dtype == rows; };
  return in.plan.valid() && in.gate.present() && in.gate.dtype == rows && in_rows_dtype(in.shift) &&
         in_rows_dtype(in.scale) && !in.upcast && !in.has_k;
}

// ---- every other call: the two ops composed

Status check_one_form(const GateResidualRmsnormInputs& in, const TensorView& h) {
  return rowwise::check_one_form(rowwise::gate_inputs(in), rowwise::rmsnorm_modulation(rowwise::norm_inputs(in, h)),
                                 in.shift);
}

Status validate_composed_forward(const GateResidualRmsnormParams& p) {
  const GateResidualRmsnormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(rowwise::check_region_h(p.h, in.residual, "residual", rowwise::gate_inputs(in)));
  DETDIT_RETURN_IF_ERROR(
      rowwise::check_gate_residual_forward_arguments({rowwise::gate_inputs(in), p.h}, rowwise::Forms::kAll));
  DETDIT_RETURN_IF_ERROR(check::present(p.rstd, "rstd"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_rmsnorm_forward_arguments({rowwise::norm_inputs(in, p.h), p.out, p.rstd},
                                                                  rowwise::Forms::kAll, "h"));
  DETDIT_RETURN_IF_ERROR(check_one_form(in, p.h));
  return rowwise::check_outputs_disjoint({{&in.residual, "residual"}, {&in.y, "y"}, {&in.gate, "gate"},
                                          {&in.weight, "weight"}, {&in.shift, "shift"}, {&in.scale, "scale"}},
                                         {{&p.h, "h"}, {&p.out, "out"}, {&p.rstd, "rstd"}});
}

// The gate half's backward params with the caller's d_residual (the H3
// route's rowwise::gate_backward leaves it to g).
GateResidualBackwardParams composed_gate_backward(const GateResidualRmsnormBackwardParams& p, const TensorView& g) {
  GateResidualBackwardParams gate = rowwise::gate_backward(p, g);
  gate.d_residual = p.d_residual;
  return gate;
}

Status validate_composed_backward(const GateResidualRmsnormBackwardParams& p) {
  const GateResidualRmsnormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(rowwise::check_region_h(p.h, in.y, "y", rowwise::gate_inputs(in)));
  DETDIT_RETURN_IF_ERROR(check::present(p.d_out, "d_out"));
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.d_h, "d_h", p.h, "h"));
  // The norm half without dx (g is internal), the gate half with h standing
  // for g (same shape and dtype), d_residual checked there.
  DETDIT_RETURN_IF_ERROR(rowwise::check_rmsnorm_backward_arguments(rowwise::norm_backward(p, TensorView()),
                                                                   rowwise::Forms::kAll, "h"));
  DETDIT_RETURN_IF_ERROR(
      rowwise::check_gate_residual_backward_arguments(composed_gate_backward(p, p.h), rowwise::Forms::kAll));
  DETDIT_RETURN_IF_ERROR(check_one_form(in, p.h));
  return rowwise::check_outputs_disjoint(
      {{&in.y, "y"}, {&in.gate, "gate"}, {&in.weight, "weight"}, {&in.shift, "shift"}, {&in.scale, "scale"},
       {&p.h, "h"}, {&p.rstd, "rstd"}, {&p.d_out, "d_out"}, {&p.d_h, "d_h"}},
      {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}, {&p.d_weight, "d_weight"},
       {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
}

Status composed_forward(const GateResidualRmsnormParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_composed_forward(p));
  const Device device = p.h.device;
  const GateResidualParams gate{rowwise::gate_inputs(p.in), p.h};
  const RmsnormParams norm{rowwise::norm_inputs(p.in, p.h), p.out, p.rstd};
  DETDIT_RETURN_IF_ERROR(backend::gate_residual_forward(device, gate, stream));
  return backend::rmsnorm_forward(device, norm, stream);
}

Status composed_backward(const GateResidualRmsnormBackwardParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_composed_backward(p));
  return rowwise::run_region_backward(
      composed_gate_backward(p, TensorView()), p.h, p.d_h,
      [&](const TensorView& g) { return rowwise::run_rmsnorm_backward(rowwise::norm_backward(p, g), stream); },
      stream);
}

// ---- the H3 rule

// The halves' validations name the tensors as the separate ops do (x, out,
// grad, dx); the fused op's own names are checked first (h as the norm's x
// included), so its errors name them, and the outputs' overlaps are checked
// once, under its own names.
Status validate_forward(const GateResidualRmsnormParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(rowwise::check_rows(p.in.residual, "residual", &p.in.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.h, "h", p.in.residual, "residual"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_norm_aligned(p.h, "h"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.out, "out", p.in.residual, "residual"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_gate_residual_forward_arguments({rowwise::gate_inputs(p.in), p.h}));
  DETDIT_RETURN_IF_ERROR(check::present(p.rstd, "rstd"));
  DETDIT_RETURN_IF_ERROR(
      rowwise::check_rmsnorm_forward_arguments({rowwise::norm_inputs(p.in, p.h), p.out, p.rstd},
                                               rowwise::Forms::kIndexedOnly, "h"));
  const GateResidualRmsnormInputs& in = p.in;
  return rowwise::check_outputs_disjoint({{&in.residual, "residual"}, {&in.y, "y"}, {&in.gate, "gate"},
                                          {&in.weight, "weight"}, {&in.shift, "shift"}, {&in.scale, "scale"}},
                                         {{&p.h, "h"}, {&p.out, "out"}, {&p.rstd, "rstd"}});
}

}  // namespace

namespace rowwise {

Status validate_gate_residual_rmsnorm_backward(const GateResidualRmsnormBackwardParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check_rows(p.h, "h", &p.in.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(check_norm_aligned(p.h, "h"));
  DETDIT_RETURN_IF_ERROR(check_like(p.d_out, "d_out", p.h, "h"));
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(check_like(p.d_h, "d_h", p.h, "h"));
  if (p.d_residual.present()) DETDIT_RETURN_IF_ERROR(check_like(p.d_residual, "d_residual", p.h, "h"));
  DETDIT_RETURN_IF_ERROR(
      check_rmsnorm_backward_arguments(norm_backward(p, p.d_residual), Forms::kIndexedOnly, "h"));
  GateResidualBackwardParams gate = gate_backward(p, p.d_out);
  gate.d_residual = p.d_residual;
  DETDIT_RETURN_IF_ERROR(check_gate_residual_backward_arguments(gate));
  const GateResidualRmsnormInputs& in = p.in;
  return check_outputs_disjoint(
      {{&in.y, "y"}, {&in.gate, "gate"}, {&in.weight, "weight"}, {&in.shift, "shift"}, {&in.scale, "scale"},
       {&p.h, "h"}, {&p.rstd, "rstd"}, {&p.d_out, "d_out"}, {&p.d_h, "d_h"}},
      {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}, {&p.d_weight, "d_weight"},
       {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
}

}  // namespace rowwise

Status gate_residual_rmsnorm_forward(const GateResidualRmsnormParams& params, Stream stream) {
  if (!h3_rule(params.in)) return composed_forward(params, stream);
  DETDIT_RETURN_IF_ERROR(validate_forward(params));
  return backend::gate_residual_rmsnorm_forward(params.h.device, params, stream);
}

Status gate_residual_rmsnorm_backward(const GateResidualRmsnormBackwardParams& params, Stream stream) {
  if (!h3_rule(params.in)) return composed_backward(params, stream);
  DETDIT_RETURN_IF_ERROR(rowwise::validate_gate_residual_rmsnorm_backward(params));
  const GateResidualRmsnormBackwardParams& p = params;
  const Device device = p.h.device;
  // Scratch first, so a failed allocation writes nothing: the partials of both
  // halves, and g (the gradient of h) when the caller does not keep it in
  // d_residual yet d_y or d_gate need it (the halves only).
  rowwise::RmsnormPartials norm_partials;
  rowwise::GatePartials gate_partials;
  DETDIT_RETURN_IF_ERROR(rowwise::allocate_rmsnorm_partials(rowwise::norm_backward(p, p.d_residual), stream, &norm_partials));
  DETDIT_RETURN_IF_ERROR(rowwise::allocate_gate_partials(rowwise::gate_backward(p, p.d_out), stream, &gate_partials));
  // Paths 1 and 2 of the rule above (the CUDA launcher picks between them),
  // else the halves.
  bool launched = false;
  if (device.is_cuda())
    DETDIT_RETURN_IF_ERROR(cuda::gate_residual_rmsnorm_backward_walk(p, norm_partials.weight, norm_partials.table,
                                                                     gate_partials.gate, stream, &launched));
  TensorView g = p.d_residual;
  if (!launched) {
    std::shared_ptr<void> owner;
    if (!g.present() && (p.d_y.present() || p.d_gate.present())) {
      g = p.h;
      DETDIT_RETURN_IF_ERROR(allocate_scratch(device, p.h.nbytes(), stream, &owner));
      g.data = owner.get();
    }
    if (g.present()) DETDIT_RETURN_IF_ERROR(backend::gate_residual_rmsnorm_backward_rows(device, p, g, stream));
    const ChunkSelection every_chunk;
    if (norm_partials.weight.present() || norm_partials.table.present())
      DETDIT_RETURN_IF_ERROR(backend::rmsnorm_backward_partials(device, rowwise::norm_backward(p, g), every_chunk, ExtraRows{},
                                                                norm_partials.weight, norm_partials.table, stream));
    if (gate_partials.gate.present())
      DETDIT_RETURN_IF_ERROR(backend::gate_residual_backward_partials(device, rowwise::gate_backward(p, g), every_chunk,
                                                                      ExtraRows{}, gate_partials.gate, stream));
  }
  DETDIT_RETURN_IF_ERROR(rowwise::fold_rmsnorm_partials(rowwise::norm_backward(p, g), norm_partials.weight,
                                                        norm_partials.table, stream));
  if (!p.d_gate.present()) return Status();
  return backend::fold_segment_partials(device, p.in.plan, gate_partials.gate, p.d_gate, stream);
}

}  // namespace detdit
