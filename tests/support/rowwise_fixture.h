// Shared pieces of the row-wise op tests (rmsnorm, gate_residual, the AdaLN
// ops, their parallel forms): R_T for contract-by-hand results, the "refused with this kind and message" check, row-level byte access for the
// invariance tests, and the fail-closed loop that every op's fixture runs
// (fresh valid params, one mutation, forward and backward both refused,
// every output still the canary). Header-only, so every suite can use it.
//
// A fixture used with expect_bad_params_refused provides forward_params(),
// backward_params() and outputs() (the tensors the op may write, filled with
// kCanary by its constructor).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "support/cases.h"
#include "common/storage.h"
#include "support/test_util.h"
#include "detdit/status.h"

namespace detdit {
namespace testing {

// R_T of docs/numerics.md: an FP32 value rounded to `dtype` (RNE) and back.
inline float round_as(float v, DType dtype) {
  return dispatch_float_dtype(dtype, [&](auto tag) { return round_to<decltype(tag)>(v); });
}

// `s` is an error of `kind` whose message contains `message`.
inline ::testing::AssertionResult refused(const Status& s, ErrorKind kind, const std::string& message) {
  if (s.kind() == kind && s.message().find(message) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << error_kind_name(kind) << " containing \"" << message
                                       << "\", got " << s.to_string();
}

// Row access for tensors whose first dimension counts rows: a (P, H)
// activation, a (P,) rstd, a (R, H) table.
inline std::size_t row_bytes(const HostTensor& t) { return t.nbytes() / static_cast<std::size_t>(t.shape()[0]); }
inline char* row_data(const HostTensor& t, int64_t row) {
  return static_cast<char*>(t.data()) + static_cast<std::size_t>(row) * row_bytes(t);
}
inline void copy_row(const HostTensor& from, int64_t from_row, HostTensor* to, int64_t to_row) {
  std::memcpy(row_data(*to, to_row), row_data(from, from_row), row_bytes(from));
}
// All bytes of `from` into `to` (same dtype and size).
inline void copy_bytes(const HostTensor& from, HostTensor* to) { std::memcpy(to->data(), from.data(), from.nbytes()); }

// Row `expected_row` of `expected` and row `actual_row` of `actual` hold the same bytes.
inline ::testing::AssertionResult rows_bitwise_equal(const HostTensor& expected, int64_t expected_row,
                                                     const HostTensor& actual, int64_t actual_row) {
  const std::size_t elements = row_bytes(expected) / dtype_size(expected.dtype());
  return bitwise_equal_bytes(row_data(expected, expected_row), row_data(actual, actual_row), elements,
                             expected.dtype());
}

// The listed rows of a table are exact zeros (every bit clear: +0.0).
inline ::testing::AssertionResult rows_are_zero(const HostTensor& table, const std::vector<int64_t>& rows) {
  for (int64_t row : rows) {
    const char* bytes = row_data(table, row);
    for (std::size_t b = 0; b < row_bytes(table); ++b)
      if (bytes[b] != 0)
        return ::testing::AssertionFailure() << "row " << row << " is not all zero bits (byte " << b << ")";
  }
  return ::testing::AssertionSuccess();
}

// One invalid call of an op: `mutate` breaks the valid forward and backward
// params alike; both must fail with `kind` and a message containing `message`.
template <typename Forward, typename Backward>
struct BadParams {
  const char* what;
  ErrorKind kind;
  const char* message;
  std::function<void(Forward*, Backward*)> mutate;
};

// Runs every case on a fresh Fixture(fixture_args...): the forward and then
// the backward are refused as the case says, and no output is written.
template <typename Fixture, typename Forward, typename Backward, typename... FixtureArgs>
void expect_bad_params_refused(const std::vector<BadParams<Forward, Backward>>& cases,
                               Status (*forward)(const Forward&, Stream), Status (*backward)(const Backward&, Stream),
                               const FixtureArgs&... fixture_args) {
  for (const BadParams<Forward, Backward>& bad : cases) {
    SCOPED_TRACE(bad.what);
    Fixture k(fixture_args...);
    Forward f = k.forward_params();
    Backward b = k.backward_params();
    bad.mutate(&f, &b);
    EXPECT_TRUE(refused(forward(f, nullptr), bad.kind, bad.message)) << "forward";
    EXPECT_TRUE(refused(backward(b, nullptr), bad.kind, bad.message)) << "backward";
    EXPECT_TRUE(still_canary(k.outputs()));
  }
}

// A (R, H) gradient output re-strided so that its rows overlap (row stride 0,
// 1 and H - 1) must make `call` fail with "<name> must not overlap itself",
// and `untouched()` must still hold (no output written).
inline void expect_overlapping_rows_refused(const TensorView& t, const char* name,
                                            const std::function<Status(const TensorView&)>& call,
                                            const std::function<::testing::AssertionResult()>& untouched) {
  const int64_t hidden = t.shape[1];
  for (int64_t stride : {int64_t{0}, int64_t{1}, hidden - 1}) {
    SCOPED_TRACE(std::string(name) + " row stride " + std::to_string(stride));
    const TensorView overlapping = TensorView::strided(t.data, t.dtype, {t.shape[0], hidden}, {stride, 1}, t.device);
    EXPECT_TRUE(refused(call(overlapping), ErrorKind::kValue,
                        std::string(name) + " must not overlap itself: its row stride " + std::to_string(stride) +
                            " is below H = " + std::to_string(hidden)));
    EXPECT_TRUE(untouched());
  }
}

}  // namespace testing
}  // namespace detdit
