// Validation shared by the row-wise ops (adaln_row_gather, rmsnorm,
// gate_residual, gate_residual_rmsnorm, final_adaln_out, adaln_modulation) and the
// sequence-parallel region (src/parallel/sp_region.cc). Every function returns a Status
// naming the argument, what was expected and what was got; the ops run them
// all before writing anything.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/layernorm.h"
#include "detdit/plan.h"
#include "detdit/rmsnorm.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace rowwise {

// Activation rows: present, fp32/bf16/fp16, (M, H) or (B, S, H), contiguous,
// non-empty; with a plan, M = plan.positions() (and B, S match for 3-D).
// *hidden receives H.
Status check_rows(const TensorView& t, const char* name, const IndexPlan* plan, int64_t* hidden);
// `t` has `ref`'s dtype, shape and device and is contiguous.
Status check_like(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name);
// As check_like, with `dtype` for t's dtype instead of ref's (`why` says
// where it comes from, for the TypeError).
Status check_like_as(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name, DType dtype,
                     const char* why);
// A (rows, hidden) table view with unit column stride on `ref`'s device,
// dtype in `allowed` (rows < 0: any row count).
Status check_table(const TensorView& t, const char* name, int64_t rows, int64_t hidden, const TensorView& ref,
                   const char* ref_name, std::initializer_list<DType> allowed);
// A gradient output: (rows, hidden) fp32 or `dtype`, unit column stride, on
// `ref`'s device, rows that overlap no other row (row stride >= hidden).
Status check_table_grad(const TensorView& t, const char* name, int64_t rows, int64_t hidden, DType dtype,
                        const TensorView& ref, const char* ref_name);
// Each present output overlaps no input and no other output (absent views pass).
using Named = std::pair<const TensorView*, const char*>;
Status check_outputs_disjoint(std::initializer_list<Named> inputs, std::initializer_list<Named> outputs);
// eps finite and > 0.
Status check_eps(float eps);
// Aligned to 4 elements, as PyTorch's vectorized RMSNorm path reads x, weight
// and out (numerics.md 7).
Status check_norm_aligned(const TensorView& t, const char* name);

// The output (or grad) `t` of a modulated op on rows `ref`: ref's shape and
// device, contiguous, dtype modulated_out_dtype (modulation.h). An fp32
// modulation with t in the rows' dtype (upcast = false) is reported as the
// modulation's error (`m_name` must have the rows' dtype), the way the op
// was called before fp32 modulation existed.
Status check_modulated_out(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name,
                           const ResolvedModulation& mod, bool upcast, const char* m_name);

// Which modulation an entry point takes: the public rmsnorm and gate_residual
// every form and recipe (detdit/modulation.h); the fused kernels' routes and the
// sequence-parallel region the H3 rule only: the indexed form (the modulation in
// x's dtype, upcast = false, no k), which is what their kernels implement.
enum class Forms { kIndexedOnly, kAll };

// The complete validation of the public entry points, each in two steps: the
// arguments one by one (`check_*_arguments`), then every output against
// every input and output (`validate_*` runs both). A fused op (final_adaln_out,
// adaln_modulation, gate_residual_rmsnorm) runs its halves' first steps, then
// the second step once over its own arguments under its own names, so that an
// overlap is reported as the caller's tensors (h, table, d_norm_weight), never
// as a half's (x, rows, d_weight).
// The argument steps of the norms take the name their errors give x: a fused
// op's norm half reads its h as x, and its errors name h.
Status check_rmsnorm_forward_arguments(const RmsnormParams& p, Forms forms = Forms::kIndexedOnly,
                                       const char* x_name = "x");
Status check_rmsnorm_backward_arguments(const RmsnormBackwardParams& p, Forms forms = Forms::kIndexedOnly,
                                        const char* x_name = "x");
Status validate_rmsnorm_forward(const RmsnormParams& p, Forms forms = Forms::kIndexedOnly);
Status validate_rmsnorm_backward(const RmsnormBackwardParams& p, Forms forms = Forms::kIndexedOnly);
// The gather backward's grad and d_rows (also run by adaln_modulation).
Status validate_adaln_row_gather_backward(const AdalnRowGatherBackwardParams& p);
// The backward's validation is also run by sp_gate_residual_backward on the
// local rows with the local plan.
Status check_gate_residual_forward_arguments(const GateResidualParams& p, Forms forms = Forms::kIndexedOnly);
Status check_gate_residual_backward_arguments(const GateResidualBackwardParams& p, Forms forms = Forms::kIndexedOnly);
Status validate_gate_residual_forward(const GateResidualParams& p, Forms forms = Forms::kIndexedOnly);
Status validate_gate_residual_backward(const GateResidualBackwardParams& p, Forms forms = Forms::kIndexedOnly);
// The fused backward's: both halves, the fused op's own names first, every
// output against every input and output (also run by
// sp_gate_residual_rmsnorm_backward on the local rows with the local plan).
Status validate_gate_residual_rmsnorm_backward(const GateResidualRmsnormBackwardParams& p);

// layernorm's, in the same two steps (its run after validation:
// rowwise/backward.h run_layernorm_backward). gate_residual_layernorm runs
// the argument steps of both halves, then its own overlap check.
Status check_layernorm_forward_arguments(const LayernormParams& p, const char* x_name = "x");
Status check_layernorm_backward_arguments(const LayernormBackwardParams& p, const char* x_name = "x");
Status validate_layernorm_forward(const LayernormParams& p);
Status validate_layernorm_backward(const LayernormBackwardParams& p);

// The resolved modulation of validated inputs (resolve_modulation, which
// cannot fail on them).
ResolvedModulation rmsnorm_modulation(const RmsnormInputs& in);
ResolvedModulation gate_modulation(const GateResidualInputs& in);
ResolvedModulation layernorm_modulation(const LayernormInputs& in);

}  // namespace rowwise
}  // namespace detdit
