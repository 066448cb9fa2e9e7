#include "common/test_util.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common/scalar_math.h"

#if defined(DETDIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace testing {

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  size_ = static_cast<std::size_t>(numel()) * dtype_size(dtype_);
  bytes_.assign(size_ + 64, 0);
  auto address = reinterpret_cast<std::uintptr_t>(bytes_.data());
  offset_ = (64 - address % 64) % 64;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

TensorView HostTensor::view() const { return contiguous_view(data(), dtype_, shape_); }

TensorView HostTensor::view_as(std::initializer_list<int64_t> shape) const {
  return TensorView::contiguous(data(), dtype_, shape);
}

void HostTensor::fill_bytes(uint8_t value) { std::fill_n(static_cast<char*>(data()), size_, static_cast<char>(value)); }

double HostTensor::get(int64_t i) const {
  switch (dtype_) {
    case DType::kF32: return ptr<float>()[i];
    case DType::kBF16: return num::bf16_to_float(ptr<uint16_t>()[i]);
    case DType::kF16: return num::f16_to_float(ptr<uint16_t>()[i]);
    case DType::kI32: return ptr<int32_t>()[i];
    case DType::kI64: return static_cast<double>(ptr<int64_t>()[i]);
  }
  return 0;
}

void HostTensor::set(int64_t i, double v) {
  switch (dtype_) {
    case DType::kF32: ptr<float>()[i] = static_cast<float>(v); break;
    case DType::kBF16: ptr<uint16_t>()[i] = num::float_to_bf16(static_cast<float>(v)); break;
    case DType::kF16: ptr<uint16_t>()[i] = num::float_to_f16(static_cast<float>(v)); break;
    case DType::kI32: ptr<int32_t>()[i] = static_cast<int32_t>(v); break;
    case DType::kI64: ptr<int64_t>()[i] = static_cast<int64_t>(v); break;
  }
}

void fill_normal(HostTensor* t, uint64_t seed, double mean, double std) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(mean, std);
  for (int64_t i = 0; i < t->numel(); ++i) t->set(i, dist(rng));
}

void fill_uniform(HostTensor* t, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t i = 0; i < t->numel(); ++i) t->set(i, dist(rng));
}

namespace {
uint64_t element_bits(const void* base, std::size_t i, std::size_t width) {
  uint64_t bits = 0;
  std::memcpy(&bits, static_cast<const char*>(base) + i * width, width);
  return bits;
}
double bits_value(uint64_t bits, DType dtype) {
  switch (dtype) {
    case DType::kF32: return num::bits_float(static_cast<uint32_t>(bits));
    case DType::kBF16: return num::bf16_to_float(static_cast<uint16_t>(bits));
    case DType::kF16: return num::f16_to_float(static_cast<uint16_t>(bits));
    case DType::kI32: return static_cast<int32_t>(bits);
    case DType::kI64: return static_cast<double>(static_cast<int64_t>(bits));
  }
  return 0;
}
}  // namespace

uint64_t ulp_distance(uint64_t a, uint64_t b, DType dtype) {
  int width_bits = static_cast<int>(dtype_size(dtype) * 8);
  if (!dtype_is_float(dtype)) return a > b ? a - b : b - a;
  uint64_t sign = 1ull << (width_bits - 1);
  // map sign-magnitude to a monotonic unsigned line
  auto key = [&](uint64_t v) -> int64_t {
    int64_t magnitude = static_cast<int64_t>(v & (sign - 1));
    return (v & sign) ? -magnitude : magnitude;
  };
  int64_t d = key(a) - key(b);
  return static_cast<uint64_t>(d < 0 ? -d : d);
}

::testing::AssertionResult bitwise_equal_bytes(const void* expected, const void* actual, std::size_t count,
                                               DType dtype) {
  std::size_t width = dtype_size(dtype);
  std::size_t mismatches = 0, first = 0;
  uint64_t max_ulp = 0;
  for (std::size_t i = 0; i < count; ++i) {
    uint64_t a = element_bits(expected, i, width), b = element_bits(actual, i, width);
    if (a != b) {
      if (mismatches == 0) first = i;
      ++mismatches;
      max_ulp = std::max(max_ulp, ulp_distance(a, b, dtype));
    }
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  uint64_t a = element_bits(expected, first, width), b = element_bits(actual, first, width);
  std::ostringstream os;
  os << mismatches << " of " << count << " " << dtype_name(dtype) << " elements differ; first at index " << first
     << ": expected 0x" << std::hex << a << " (" << std::dec << bits_value(a, dtype) << "), got 0x" << std::hex << b
     << " (" << std::dec << bits_value(b, dtype) << "), " << ulp_distance(a, b, dtype) << " ulp; max " << max_ulp
     << " ulp";
  return ::testing::AssertionFailure() << os.str();
}

::testing::AssertionResult bitwise_equal(const HostTensor& expected, const HostTensor& actual) {
  if (expected.dtype() != actual.dtype() || expected.numel() != actual.numel())
    return ::testing::AssertionFailure() << "tensors differ in dtype or size: " << dtype_name(expected.dtype()) << "["
                                         << expected.numel() << "] vs " << dtype_name(actual.dtype()) << "["
                                         << actual.numel() << "]";
  return bitwise_equal_bytes(expected.data(), actual.data(), static_cast<std::size_t>(expected.numel()),
                             expected.dtype());
}

bool cuda_available(std::string* reason) {
#if defined(DETDIT_WITH_CUDA)
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    *reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    *reason = "cudaGetDeviceCount reports 0 devices";
    return false;
  }
  return true;
#else
  *reason = "this build has no CUDA backend (nvcc was not found at configure time)";
  return false;
#endif
}

}  // namespace testing
}  // namespace detdit
