// The GoogleTest face of the op-case library (cases/): the library's tensors,
// values, oracles and index cases under detdit::testing, the bitwise
// assertion that reports what differs (count, first index, both values in
// hex, ulp distance), Status assertions, and the CUDA skip.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cases/index_case.h"
#include "cases/oracle.h"
#include "cases/tensor.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace testing {

using namespace ::detdit::cases;  // NOLINT: the tests speak the case library's vocabulary

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

// A copy of the tensor's bytes (for repeatability / invariance comparisons).
inline HostTensor clone(const HostTensor& t) { return t; }

// Bitwise comparison of two tensors' bytes (cases::compare) as an assertion.
::testing::AssertionResult bitwise_equal(const HostTensor& expected, const HostTensor& actual);
::testing::AssertionResult bitwise_equal_bytes(const void* expected, const void* actual, std::size_t count,
                                               DType dtype);
#define EXPECT_BITWISE_EQ(expected, actual) EXPECT_TRUE(::detdit::testing::bitwise_equal(expected, actual))
#define ASSERT_BITWISE_EQ(expected, actual) ASSERT_TRUE(::detdit::testing::bitwise_equal(expected, actual))

// True when a CUDA device is usable; otherwise `reason` says why.
bool cuda_available(std::string* reason);
#define DETDIT_SKIP_WITHOUT_CUDA()                                              \
  do {                                                                          \
    std::string why_;                                                           \
    if (!::detdit::testing::cuda_available(&why_)) GTEST_SKIP() << "no CUDA GPU: " << why_; \
  } while (0)

}  // namespace testing
}  // namespace detdit
