// Test helpers: owned host/device buffers, deterministic random inputs, and
// bitwise comparison that reports what differs (count, first index, both
// values in hex, ulp distance).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace testing {

#define DETDIT_ASSERT_OK(expr)                                        \
  do {                                                                \
    ::detdit::Status s_ = (expr);                                     \
    ASSERT_TRUE(s_.ok()) << #expr << " -> " << s_.to_string();        \
  } while (0)
#define DETDIT_EXPECT_OK(expr)                                        \
  do {                                                                \
    ::detdit::Status s_ = (expr);                                     \
    EXPECT_TRUE(s_.ok()) << #expr << " -> " << s_.to_string();        \
  } while (0)

// A contiguous (row-major) view of `shape` over `data` on `device` (the shape
// as a vector, which TensorView::contiguous does not take): the view of every
// owned test buffer, host or device.
inline TensorView contiguous_view(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device = Device::cpu()) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
  v.device = device;
  return v;
}

// A host tensor that owns its bytes (64-byte aligned).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);
  TensorView view() const;
  // View with explicit shape over the same bytes (must fit).
  TensorView view_as(std::initializer_list<int64_t> shape) const;
  void* data() const { return const_cast<char*>(bytes_.data()) + offset_; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data()); }
  std::size_t nbytes() const { return size_; }
  int64_t numel() const;
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  // Fill with a byte pattern (e.g. 0xA5 canary) / copy from another tensor.
  void fill_bytes(uint8_t value);
  // Float element i as FP32 (float dtypes) or as int64 cast to double.
  double get(int64_t i) const;
  void set(int64_t i, double v);  // rounds to the dtype (RNE) for floats

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::vector<char> bytes_;
  std::size_t offset_ = 0, size_ = 0;
};

// Deterministic inputs: normal(mean, std) rounded to the tensor's dtype.
void fill_normal(HostTensor* t, uint64_t seed, double mean = 0.0, double std = 1.0);
void fill_uniform(HostTensor* t, uint64_t seed, double lo, double hi);

// Bitwise comparison of two tensors' bytes with a readable report.
::testing::AssertionResult bitwise_equal(const HostTensor& expected, const HostTensor& actual);
::testing::AssertionResult bitwise_equal_bytes(const void* expected, const void* actual, std::size_t count,
                                               DType dtype);
#define EXPECT_BITWISE_EQ(expected, actual) EXPECT_TRUE(::detdit::testing::bitwise_equal(expected, actual))
#define ASSERT_BITWISE_EQ(expected, actual) ASSERT_TRUE(::detdit::testing::bitwise_equal(expected, actual))

// ulp distance between two values of a float dtype given as raw bits.
uint64_t ulp_distance(uint64_t a_bits, uint64_t b_bits, DType dtype);

// True when a CUDA device is usable; otherwise `reason` says why.
bool cuda_available(std::string* reason);
#define DETDIT_SKIP_WITHOUT_CUDA()                                              \
  do {                                                                          \
    std::string why_;                                                           \
    if (!::detdit::testing::cuda_available(&why_)) GTEST_SKIP() << "no CUDA GPU: " << why_; \
  } while (0)

}  // namespace testing
}  // namespace detdit
