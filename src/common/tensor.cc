// TensorView helpers (include/detdit/tensor.h). A view is caller data, so
// nothing here may overflow or read past shape[kMaxRank] whatever its fields
// hold: products of dimensions are computed with overflow checks, and a view
// whose rank is outside [0, kMaxRank], with a negative dimension, or whose
// element count exceeds int64 has numel() == -1 and is not contiguous (the
// validators refuse such a view by name, src/common/validate.cc).
#include "detdit/tensor.h"

#include <cstdint>
#include <sstream>

namespace detdit {
namespace {

bool rank_in_range(int rank) { return rank >= 0 && rank <= kMaxRank; }

// Row-major strides of `shape` into `strides`; false (strides unspecified)
// when a product of dimensions does not fit int64.
bool row_major_strides(int rank, const int64_t* shape, int64_t* strides) {
  int64_t stride = 1;
  bool fits = true;
  for (int d = rank - 1; d >= 0; --d) {
    strides[d] = stride;
    fits = fits && !__builtin_mul_overflow(stride, shape[d], &stride);
  }
  return fits;
}

}  // namespace

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
  }
  return "unknown";
}

bool dtype_is_float(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

std::string Device::to_string() const {
  if (kind == DeviceKind::kCpu) return "cpu";
  return "cuda:" + std::to_string(index);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) {
    if (i < kMaxRank) v.shape[i] = s;
    ++i;
  }
  // A shape past kMaxRank or of more than 2^63 elements keeps its rank, so
  // that validation names it; its strides are unspecified.
  if (rank_in_range(v.rank)) row_major_strides(v.rank, v.shape, v.strides);
  return v;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  TensorView v = contiguous(data, dtype, shape, device);
  int i = 0;
  for (int64_t s : strides) {
    if (i < kMaxRank) v.strides[i] = s;
    ++i;
  }
  return v;
}

int64_t TensorView::numel() const {
  if (rank == 0) return 0;
  if (!rank_in_range(rank)) return -1;
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) {
    if (shape[d] < 0 || __builtin_mul_overflow(n, shape[d], &n)) return -1;
  }
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() < 0) return false;
  int64_t expected[kMaxRank];
  row_major_strides(rank, shape, expected);  // fits: numel() does
  for (int d = 0; d < rank; ++d) {
    if (shape[d] != 1 && strides[d] != expected[d]) return false;
  }
  return true;
}

bool TensorView::aligned_to(std::size_t bytes) const {
  return reinterpret_cast<std::uintptr_t>(data) % bytes == 0;
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  if (!rank_in_range(rank)) {
    os << "(rank " << rank << ")";
    return os.str();
  }
  os << "(";
  for (int d = 0; d < rank; ++d) os << (d ? ", " : "") << shape[d];
  if (rank == 1) os << ",";
  os << ")";
  return os.str();
}

std::string TensorView::describe() const {
  if (!present()) return "an absent tensor";
  return shape_string() + " " + dtype_name(dtype) + " on " + device.to_string();
}

TensorView TensorView::narrow(int dim, int64_t start, int64_t length) const {
  TensorView v = *this;
  v.shape[dim] = length;
  v.data = static_cast<char*>(data) + start * strides[dim] * static_cast<int64_t>(dtype_size(dtype));
  return v;
}

TensorView TensorView::reshaped(std::initializer_list<int64_t> new_shape) const {
  return contiguous(data, dtype, new_shape, device);
}

}  // namespace detdit
