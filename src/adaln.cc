// Public entry points of adaln_row_gather, adaln_modulation and
// final_adaln_out (include/detdit/adaln.h, docs/ops.md): validate every
// argument, then dispatch on the tensors' device (the cross-row backwards
// through device-generic compositions of the backend's halves). Nothing is
// written on error.
#include "detdit/adaln.h"

#include <memory>
#include <string>

#include "common/backends.h"
#include "common/projection.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace rowwise {
namespace {

// rows (R, 6H): float, unit column stride, R = plan.num_rows(), on the plan's device.
Status check_gather_rows(const TensorView& rows, const char* name, const IndexPlan& plan, DType dtype,
                         int64_t* hidden) {
  DETDIT_RETURN_IF_ERROR(check::present(rows, name));
  DETDIT_RETURN_IF_ERROR(check::dtype(rows, name, {DType::kF32, DType::kBF16, DType::kF16}));
  if (rows.dtype != dtype)
    return Status::type_error(std::string(name) + " must be " + dtype_name(dtype) + ", got " + dtype_name(rows.dtype));
  DETDIT_RETURN_IF_ERROR(check::rank(rows, name, 2, "(R, 6H)"));
  DETDIT_RETURN_IF_ERROR(check::plan_on(plan, "plan", rows, name));
  if (rows.shape[0] != plan.num_rows())
    return Status::value_error(std::string(name) + " must have R = plan.num_rows() = " +
                               std::to_string(plan.num_rows()) + " rows, got " + rows.describe());
  if (rows.shape[1] <= 0 || rows.shape[1] % kAdalnChunks != 0)
    return Status::value_error(std::string(name) + " width must be 6 * H with H >= 1, got " + rows.describe());
  *hidden = rows.shape[1] / kAdalnChunks;
  return check::unit_column_stride(rows, name);
}

Status check_adaln_row_gather_forward_arguments(const AdalnRowGatherParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check::present(p.rows, "rows"));
  DETDIT_RETURN_IF_ERROR(check_gather_rows(p.rows, "rows", p.plan, p.rows.dtype, &hidden));
  DETDIT_RETURN_IF_ERROR(check::present(p.out, "out"));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(p.out, "out", p.rows, "rows"));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.out, "out", p.rows, "rows"));
  if (p.out.rank != 3 || p.out.shape[0] != kAdalnChunks || p.out.shape[1] != p.plan.seq_len() ||
      p.out.shape[2] != hidden)
    return Status::value_error("out must be (6, S, H) with S = plan.seq_len() = " + std::to_string(p.plan.seq_len()) +
                               ", H = rows width / 6 = " + std::to_string(hidden) + ", got " + p.out.describe());
  return check::contiguous(p.out, "out");
}

Status validate_adaln_row_gather_forward(const AdalnRowGatherParams& p) {
  DETDIT_RETURN_IF_ERROR(check_adaln_row_gather_forward_arguments(p));
  return check_outputs_disjoint({{&p.rows, "rows"}}, {{&p.out, "out"}});
}

}  // namespace

