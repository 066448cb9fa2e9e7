// What the sp_region's two halves share (include/detdit/parallel.h): the
// indexed form and the plain norm on an index (sp_region.cc) and the grouped
// modulation forms (sp_forms.cc) validate the call's communicator, plan and
// rows, and move straddling rows, with the same functions. Internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "detdit/comm.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/parallel.h"
#include "detdit/rmsnorm.h"
#include "parallel/sp_plan_impl.h"

namespace detdit {
namespace sp_detail {

constexpr std::size_t kAlign = 256;  // every scratch piece starts on a 256-byte boundary
std::size_t aligned_size(std::size_t bytes);

// The communicator is the SpPlan's rank of its world.
Status check_comm(const Communicator& comm, const SpPlan& sp);
// plan is the plan the SpPlan was built from, or absent where not `required`.
Status check_global_plan(const SpPlan& sp, const IndexPlan& plan, bool required);
// t is this rank's local rows: (B, S_local, H) or (B*S_local, H).
Status check_local_rows(const SpPlan& sp, const TensorView& t, const char* name);

// The row exchange's buffers: the send block (field f's max_send rows at
// offset[f]), the world gathered blocks and each field's (world*max_send)
// unpacked rows. Empty when no rank sends a row (every rank knows max_send).
struct RowExchange {
  std::vector<std::size_t> row_bytes, offset;
  std::size_t block = 0;
  std::shared_ptr<void> memory;
};
Status allocate_rows(int world, int64_t max_send, const Device& device, std::vector<std::size_t> row_bytes,
                     Stream stream, RowExchange* x);
// ONE all-gather of every rank's sent rows (send_runs: this rank's rows into
// its block of max_send slots) of each field (rows[f]: this rank's local
// rows), unpacked: (*extra)[f] holds field f's rows, row owner*max_send +
// slot (nullptr when max_send is 0: then no collective runs).
Status exchange_rows(Communicator& comm, const std::vector<SpRun>& send_runs, int64_t max_send, const Device& device,
                     DType dtype, const std::vector<const void*>& rows, const RowExchange& x, Stream stream,
                     std::vector<void*>* extra);

// The grouped forms (sp_forms.cc) take a call without an index plan: a
// per-sample, per-frame or per-token modulation (`modulated`), or an SpPlan
// built without an index (a plain norm, a plain residual add).
bool forms_call(const SpPlan& sp, const IndexPlan& call_plan, bool modulated);
Status forms_rmsnorm_forward(const SpPlan& sp, const RmsnormParams& params, Stream stream);
Status forms_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params,
                              Stream stream);
Status forms_gate_residual_forward(const SpPlan& sp, const GateResidualParams& params, Stream stream);
Status forms_gate_residual_backward(Communicator& comm, const SpPlan& sp, const GateResidualBackwardParams& params,
                                    Stream stream);

// The indexed form beyond the H3 rule (an fp32 table, upcast, k; sp_forms.cc):
// the WS1 partials halves on the plan of each rank's own chunks.
bool h3_rule(const RmsnormInputs& in);
bool h3_rule(const GateResidualInputs& in);
Status indexed_recipe_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params,
                                       Stream stream);
Status indexed_recipe_gate_residual_backward(Communicator& comm, const SpPlan& sp,
                                             const GateResidualBackwardParams& params, Stream stream);

// gate_residual_rmsnorm beyond the H3 rule (the WS1 op's own rule, h3_rule):
// every grouped form, the indexed form with an fp32 table, upcast or k, no
// gate; the composition of the SP halves above (sp_forms.cc).
bool h3_rule(const GateResidualRmsnormInputs& in);
Status recipe_gate_residual_rmsnorm_forward(const SpPlan& sp, const GateResidualRmsnormParams& params, Stream stream);
Status recipe_gate_residual_rmsnorm_backward(Communicator& comm, const SpPlan& sp,
                                             const GateResidualRmsnormBackwardParams& params, Stream stream);

}  // namespace sp_detail
}  // namespace detdit
