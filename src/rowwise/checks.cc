// Validation shared by the row-wise ops (contract in src/rowwise/checks.h).
#include "rowwise/checks.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "common/validate.h"
#include "detdit/modulation.h"

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

Status check_like_as(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name, DType dtype,
                     const char* why) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  if (t.dtype != dtype)
    return Status::type_error(std::string(name) + " must be " + dtype_name(dtype) + " (" + why + "), got " +
                              dtype_name(t.dtype));
  TensorView as = ref;
  as.dtype = dtype;
  return check_like(t, name, as, ref_name);
}

Status check_modulated_out(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name,
                           const ResolvedModulation& mod, bool upcast, const char* m_name) {
  const DType expected = modulated_out_dtype(ref.dtype, mod, upcast);
  if (t.present() && t.dtype == ref.dtype && expected != ref.dtype)
    return Status::type_error(std::string(m_name) + " must be " + dtype_name(ref.dtype) + ", got " +
                              dtype_name(mod.dtype) + " (" + name + " is " + dtype_name(t.dtype) +
                              " and upcast = false: a float32 modulation makes a float32 " + name + ")");
  return check_like_as(t, name, ref, ref_name, expected,
                       "the promoted dtype of the rows and the modulation, or the rows' with upcast = true");
}

Status check_table(const TensorView& t, const char* name, int64_t rows, int64_t hidden, const TensorView& ref,
                   const char* ref_name, std::initializer_list<DType> allowed) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, allowed));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, ref, ref_name));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {rows, hidden}, "(R, H)"));
  return check::unit_column_stride(t, name);
}

namespace {

// Byte range [lo, hi) spanned by a view (its first to its last element).
void byte_span(const TensorView& t, std::uintptr_t* lo, std::uintptr_t* hi) {
  int64_t last = 0;
  for (int d = 0; d < t.rank; ++d) last += (t.shape[d] - 1) * t.strides[d];
  const auto size = static_cast<int64_t>(dtype_size(t.dtype));
  *lo = reinterpret_cast<std::uintptr_t>(t.data);
  *hi = *lo + static_cast<std::uintptr_t>((last + 1) * size);
}

// Whether two views share a byte. Exact for the layouts the ops take: spans
// that do not intersect, and 2-D views with unit column stride and one row
// stride whose column bands differ (the [shift | scale] halves of one table).
bool views_overlap(const TensorView& a, const TensorView& b) {
  if (!a.present() || !b.present() || a.device != b.device || a.numel() == 0 || b.numel() == 0) return false;
  std::uintptr_t a_lo, a_hi, b_lo, b_hi;
  byte_span(a, &a_lo, &a_hi);
  byte_span(b, &b_lo, &b_hi);
  if (a_hi <= b_lo || b_hi <= a_lo) return false;
  const auto size = static_cast<std::uintptr_t>(dtype_size(a.dtype));
  if (a.rank == 2 && b.rank == 2 && a.strides[1] == 1 && b.strides[1] == 1 && a.strides[0] == b.strides[0] &&
      dtype_size(b.dtype) == size && a.strides[0] > 0) {
    const std::uintptr_t period = static_cast<std::uintptr_t>(a.strides[0]) * size;
    const std::uintptr_t a_col = a_lo % period, b_col = b_lo % period;
    const std::uintptr_t a_width = static_cast<std::uintptr_t>(a.shape[1]) * size;
    const std::uintptr_t b_width = static_cast<std::uintptr_t>(b.shape[1]) * size;
    // the bands [a_col, a_col + a_width) and [b_col, b_col + b_width) on a circle of length period
    const bool a_before_b = a_col + a_width <= b_col && b_col + b_width <= a_col + period;
    const bool b_before_a = b_col + b_width <= a_col && a_col + a_width <= b_col + period;
    if (a_width <= period && b_width <= period && (a_before_b || b_before_a)) return false;
  }
  return true;
}

}  // namespace

Status check_table_grad(const TensorView& t, const char* name, int64_t rows, int64_t hidden, DType dtype,
                        const TensorView& ref, const char* ref_name) {
  DETDIT_RETURN_IF_ERROR(
      check_table(t, name, rows, hidden, ref, ref_name,
                  dtype == DType::kF32 ? std::initializer_list<DType>{DType::kF32} : std::initializer_list<DType>{DType::kF32, dtype}));
  // Rows that share memory (a row stride below H) would be written over each
  // other; with one row stride, two neighbouring rows overlap iff any do.
  if (rows > 1 && views_overlap(t.narrow(0, 0, 1), t.narrow(0, 1, 1)))
    return Status::value_error(std::string(name) + " must not overlap itself: its row stride " +
                               std::to_string(t.strides[0]) + " is below H = " + std::to_string(hidden) +
                               ", got " + t.describe());
  return Status();
}

Status check_outputs_disjoint(std::initializer_list<Named> inputs, std::initializer_list<Named> outputs) {
  for (const Named& out : outputs) {
    for (const Named& in : inputs)
      if (views_overlap(*out.first, *in.first))
        return Status::value_error(std::string(out.second) + " must not overlap " + in.second);
    for (const Named& other : outputs)
      if (other.first != out.first && views_overlap(*out.first, *other.first))
        return Status::value_error(std::string(out.second) + " must not overlap " + other.second);
  }
  return Status();
}

Status check_norm_aligned(const TensorView& t, const char* name) {
  return check::aligned(t, name, 4 * dtype_size(t.dtype), "PyTorch's vectorized RMSNorm path");
}

Status check_eps(float eps) {
  if (!(std::isfinite(eps) && eps > 0.0f))
    return Status::value_error("eps must be finite and > 0, got " + std::to_string(eps));
  return Status();
}

}  // namespace rowwise
}  // namespace detdit