namespace {

// The gather backward's grad (6, B*S, H) or (6, B, S, H) against its plan
// (also adaln_modulation's, before it takes the d_rows scratch).
Status check_gather_grad(const TensorView& grad, const IndexPlan& plan) {
  DETDIT_RETURN_IF_ERROR(check::present(grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::dtype(grad, "grad", {DType::kF32, DType::kBF16, DType::kF16}));
  DETDIT_RETURN_IF_ERROR(check::plan_on(plan, "plan", grad, "grad"));
  const int64_t batch = plan.batch(), seq_len = plan.seq_len();
  const bool shape_ok =
      grad.shape[0] == kAdalnChunks && grad.shape[grad.rank - 1] >= 1 &&
      ((grad.rank == 3 && grad.shape[1] == batch * seq_len) ||
       (grad.rank == 4 && grad.shape[1] == batch && grad.shape[2] == seq_len));
  if (!shape_ok)
    return Status::value_error("grad must be (6, B*S, H) or (6, B, S, H) with S = plan.seq_len() = " +
                               std::to_string(seq_len) + ", B = plan.batch() = " + std::to_string(batch) + ", got " +
                               grad.describe());
  return check::contiguous(grad, "grad");
}

}  // namespace

Status validate_adaln_row_gather_backward(const AdalnRowGatherBackwardParams& p) {
  DETDIT_RETURN_IF_ERROR(check_gather_grad(p.grad, p.plan));
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  DETDIT_RETURN_IF_ERROR(check::present(p.d_rows, "d_rows"));
  DETDIT_RETURN_IF_ERROR(check::dtype(p.d_rows, "d_rows", {DType::kF32, p.grad.dtype}));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.d_rows, "d_rows", p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::shape(p.d_rows, "d_rows", {p.plan.num_rows(), kAdalnChunks * hidden}, "(R, 6H)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_rows, "d_rows"));
  return check_outputs_disjoint({{&p.grad, "grad"}}, {{&p.d_rows, "d_rows"}});
}

namespace {

// The canonical reduction of d_rows (numerics 6.6): the backend's segment
// partials (G, 6H) of every chunk into FP32 scratch, then
// fold_segment_partials, cast once to d_rows' dtype. Params already validated.
Status run_row_gather_backward(const AdalnRowGatherBackwardParams& p, Stream stream) {
  const Device device = p.grad.device;
  std::shared_ptr<void> owner;
  TensorView partials;
  DETDIT_RETURN_IF_ERROR(
      scratch_tensor(device, DType::kF32, {p.plan.num_segments(), p.d_rows.shape[1]}, stream, &owner, &partials));
  DETDIT_RETURN_IF_ERROR(backend::adaln_row_gather_backward_partials(device, p, partials, stream));
  return backend::fold_segment_partials(device, p.plan, partials, p.d_rows, stream);
}

// The (3T, 6H) rows view of a contiguous (T, 18H) table (adaln.h).
TensorView rows_view(const TensorView& table) {
  return TensorView::contiguous(table.data, table.dtype, {3 * table.shape[0], table.shape[1] / 3}, table.device);
}

// The plan of the fused ops indexes the table: R must equal `rows`.
Status check_plan_rows(const IndexPlan& plan, const TensorView& ref, const char* ref_name, int64_t rows,
                       const char* what) {
  DETDIT_RETURN_IF_ERROR(check::plan_on(plan, "plan", ref, ref_name));
  if (plan.num_rows() != rows)
    return Status::value_error("plan must have R = " + std::string(what) + " = " + std::to_string(rows) +
                               " table rows, got R = " + std::to_string(plan.num_rows()));
  return Status();
}

// Shift / scale of a final_adaln_out table (T, 2H): shift first.
TensorView table_half(const TensorView& table, int64_t hidden, int half) {
  return table.narrow(1, half * hidden, hidden);
}

// The (T, N) fp32 scratch gradient of the table, taken once every argument
// has passed: T and N then agree with act, grad and the plan, so a temb or
// weight whose shape no other argument backs never sizes it.
Status table_grad_scratch(const TensorView& temb, const TensorView& weight, Stream stream,
                          std::shared_ptr<void>* owner, TensorView* view) {
  return scratch_tensor(temb.device, DType::kF32, {temb.shape[0], weight.shape[0]}, stream, owner, view);
}

}  // namespace

}  // namespace rowwise

Status adaln_row_gather_forward(const AdalnRowGatherParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_adaln_row_gather_forward(params));
  return backend::adaln_row_gather_forward(params.rows.device, params, stream);
}

Status adaln_row_gather_backward(const AdalnRowGatherBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_adaln_row_gather_backward(params));
  return rowwise::run_row_gather_backward(params, stream);
}

// ---- adaln_modulation: projection + gather (numerics 5.9, 6.9) ----------------

namespace {

Status validate_modulation_forward(const AdalnModulationParams& p) {
  DETDIT_RETURN_IF_ERROR(check::present(p.table, "table"));
  DETDIT_RETURN_IF_ERROR(check::present(p.act, "act"));
  DETDIT_RETURN_IF_ERROR(validate_projection_forward(p.in.temb, p.in.weight, p.in.bias, p.table, p.act, p.in.numerics));
  if (p.in.weight.shape[0] % (3 * kAdalnChunks) != 0)
    return Status::value_error("weight must be (6 * H * 3, D); got " + p.in.weight.shape_string() +
                               ", whose first dim is not a multiple of 18");
  DETDIT_RETURN_IF_ERROR(rowwise::check_plan_rows(p.in.plan, p.in.temb, "temb", 3 * p.in.temb.shape[0], "3T"));
  AdalnRowGatherParams gather{rowwise::rows_view(p.table), p.in.plan, p.out};
  DETDIT_RETURN_IF_ERROR(rowwise::check_adaln_row_gather_forward_arguments(gather));
  return rowwise::check_outputs_disjoint(
      {{&p.in.temb, "temb"}, {&p.in.weight, "weight"}, {&p.in.bias, "bias"}, {&p.table, "table"}, {&p.act, "act"}},
      {{&p.out, "out"}});
}

}  // namespace

