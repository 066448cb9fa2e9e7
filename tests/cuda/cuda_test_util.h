// The CUDA tests' helpers over the op-case library: every registered case run
// on the CPU and on the GPU with every output compared bitwise (the drivers of
// tests/cuda/<op>_cuda_test.cc), and device tensors for the hand-written
// tests: the same tensor on the host and on the device (Pair), uploads and
// downloads that fail the test instead of returning a Status.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cases/op_case.h"
#include "cuda/tuning.h"
#include "support/cases.h"
#include "support/test_util.h"
#include "detdit/plan.h"
#include "detdit/tensor.h"

namespace detdit {
namespace testing {

#define DETDIT_CUDA_CHECK(expr)                                                   \
  do {                                                                            \
    cudaError_t e_ = (expr);                                                      \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);        \
  } while (0)

// ---- the op-case drivers -------------------------------------------------------

// The case on the CPU and on cuda:0, forward then backward: every output of
// the GPU byte-equal to the CPU's, and no CPU output left as the canary.
inline ::testing::AssertionResult matches_cpu(const OpCase& c) {
  std::vector<OutputReport> reports;
  const Status s = compare_with_cpu(c, Device::cuda(0), &reports);
  if (!s.ok()) return ::testing::AssertionFailure() << c.full_name() << ": " << s.to_string();
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  bool failed = false;
  std::string why;
  for (const OutputReport& r : reports) {
    if (r.still_canary) why += "\n  " + r.output + ": the CPU output is still the canary (nothing was written)";
    if (!r.mismatch.equal()) why += "\n  " + r.output + ": " + r.mismatch.describe();
    failed = failed || r.still_canary || !r.mismatch.equal();
  }
  if (!failed) return result;
  return ::testing::AssertionFailure() << c.full_name() << why;
}

// One GoogleTest test per test-suite case of `op` (named after the case):
// DETDIT_CUDA_OP_CASES(RmsnormCaseCuda, "rmsnorm") defines Cases/RmsnormCaseCuda.EqualsTheCpu/<case>.
std::string case_test_name(const ::testing::TestParamInfo<OpCase>& info);
#define DETDIT_CUDA_OP_CASES(Fixture, op)                                                                \
  class Fixture : public ::testing::TestWithParam<::detdit::cases::OpCase> {};                          \
  TEST_P(Fixture, EqualsTheCpu) {                                                                        \
    DETDIT_SKIP_WITHOUT_CUDA();                                                                          \
    EXPECT_TRUE(::detdit::testing::matches_cpu(GetParam()));                                             \
  }                                                                                                      \
  INSTANTIATE_TEST_SUITE_P(Cases, Fixture,                                                               \
                           ::testing::ValuesIn(::detdit::cases::op_cases(op, ::detdit::cases::Suite::kTest, \
                                                                         ::detdit::cases::CaseContext{})), \
                           ::detdit::testing::case_test_name)

// Every test-suite case of `op` (those `keep` accepts) matches the CPU.
inline void expect_cases_match_cpu(const std::string& op, const std::function<bool(const OpCase&)>& keep = {}) {
  const std::vector<OpCase> cases = op_cases(op, Suite::kTest, CaseContext{});
  ASSERT_FALSE(cases.empty()) << "no test cases registered for " << op;
  int checked = 0;
  for (const OpCase& c : cases) {
    if (keep && !keep(c)) continue;
    EXPECT_TRUE(matches_cpu(c));
    ++checked;
  }
  EXPECT_GT(checked, 0) << "every case of " << op << " was filtered out";
}

// The launch tunables (src/cuda/tuning.h) of this thread's launches for the
// scope: they start as the values in force at construction, `tuning->field =
// v` changes them, and the previous ones come back when the scope ends, also
// when a fatal assertion leaves the test early, so no test leaks its tunables
// into the next. The ops a test runs launch on its own thread.
class ScopedLaunchTuning {
 public:
  ScopedLaunchTuning() : tuning_(cuda::launch_tuning()), previous_(cuda::set_test_launch_tuning(&tuning_)) {}
  ~ScopedLaunchTuning() { cuda::set_test_launch_tuning(previous_); }
  ScopedLaunchTuning(const ScopedLaunchTuning&) = delete;
  ScopedLaunchTuning& operator=(const ScopedLaunchTuning&) = delete;
  cuda::LaunchTuning* operator->() { return &tuning_; }

