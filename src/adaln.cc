// Public entry points of adaln_row_gather, adaln_modulation and
// final_adaln_out (include/detdit/adaln.h, spec 3.5, 3.6, 3.9): validate every
// argument, then dispatch on the tensors' device. Nothing is written on error.
#include "detdit/adaln.h"

#include <string>

#include "common/backends.h"
#include "common/validate.h"
#include "rowwise_checks.h"

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

Status validate_row_gather_forward(const AdalnRowGatherParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check::present(p.rows, "rows"));
  DETDIT_RETURN_IF_ERROR(check_gather_rows(p.rows, "rows", p.plan, p.rows.dtype, &hidden));
  DETDIT_RETURN_IF_ERROR(check::present(p.out, "out"));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(p.out, "out", p.rows, "rows"));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.out, "out", p.rows, "rows"));
  DETDIT_RETURN_IF_ERROR(check::shape(p.out, "out", {kAdalnChunks, p.plan.seq_len(), hidden}, "(6, S, H)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.out, "out"));
  return check_outputs_disjoint({{&p.rows, "rows"}}, {{&p.out, "out"}});
}

}  // namespace

Status validate_row_gather_backward(const AdalnRowGatherBackwardParams& p) {
  DETDIT_RETURN_IF_ERROR(check::present(p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::dtype(p.grad, "grad", {DType::kF32, DType::kBF16, DType::kF16}));
  DETDIT_RETURN_IF_ERROR(check::plan_on(p.plan, "plan", p.grad, "grad"));
  const int64_t batch = p.plan.batch(), seq_len = p.plan.seq_len();
  const bool shape_ok =
      p.grad.shape[0] == kAdalnChunks && p.grad.shape[p.grad.rank - 1] >= 1 &&
      ((p.grad.rank == 3 && p.grad.shape[1] == batch * seq_len) ||
       (p.grad.rank == 4 && p.grad.shape[1] == batch && p.grad.shape[2] == seq_len));
  if (!shape_ok)
    return Status::value_error("grad must be (6, B*S, H) or (6, B, S, H) with S = plan.seq_len() = " +
                               std::to_string(seq_len) + ", B = plan.batch() = " + std::to_string(batch) + ", got " +
                               p.grad.describe());
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.grad, "grad"));
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  DETDIT_RETURN_IF_ERROR(check::present(p.d_rows, "d_rows"));
  DETDIT_RETURN_IF_ERROR(check::dtype(p.d_rows, "d_rows", {DType::kF32, p.grad.dtype}));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.d_rows, "d_rows", p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::shape(p.d_rows, "d_rows", {p.plan.num_rows(), kAdalnChunks * hidden}, "(R, 6H)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_rows, "d_rows"));
  return check_outputs_disjoint({{&p.grad, "grad"}}, {{&p.d_rows, "d_rows"}});
}

}  // namespace rowwise

Status adaln_row_gather_forward(const AdalnRowGatherParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_row_gather_forward(params));
  return params.rows.device.is_cuda() ? cuda::adaln_row_gather_forward(params, stream)
                                      : cpu::adaln_row_gather_forward(params, stream);
}

Status adaln_row_gather_backward(const AdalnRowGatherBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_row_gather_backward(params));
  return params.grad.device.is_cuda() ? cuda::adaln_row_gather_backward(params, stream)
                                      : cpu::adaln_row_gather_backward(params, stream);
}

}  // namespace detdit
