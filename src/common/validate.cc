#include "common/validate.h"

#include <cstdint>
#include <sstream>

namespace detdit {
namespace check {

// What no op can take and TensorView's helpers cannot describe: a rank past
// kMaxRank, a negative dimension, more elements than int64 or bytes than the
// address space holds, and a null pointer to a non-empty tensor. Every check
// of a present view runs this first (the one place a view is judged sane),
// so an optional argument that an op checks for its shape or dtype alone is
// refused here too; every check after it may multiply dimensions.
Status well_formed(const TensorView& t, const char* name) {
  if (!t.present()) return Status();
  if (t.rank > kMaxRank)
    return Status::value_error(std::string(name) + " has rank " + std::to_string(t.rank) +
                               "; a TensorView holds ranks 1.." + std::to_string(kMaxRank));
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] < 0)
      return Status::value_error(std::string(name) + " has a negative dimension: shape " + t.shape_string());
  }
  const int64_t size = static_cast<int64_t>(dtype_size(t.dtype));
  if (t.numel() < 0 || (size > 0 && t.numel() > INT64_MAX / size))
    return Status::value_error(std::string(name) + " has shape " + t.shape_string() +
                               ", more bytes than a 64-bit address space holds");
  if (t.data == nullptr && t.numel() > 0)
    return Status::value_error(std::string(name) + " is " + t.describe() + " with a null data pointer");
  return Status();
}

Status present(const TensorView& t, const char* name) {
  if (!t.present()) return Status::value_error(std::string(name) + " is required, got an absent tensor");
  return well_formed(t, name);
}

Status dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  for (DType d : allowed)
    if (t.dtype == d) return Status();
  std::ostringstream os;
  os << name << " must be ";
  std::size_t i = 0;
  for (DType d : allowed) {
    if (i > 0) os << (i + 1 == allowed.size() ? " or " : ", ");
    os << dtype_name(d);
    ++i;
  }
  os << ", got " << dtype_name(t.dtype);
  return Status::type_error(os.str());
}

Status same_dtype(const TensorView& t, const char* name, const TensorView& other, const char* other_name) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  if (t.dtype == other.dtype) return Status();
  return Status::type_error(std::string(name) + " must have " + other_name + "'s dtype " +
                            dtype_name(other.dtype) + ", got " + dtype_name(t.dtype));
}

Status rank(const TensorView& t, const char* name, int expected, const char* layout) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  if (t.rank == expected) return Status();
  return Status::value_error(std::string(name) + " must be a " + std::to_string(expected) + "-D " +
                             layout + " tensor, got " + t.describe());
}

Status shape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims, const char* layout) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  bool ok = t.rank == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (ok && d >= 0 && t.shape[i] != d) ok = false;
    ++i;
  }
  if (ok) return Status();
  std::ostringstream os;
  os << name << " must be " << layout << " = (";
  i = 0;
  for (int64_t d : dims) {
    os << (i ? ", " : "");
    if (d < 0) os << "*"; else os << d;
    ++i;
  }
  if (dims.size() == 1) os << ",";
  os << "), got " << t.describe();
  return Status::value_error(os.str());
}

Status contiguous(const TensorView& t, const char* name) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  if (t.is_contiguous()) return Status();
  return Status::value_error(std::string(name) + " must be contiguous, got a strided view " + t.describe());
}

Status unit_column_stride(const TensorView& t, const char* name) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  if (t.rank >= 1 && (t.strides[t.rank - 1] == 1 || t.shape[t.rank - 1] <= 1)) return Status();
  return Status::value_error(std::string(name) + " must have unit column stride, got stride " +
                             std::to_string(t.strides[t.rank - 1]));
}

Status aligned(const TensorView& t, const char* name, std::size_t bytes, const char* why) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  if (t.aligned_to(bytes)) return Status();
  std::ostringstream os;
  os << name << " must be " << bytes << "-byte aligned (" << why << "), got address offset "
     << (reinterpret_cast<std::uintptr_t>(t.data) % bytes);
  return Status::value_error(os.str());
}

Status same_device(const TensorView& t, const char* name, const TensorView& other, const char* other_name) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  if (t.device == other.device) return Status();
  return Status::value_error(std::string(name) + " is on " + t.device.to_string() + ", " + other_name +
                             " is on " + other.device.to_string());
}

Status numerics_on(Numerics numerics, const Device& device) {
  // An enum holds any int a caller casts into it; only the two profiles exist.
  if (numerics != Numerics::kPortable && numerics != Numerics::kTorch)
    return Status::value_error("numerics must be Numerics::kPortable or Numerics::kTorch, got Numerics(" +
                               std::to_string(static_cast<int>(numerics)) + ")");
  if (numerics == Numerics::kTorch && !device.is_cuda())
    return Status::value_error(
        "numerics=torch exists on CUDA only (it replays PyTorch's CUDA kernels); use numerics=portable "
        "on the CPU, which is bitwise equal to portable on every CUDA GPU");
  return Status();
}

Status plan_on(const IndexPlan& plan, const char* name, const TensorView& t, const char* t_name) {
  if (!plan.valid()) return Status::value_error(std::string(name) + " is required, got an empty IndexPlan");
  if (plan.device() != t.device)
    return Status::value_error(std::string(name) + " is on " + plan.device().to_string() + ", " + t_name +
                               " is on " + t.device.to_string());
  return Status();
}

Status no_alias(const TensorView& t, const char* name, const TensorView& other, const char* other_name) {
  DETDIT_RETURN_IF_ERROR(well_formed(t, name));
  DETDIT_RETURN_IF_ERROR(well_formed(other, other_name));
  if (!t.present() || !other.present()) return Status();
  auto lo1 = reinterpret_cast<std::uintptr_t>(t.data);
  auto hi1 = lo1 + t.nbytes();
  auto lo2 = reinterpret_cast<std::uintptr_t>(other.data);
  auto hi2 = lo2 + other.nbytes();
  if (lo1 < hi2 && lo2 < hi1 && t.device == other.device)
    return Status::value_error(std::string(name) + " must not overlap " + other_name);
  return Status();
}

}  // namespace check
}  // namespace detdit
