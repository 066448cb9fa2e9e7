// The device-generic backward compositions of the row-wise ops whose gradients
// sum over positions (docs/numerics.md 6.5): the backend's row-local half, the
// partials of every chunk (ChunkSelection{}) into FP32 scratch
// (src/common/scratch.h: host memory on the CPU, stream-ordered on CUDA), then
// the folds. One composition serves the CPU and CUDA, and the sequence-parallel
// region (src/parallel/sp_region.cc) runs the same halves on the chunks a rank
// owns and the same folds, so each order of operations is written once.
// rmsnorm's and gate_residual's compositions are declared here because
// final_adaln_out, gate_residual_rmsnorm and the SP region share them;
// adaln_row_gather's has one caller file and lives there (src/adaln.cc).
//
// Params must already be validated (rowwise/checks.h); nothing here checks.
#pragma once

#include <memory>

#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/layernorm.h"
#include "detdit/rmsnorm.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace rowwise {

// The FP32 scratch of rmsnorm's cross-row partials: d_weight's chunk partials
// (C, H) and the table segment partials (G, 2H) [d_shift | d_scale], each
// absent when its outputs are.
struct RmsnormPartials {
  std::shared_ptr<void> owner;
  TensorView weight, table;
};
Status allocate_rmsnorm_partials(const RmsnormBackwardParams& p, Stream stream, RmsnormPartials* partials);
// dx and the partials of every chunk: the halves (rows, then partials).
Status rmsnorm_rows_and_partials(const RmsnormBackwardParams& p, const RmsnormPartials& partials, Stream stream);

// rmsnorm_backward after validate_rmsnorm_backward: the partials' scratch,
// rows and partials, fold_rmsnorm_partials (also run by final_adaln_out).
Status run_rmsnorm_backward(const RmsnormBackwardParams& p, Stream stream);

// gate_residual's d_gate segment partials (G, H), absent without d_gate.
struct GatePartials {
  std::shared_ptr<void> owner;
  TensorView gate;
};
Status allocate_gate_partials(const GateResidualBackwardParams& p, Stream stream, GatePartials* partials);
// d_residual, d_y and the d_gate partials of every chunk: the halves (rows,
// then partials).
Status gate_rows_and_partials(const GateResidualBackwardParams& p, const GatePartials& partials, Stream stream);

// d_gate from the partials of every chunk (per group or per table row);
// nothing without d_gate.
Status fold_gate_partials(const GateResidualBackwardParams& p, const GatePartials& partials, Stream stream);

// gate_residual_backward after validate_gate_residual_backward: the scratch,
// rows and partials, the fold.
Status run_gate_residual_backward(const GateResidualBackwardParams& p, Stream stream);

// layernorm_backward after validate_layernorm_backward: the partials'
// scratch, dx, the partials, the folds (also run by gate_residual_layernorm;
// defined in src/layernorm.cc).
Status run_layernorm_backward(const LayernormBackwardParams& p, Stream stream);

// gate_residual_rmsnorm's inputs as its halves' (the norm of h, the gate).
RmsnormInputs norm_inputs(const GateResidualRmsnormInputs& in, const TensorView& h);
GateResidualInputs gate_inputs(const GateResidualRmsnormInputs& in);

// The halves of gate_residual_rmsnorm's backward (its WS1 and SP forms):
// the rmsnorm backward of d_out with dx into g, and the gate_residual
// backward of g (g: the gradient of h, d_residual or scratch).
RmsnormBackwardParams norm_backward(const GateResidualRmsnormBackwardParams& p, const TensorView& g);
GateResidualBackwardParams gate_backward(const GateResidualRmsnormBackwardParams& p, const TensorView& g);

// The grouped modulation forms' partials (numerics 6.11): chunks of 256
// counted from each group's first position, Cg = ceil(L / 256) per group,
// group g's at partial rows [g*Cg, (g+1)*Cg).
int64_t chunks_per_group(const ResolvedModulation& mod);
// The rows of a table-gradient partials scratch: G*Cg (grouped), the plan's
// segments (indexed), 0 (none).
int64_t table_partial_rows(const IndexPlan& plan, const ResolvedModulation& mod);

// d_shift / d_scale of a modulated norm from its [shift | scale] partials
// (rows, 2H): per group (grouped forms, fold_group_partials) or per table
// row over the plan's segments (indexed). Absent outputs are skipped, d_shift
// first. (rmsnorm and layernorm.)
Status fold_modulation_partials(const IndexPlan& plan, const ResolvedModulation& mod, const TensorView& table_partials,
                                const TensorView& d_shift, const TensorView& d_scale, Stream stream);

// d_weight = fold of the chunk partials (C, H); d_shift / d_scale = folds of
// the [shift | scale] column halves of the segment partials (G, 2H) over
// p.plan. Absent partials or outputs are skipped; p.d_weight first, then
// p.d_shift, then p.d_scale.
Status fold_rmsnorm_partials(const RmsnormBackwardParams& p, const TensorView& weight_partials,
                             const TensorView& table_partials, Stream stream);

}  // namespace rowwise
}  // namespace detdit
