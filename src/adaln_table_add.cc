// Public entry points of adaln_table_add (include/detdit/adaln.h, docs/ops.md,
// docs/numerics.md 5.13 and 6.12): validate every argument, then run the
// backend. The backward composes the backend's d_proj cast with the canonical
// reduction of d_table in its two halves (column_chunk_partials, then the
// existing fold_chunk_partials), so d_table is the same function of the T rows
// as every other cross-row gradient of detdit.
#include <memory>
#include <string>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/adaln.h"

namespace detdit {
namespace {

constexpr std::initializer_list<DType> kFloatDTypes = {DType::kF32, DType::kBF16, DType::kF16};

// torch's promotion of two float dtypes: the shared one, else float32.
DType promoted(DType a, DType b) { return a == b ? a : DType::kF32; }

// A 3-D (T, K, H) or (T, 1, H) float tensor, T, K, H >= 1, contiguous.
Status check_rows(const TensorView& t, const char* name, const char* layout) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, kFloatDTypes));
  DETDIT_RETURN_IF_ERROR(check::rank(t, name, 3, layout));
  if (t.shape[0] < 1 || t.shape[1] < 1 || t.shape[2] < 1)
    return Status::value_error(std::string(name) + " must be a non-empty " + layout + " tensor, got " + t.describe());
  return check::contiguous(t, name);
}

// proj (or d_proj) against (T, K, H): (T, K, H) or (T, 1, H).
Status check_proj_shape(const TensorView& t, const char* name, int64_t rows, int64_t k, int64_t hidden) {
  if (t.shape[0] == rows && (t.shape[1] == k || t.shape[1] == 1) && t.shape[2] == hidden) return Status();
  return Status::value_error(std::string(name) + " must be (T, K, H) = (" + std::to_string(rows) + ", " +
                             std::to_string(k) + ", " + std::to_string(hidden) + ") or (T, 1, H) = (" +
                             std::to_string(rows) + ", 1, " + std::to_string(hidden) + "), got " + t.describe());
}

}  // namespace

Status adaln_table_add_forward(const AdalnTableAddParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_rows(p.out, "out", "(T, K, H)"));
  const int64_t rows = p.out.shape[0], k = p.out.shape[1], hidden = p.out.shape[2];
  DETDIT_RETURN_IF_ERROR(check::present(p.table, "table"));
  DETDIT_RETURN_IF_ERROR(check::dtype(p.table, "table", kFloatDTypes));
  DETDIT_RETURN_IF_ERROR(check::shape(p.table, "table", {k, hidden}, "(K, H) with out's K and H"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.table, "table"));
  DETDIT_RETURN_IF_ERROR(check_rows(p.proj, "proj", "(T, K, H) or (T, 1, H)"));
  DETDIT_RETURN_IF_ERROR(check_proj_shape(p.proj, "proj", rows, k, hidden));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.table, "table", p.out, "out"));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.proj, "proj", p.out, "out"));
  const DType want = promoted(p.table.dtype, p.proj.dtype);
  if (p.out.dtype != want)
    return Status::type_error(std::string("out must have the promoted dtype of table (") + dtype_name(p.table.dtype) +
                              ") and proj (" + dtype_name(p.proj.dtype) + "): " + dtype_name(want) + ", got " +
                              dtype_name(p.out.dtype));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.out, "out", p.table, "table"));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.out, "out", p.proj, "proj"));
  return backend::adaln_table_add_forward(p.out.device, p, stream);
}

Status adaln_table_add_backward(const AdalnTableAddBackwardParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_rows(p.grad, "grad", "(T, K, H)"));
  const int64_t rows = p.grad.shape[0], k = p.grad.shape[1], hidden = p.grad.shape[2];
  if (p.d_proj.present()) {
    DETDIT_RETURN_IF_ERROR(check_rows(p.d_proj, "d_proj", "(T, K, H) or (T, 1, H)"));
    DETDIT_RETURN_IF_ERROR(check_proj_shape(p.d_proj, "d_proj", rows, k, hidden));
    DETDIT_RETURN_IF_ERROR(check::same_device(p.d_proj, "d_proj", p.grad, "grad"));
    DETDIT_RETURN_IF_ERROR(check::no_alias(p.d_proj, "d_proj", p.grad, "grad"));
  }
  if (p.d_table.present()) {
    DETDIT_RETURN_IF_ERROR(check::dtype(p.d_table, "d_table", kFloatDTypes));
    DETDIT_RETURN_IF_ERROR(check::shape(p.d_table, "d_table", {k, hidden}, "(K, H) with grad's K and H"));
    DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_table, "d_table"));
    DETDIT_RETURN_IF_ERROR(check::same_device(p.d_table, "d_table", p.grad, "grad"));
    DETDIT_RETURN_IF_ERROR(check::no_alias(p.d_table, "d_table", p.grad, "grad"));
    DETDIT_RETURN_IF_ERROR(check::no_alias(p.d_table, "d_table", p.d_proj, "d_proj"));
  }
  const Device device = p.grad.device;
  // Scratch first, so an allocation failure writes nothing: d_table's chunk
  // partials (C, K*H) FP32, one per 256 rows.
  TensorView partials;
  std::shared_ptr<void> owner;
  const int64_t chunks = (rows + kReductionChunk - 1) / kReductionChunk;
  if (p.d_table.present())
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {chunks, k * hidden}, stream, &owner, &partials));
  if (p.d_proj.present()) DETDIT_RETURN_IF_ERROR(backend::adaln_table_add_backward_proj(device, p, stream));
  if (!p.d_table.present()) return Status();
  const TensorView grad_rows = TensorView::contiguous(p.grad.data, p.grad.dtype, {rows, k * hidden}, device);
  DETDIT_RETURN_IF_ERROR(backend::column_chunk_partials(device, grad_rows, partials, stream));
  const TensorView out = TensorView::contiguous(p.d_table.data, p.d_table.dtype, {k * hidden}, device);
  return backend::fold_chunk_partials(device, partials, out, stream);
}

}  // namespace detdit