Status adaln_modulation_forward(const AdalnModulationParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_modulation_forward(params));
  DETDIT_RETURN_IF_ERROR(projection_forward(params.in.temb, params.in.weight, params.in.bias, params.table, params.act,
                                            params.in.numerics, stream));
  AdalnRowGatherParams gather{rowwise::rows_view(params.table), params.in.plan, params.out};
  return backend::adaln_row_gather_forward(params.table.device, gather, stream);
}

Status adaln_modulation_backward(const AdalnModulationBackwardParams& params, Stream stream) {
  const AdalnModulationBackwardParams& p = params;
  // Every argument first; the projection's grad_table is the op's own d_table scratch.
  DETDIT_RETURN_IF_ERROR(validate_projection_backward(p.in.temb, p.in.weight, p.act, TensorView(), p.d_temb,
                                                      p.d_weight, p.d_bias, p.in.numerics));
  if (p.in.weight.shape[0] % (3 * kAdalnChunks) != 0)
    return Status::value_error("weight must be (6 * H * 3, D); got " + p.in.weight.shape_string() +
                               ", whose first dim is not a multiple of 18");
  DETDIT_RETURN_IF_ERROR(rowwise::check_plan_rows(p.in.plan, p.in.temb, "temb", 3 * p.in.temb.shape[0], "3T"));
  DETDIT_RETURN_IF_ERROR(check::present(p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(p.grad, "grad", p.in.weight, "weight"));
  const int64_t hidden = p.in.weight.shape[0] / (3 * kAdalnChunks);
  if (p.grad.shape[p.grad.rank - 1] != hidden)
    return Status::value_error("grad must be (6, B*S, H) with H = weight rows / 18 = " + std::to_string(hidden) +
                               ", got " + p.grad.describe());
  DETDIT_RETURN_IF_ERROR(rowwise::check_gather_grad(p.grad, p.in.plan));
  DETDIT_RETURN_IF_ERROR(rowwise::check_outputs_disjoint({{&p.grad, "grad"}},
                                                         {{&p.d_temb, "d_temb"}, {&p.d_weight, "d_weight"}, {&p.d_bias, "d_bias"}}));
  // d_table (T, 18H) FP32 = d_rows (3T, 6H): never rounded before the projection
  // backward; by the checks above it is exactly the (R, 6H) d_rows the gather takes.
  std::shared_ptr<void> owner;
  TensorView d_table;
  DETDIT_RETURN_IF_ERROR(rowwise::table_grad_scratch(p.in.temb, p.in.weight, stream, &owner, &d_table));
  const AdalnRowGatherBackwardParams gather{p.grad, p.in.plan, rowwise::rows_view(d_table)};
  DETDIT_RETURN_IF_ERROR(rowwise::run_row_gather_backward(gather, stream));
  return projection_backward(p.in.temb, p.in.weight, p.act, d_table, p.d_temb, p.d_weight, p.d_bias, p.in.numerics, stream);
}

// ---- final_adaln_out: projection (T, 2H) + modulated rmsnorm (numerics 5.8, 6.9) ----

namespace {

// The inputs of final_adaln_out's rmsnorm half, forward and backward alike:
// shift and scale are the halves of the (T, 2H) table.
RmsnormInputs norm_inputs(const FinalAdalnOutInputs& in, const TensorView& table, int64_t hidden) {
  return RmsnormInputs{in.x, in.norm_weight, rowwise::table_half(table, hidden, 0),
                       rowwise::table_half(table, hidden, 1), in.plan, in.eps, in.numerics};
}

// H of x, norm_weight (H,) and weight (2H, D) in x's dtype, temb on x's
// device, before anything else uses them. norm_weight first under its own
// name, its layout (contiguous, aligned) included: the rmsnorm half's checks
// call it weight.
Status check_final_shapes(const FinalAdalnOutInputs& in, int64_t* hidden) {
  DETDIT_RETURN_IF_ERROR(rowwise::check_rows(in.x, "x", &in.plan, hidden));
  DETDIT_RETURN_IF_ERROR(check::present(in.norm_weight, "norm_weight"));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(in.norm_weight, "norm_weight", in.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::same_device(in.norm_weight, "norm_weight", in.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::shape(in.norm_weight, "norm_weight", {*hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(in.norm_weight, "norm_weight"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_norm_aligned(in.norm_weight, "norm_weight"));
  DETDIT_RETURN_IF_ERROR(check::present(in.weight, "weight"));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(in.weight, "weight", in.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::shape(in.weight, "weight", {2 * *hidden, -1}, "(2H, D)"));
  DETDIT_RETURN_IF_ERROR(check::present(in.temb, "temb"));
  DETDIT_RETURN_IF_ERROR(check::same_device(in.temb, "temb", in.x, "x"));
  return rowwise::check_plan_rows(in.plan, in.x, "x", in.temb.shape[0], "T (temb rows)");
}

}  // namespace

Status final_adaln_out_forward(const FinalAdalnOutParams& params, Stream stream) {
  const FinalAdalnOutParams& p = params;
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check_final_shapes(p.in, &hidden));
  DETDIT_RETURN_IF_ERROR(check::present(p.table, "table"));
  DETDIT_RETURN_IF_ERROR(check::present(p.act, "act"));
  DETDIT_RETURN_IF_ERROR(check::present(p.rstd, "rstd"));
  DETDIT_RETURN_IF_ERROR(validate_projection_forward(p.in.temb, p.in.weight, p.in.bias, p.table, p.act, p.in.numerics));
  const RmsnormParams norm{norm_inputs(p.in, p.table, hidden), p.out, p.rstd};
  DETDIT_RETURN_IF_ERROR(rowwise::check_rmsnorm_forward_arguments(norm));
  // Every output against every input of both halves (table and act are
  // outputs here, the norm's shift/scale a view of table).
  DETDIT_RETURN_IF_ERROR(rowwise::check_outputs_disjoint(
      {{&p.in.x, "x"}, {&p.in.norm_weight, "norm_weight"}, {&p.in.temb, "temb"}, {&p.in.weight, "weight"},
       {&p.in.bias, "bias"}},
      {{&p.table, "table"}, {&p.act, "act"}, {&p.out, "out"}, {&p.rstd, "rstd"}}));
  DETDIT_RETURN_IF_ERROR(projection_forward(p.in.temb, p.in.weight, p.in.bias, p.table, p.act, p.in.numerics, stream));
  return backend::rmsnorm_forward(p.in.x.device, norm, stream);
}

Status final_adaln_out_backward(const FinalAdalnOutBackwardParams& params, Stream stream) {
  const FinalAdalnOutBackwardParams& p = params;
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check_final_shapes(p.in, &hidden));
  DETDIT_RETURN_IF_ERROR(check::present(p.table, "table"));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(p.table, "table", p.in.weight, "weight"));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.table, "table", p.in.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::shape(p.table, "table", {p.in.temb.shape[0], 2 * hidden}, "(T, 2H)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.table, "table"));
  if (p.d_norm_weight.present()) {
    DETDIT_RETURN_IF_ERROR(check::dtype(p.d_norm_weight, "d_norm_weight", {DType::kF32, p.in.x.dtype}));
    DETDIT_RETURN_IF_ERROR(check::same_device(p.d_norm_weight, "d_norm_weight", p.in.x, "x"));
    DETDIT_RETURN_IF_ERROR(check::shape(p.d_norm_weight, "d_norm_weight", {hidden}, "(H,)"));
  }
  // Every argument first; the projection's grad_table and the norm's
  // d_shift/d_scale are the op's own d_table scratch, taken after.
  DETDIT_RETURN_IF_ERROR(validate_projection_backward(p.in.temb, p.in.weight, p.act, TensorView(), p.d_temb,
                                                      p.d_weight, p.d_bias, p.in.numerics));
  RmsnormBackwardParams norm{norm_inputs(p.in, p.table, hidden), p.rstd, p.grad, p.dx, p.d_norm_weight,
                             TensorView(), TensorView()};
  DETDIT_RETURN_IF_ERROR(rowwise::check_rmsnorm_backward_arguments(norm));
  DETDIT_RETURN_IF_ERROR(rowwise::check_outputs_disjoint(
      {{&p.in.x, "x"}, {&p.in.norm_weight, "norm_weight"}, {&p.in.temb, "temb"}, {&p.in.weight, "weight"},
       {&p.table, "table"}, {&p.act, "act"}, {&p.rstd, "rstd"}, {&p.grad, "grad"}},
      {{&p.dx, "dx"}, {&p.d_norm_weight, "d_norm_weight"}, {&p.d_temb, "d_temb"}, {&p.d_weight, "d_weight"},
       {&p.d_bias, "d_bias"}}));
  // d_table (T, 2H) FP32 = [d_shift | d_scale], never rounded before the projection
  // backward: (R, H) halves on x's device with R = T, as the norm takes them.
  std::shared_ptr<void> owner;
  TensorView d_table;
  DETDIT_RETURN_IF_ERROR(rowwise::table_grad_scratch(p.in.temb, p.in.weight, stream, &owner, &d_table));
  norm.d_shift = rowwise::table_half(d_table, hidden, 0);
  norm.d_scale = rowwise::table_half(d_table, hidden, 1);
  DETDIT_RETURN_IF_ERROR(rowwise::run_rmsnorm_backward(norm, stream));
  return projection_backward(p.in.temb, p.in.weight, p.act, d_table, p.d_temb, p.d_weight, p.d_bias, p.in.numerics, stream);
}

}  // namespace detdit
