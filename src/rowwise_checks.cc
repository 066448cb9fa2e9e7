// Validation shared by the row-wise ops (contract in src/rowwise_checks.h).
#include "rowwise_checks.h"

#include <cmath>
#include <string>

#include "common/validate.h"

namespace detdit {
namespace rowwise {

Status check_rows(const TensorView& t, const char* name, const IndexPlan* plan, int64_t* hidden) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kF32, DType::kBF16, DType::kF16}));
  if (t.rank != 2 && t.rank != 3)
    return Status::value_error(std::string(name) + " must be a 2-D (M, H) or 3-D (B, S, H) tensor, got " +
                               t.describe());
  if (t.numel() == 0)
    return Status::value_error(std::string(name) + " must be non-empty (at least one row and one column), got " +
                               t.describe());
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  *hidden = t.shape[t.rank - 1];
  if (plan && plan->valid()) {
    const int64_t rows = t.numel() / *hidden;
    const bool ok = rows == plan->positions() &&
                    (t.rank == 2 || (t.shape[0] == plan->batch() && t.shape[1] == plan->seq_len()));
    if (!ok)
      return Status::value_error(std::string(name) + " must be (B*S, H) rows with S = plan.seq_len() = " +
                                 std::to_string(plan->seq_len()) + ", B = plan.batch() = " +
                                 std::to_string(plan->batch()) + ", got " + t.describe());
  }
  return Status();
}

Status check_like(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(t, name, ref, ref_name));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, ref, ref_name));
  bool same = t.rank == ref.rank;
  for (int d = 0; same && d < t.rank; ++d) same = t.shape[d] == ref.shape[d];
  if (!same)
    return Status::value_error(std::string(name) + " must have " + ref_name + "'s shape " + ref.shape_string() +
                               ", got " + t.describe());
  return check::contiguous(t, name);
}

Status check_table(const TensorView& t, const char* name, int64_t rows, int64_t hidden, const TensorView& ref,
                   const char* ref_name, std::initializer_list<DType> allowed) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, allowed));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, ref, ref_name));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {rows, hidden}, "(R, H)"));
  return check::unit_column_stride(t, name);
}

Status check_table_grad(const TensorView& t, const char* name, int64_t rows, int64_t hidden, DType dtype,
                        const TensorView& ref, const char* ref_name) {
  return check_table(t, name, rows, hidden, ref, ref_name, {DType::kF32, dtype});
}

Status check_outputs_disjoint(std::initializer_list<Named> inputs, std::initializer_list<Named> outputs) {
  for (const Named& out : outputs) {
    for (const Named& in : inputs) DETDIT_RETURN_IF_ERROR(check::no_alias(*out.first, out.second, *in.first, in.second));
    for (const Named& other : outputs)
      if (other.first != out.first)
        DETDIT_RETURN_IF_ERROR(check::no_alias(*out.first, out.second, *other.first, other.second));
  }
  return Status();
}

Status check_eps(float eps) {
  if (!(std::isfinite(eps) && eps > 0.0f))
    return Status::value_error("eps must be finite and > 0, got " + std::to_string(eps));
  return Status();
}

}  // namespace rowwise
}  // namespace detdit