 private:
  cuda::LaunchTuning tuning_;
  const cuda::LaunchTuning* previous_;
};

inline std::string case_test_name(const ::testing::TestParamInfo<OpCase>& info) {
  std::string name = std::to_string(info.index) + "_";
  for (char ch : info.param.name) name += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return name;
}

// ---- device tensors for the hand-written tests ---------------------------------

inline DeviceTensor upload(const HostTensor& host) {
  DeviceTensor d;
  const Status s = DeviceTensor::from_host(host, Device::cuda(0), &d);
  if (!s.ok()) ADD_FAILURE() << "upload: " << s.to_string();
  return d;
}
// `shape` on cuda:0, every byte kCanary.
inline DeviceTensor device_empty(DType dtype, std::vector<int64_t> shape) {
  DeviceTensor d;
  const Status s = DeviceTensor::empty(dtype, std::move(shape), Device::cuda(0), &d);
  if (!s.ok()) ADD_FAILURE() << "device tensor: " << s.to_string();
  return d;
}
inline HostTensor download(const DeviceTensor& d) {
  HostTensor h;
  const Status s = d.to_host(&h);
  if (!s.ok()) ADD_FAILURE() << "download: " << s.to_string();
  return h;
}
inline void fill_device(DeviceTensor* d, uint8_t value) {
  const Status s = d->fill_bytes(value);
  if (!s.ok()) ADD_FAILURE() << "fill: " << s.to_string();
}

// The same tensor on the host (CPU run) and on the device (GPU run). Inputs
// hold equal bytes on both sides; outputs start as the canary on both sides.
struct Pair {
  HostTensor host;
  DeviceTensor dev;
  TensorView h() const { return host.view(); }
  TensorView d() const { return dev.view(); }
  HostTensor result() const { return download(dev); }
};
inline Pair input_pair(const HostTensor& t) { return Pair{t, upload(t)}; }
inline Pair output_pair(DType dtype, std::vector<int64_t> shape) {
  HostTensor host(dtype, shape);
  host.fill_bytes(kCanary);
  return Pair{std::move(host), device_empty(dtype, std::move(shape))};
}
// Counter-uniform inputs with the given mean and standard deviation (fast for H3 sizes).
inline Pair random_pair(DType dtype, std::vector<int64_t> shape, uint64_t seed, double mean = 0.0, double std = 1.0) {
  HostTensor t(dtype, std::move(shape));
  fill_counter_uniform(&t, seed, mean, std);
  return input_pair(t);
}

// GPU bytes equal CPU bytes, and the CPU output is not the canary.
inline ::testing::AssertionResult gpu_equals_cpu(const Pair& p) {
  if (p.host.nbytes() > 0 && all_bytes_are(p.host, kCanary))
    return ::testing::AssertionFailure() << "the CPU output is still the canary (nothing was written)";
  return bitwise_equal(p.host, p.result());
}
#define EXPECT_GPU_EQ_CPU(pair) EXPECT_TRUE(::detdit::testing::gpu_equals_cpu(pair)) << #pair

// A plan on the host and its twin on the device (built from device copies of
// the index, exercising the CUDA path of plan building).
struct PlanPair {
  IndexPlan host, dev;
};
inline PlanPair adaln_plan_pair(const IndexCase& c) {
  PlanPair plans{adaln_plan(c), IndexPlan()};
  const Status s = cases::adaln_plan(c, Device::cuda(0), &plans.dev);
  if (!s.ok()) ADD_FAILURE() << s.to_string();
  return plans;
}
inline PlanPair timestep_plan_pair(const IndexCase& c) {
  PlanPair plans{timestep_plan(c), IndexPlan()};
  const Status s = cases::timestep_plan(c, Device::cuda(0), &plans.dev);
  if (!s.ok()) ADD_FAILURE() << s.to_string();
  return plans;
}

}  // namespace testing
}  // namespace detdit
