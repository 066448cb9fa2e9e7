// GoogleTest helpers over the op-case library (cases/): one op case run on
// the CPU (CpuCase), plans built on the host (a failed build fails the test),
// tolerance, canary, repeatability and row-invariance assertions.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cases/case_builders.h"
#include "cases/op_case.h"
#include "support/test_util.h"
#include "detdit/plan.h"

namespace detdit {
namespace testing {

// Host plans of a case: the AdaLN rows (R = 3T), the timestep index (R = T),
// an explicit (S,) row index.
IndexPlan adaln_plan(const IndexCase& c);
IndexPlan timestep_plan(const IndexCase& c);
IndexPlan plan_from_rows(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch);

// Elements of every tensor of the case (tests pick the small cases by it).
int64_t case_elements(const OpCase& c);

// |got - ref| <= atol + rtol*|ref| for every element (reports the worst one).
::testing::AssertionResult within_tolerance(const HostTensor& got, const std::vector<double>& ref, double atol,
                                            double rtol);
// Every byte of every tensor is still kCanary (names the first one written).
::testing::AssertionResult still_canary(const std::vector<HostTensor*>& outputs);

// One op case on the CPU: its inputs from the case's generator (make_inputs)
// or the given host tensors, its outputs the canary, its plans built from its
// index cases (instantiate; a failure fails the test). A test builds the op's
// params from the case's views (view, plan), or runs the case's own calls
// (run); operator[] gives host copies of every tensor as of the last run (the
// inputs before one).
class CpuCase {
 public:
  explicit CpuCase(OpCase c, const std::map<std::string, HostTensor>* inputs = nullptr);
  const OpCase& op_case() const { return case_; }
  const TensorView& view(const std::string& name) const { return instance_[name]; }
  const IndexPlan& plan(const std::string& name = "plan") const { return instance_.plan(name); }
  // The forward, then the backward where the case has one; then the host copies.
  Status run();
  Status run(Phase phase);
  const HostTensor& operator[](const std::string& name) const;
  // A fresh host copy of a tensor as it is now (after a call that ran outside run()).
  HostTensor current(const std::string& name) const;
  const std::map<std::string, HostTensor>& tensors() const { return host_; }
  // Fresh host copies of the case's outputs (for still_canary after a refused call).
  std::vector<HostTensor*> outputs();

 private:
  OpCase case_;
  Instance instance_;
  std::map<std::string, HostTensor> host_, outputs_;
};

// Two runs of a case on fresh instances: every output holds the same bytes
// in both, and each was written (not still the canary). `first`: the host
// tensors of the first run.
::testing::AssertionResult repeats_bitwise(const OpCase& c, std::map<std::string, HostTensor>* first = nullptr);
// The projection half of a fused AdaLN op's run case (adaln_modulation,
// final_adaln_out) through adaln_projection: the forward from the case's
// temb, weight and bias gives its table and act; the backward from an FP32
// table gradient d_table (T, N), never rounded in between, gives its d_temb,
// d_weight and d_bias; all bitwise.
::testing::AssertionResult projection_forward_matches(const CpuCase& k);
::testing::AssertionResult projection_backward_matches(const CpuCase& k, const HostTensor& d_table);
// Row invariance on the CPU (compare_positions_alone): each listed position
// run alone gives the bytes of the full case's per-position outputs.
::testing::AssertionResult positions_alone_match(const OpCase& c, const std::vector<int64_t>& positions);

}  // namespace testing
}  // namespace detdit
