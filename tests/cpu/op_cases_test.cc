// The op-case library itself (cases/), on the CPU: every registered test case
// instantiates, runs forward and backward, and writes every output (none is
// left all canary); every case with a one-position form is row-invariant
// (probe positions alone equal the same positions inside the batch, bitwise).
// The CUDA tests run the same cases on the GPU against these CPU runs.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "cases/op_case.h"
#include "support/cases.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {
namespace {

// The cases small enough to run here (the H3-sized test cases are for the GPU).
constexpr int64_t kMaxElements = 4 << 20;

TEST(OpCases, EveryOpHasTestCases) {
  for (const char* op : {"rmsnorm", "gate_residual", "gate_residual_rmsnorm", "layernorm", "gate_residual_layernorm",
                         "adaln_row_gather", "linear", "adaln_projection",
                         "adaln_modulation", "final_adaln_out", "timestep_sinusoid", "timestep_mlp",
                         "adaln_table_add"}) {
    EXPECT_FALSE(op_cases(op, Suite::kTest, CaseContext{}).empty()) << op;
  }
}

TEST(OpCases, EveryCaseRunsAndWritesEveryOutput) {
  int ran = 0;
  for (const OpCase& c : op_cases("", Suite::kTest, CaseContext{})) {
    if (case_elements(c) > kMaxElements) continue;
    SCOPED_TRACE(c.full_name());
    Instance t;
    DETDIT_ASSERT_OK(instantiate(c, Device::cpu(), nullptr, &t));
    for (Phase phase : {Phase::kForward, Phase::kBackward}) {
      if (c.has(phase)) DETDIT_ASSERT_OK(run(c, phase, t));
    }
    std::map<std::string, HostTensor> host;
    DETDIT_ASSERT_OK(download(c, t, &host));
    for (const TensorSpec& spec : c.tensors) {
      if (spec.output && host.at(spec.name).nbytes() > 0) {
        EXPECT_FALSE(all_bytes_are(host.at(spec.name), kCanary)) << spec.name << " was not written";
      }
    }
    EXPECT_GT(c.bytes[0], 0) << "no forward bytes floor";
    ++ran;
  }
  EXPECT_GT(ran, 100);
}

TEST(OpCases, PositionAloneEqualsPositionInBatch) {
  int checked = 0;
  for (const OpCase& c : op_cases("", Suite::kTest, CaseContext{})) {
    if (!c.alone || c.positions < 2 || case_elements(c) > kMaxElements) continue;
    SCOPED_TRACE(c.full_name());
    std::vector<OutputReport> reports;
    DETDIT_ASSERT_OK(compare_positions_alone(c, Device::cpu(), {0, c.positions / 2, c.positions - 1}, &reports));
    ASSERT_FALSE(reports.empty());
    for (const OutputReport& r : reports) EXPECT_TRUE(r.mismatch.equal()) << r.output << ": " << r.mismatch.describe();
    ++checked;
  }
  EXPECT_GT(checked, 50);
}

// The FP64 accuracy checks of the test cases (verify runs those of its own
// suite): each case's CPU output within the bound its check states.
TEST(OpCases, EveryTestCaseMeetsItsAccuracyBound) {
  int checked = 0;
  for (const OpCase& c : op_cases("", Suite::kTest, CaseContext{})) {
    if (c.accuracy.empty() || case_elements(c) > kMaxElements) continue;
    SCOPED_TRACE(c.full_name());
    Instance t;
    DETDIT_ASSERT_OK(instantiate(c, Device::cpu(), nullptr, &t));
    DETDIT_ASSERT_OK(run(c, Phase::kForward, t));
    std::map<std::string, HostTensor> host;
    DETDIT_ASSERT_OK(download(c, t, &host));
    for (const AccuracyCheck& a : c.accuracy) {
      const double error = a.error(host);
      EXPECT_LE(error, a.bound) << a.name << " in " << a.unit;  // NaN fails too
    }
    ++checked;
  }
  EXPECT_GT(checked, 50);
}

// The second routes of the test cases (verify runs those of its own suite):
// every output the route gives, of both phases (the forward's alone where
// forward_only), equal to the CPU run's, bitwise.
TEST(OpCases, EveryTestCaseEqualsItsEquivalentRoute) {
  int checked = 0;
  for (const OpCase& c : op_cases("", Suite::kTest, CaseContext{})) {
    if (!c.equivalent.compute || case_elements(c) > kMaxElements) continue;
    SCOPED_TRACE(c.full_name() + " " + c.equivalent.name);
    Instance t;
    DETDIT_ASSERT_OK(instantiate(c, Device::cpu(), nullptr, &t));
    const int phases = c.equivalent.forward_only || !c.has(Phase::kBackward) ? 1 : 2;
    for (Phase phase : {Phase::kForward, Phase::kBackward}) {
      if (c.has(phase)) DETDIT_ASSERT_OK(run(c, phase, t));
    }
    std::map<std::string, HostTensor> got, expected;
    DETDIT_ASSERT_OK(download(c, t, &got));
    DETDIT_ASSERT_OK(c.equivalent.compute(got, &expected));
    int compared = 0;
    for (int phase = 0; phase < phases; ++phase)
      for (const OutputReport& r : compare_outputs(c, static_cast<Phase>(phase), expected, got)) {
        EXPECT_TRUE(r.mismatch.equal()) << r.output << ": " << r.mismatch.describe();
        EXPECT_FALSE(r.still_canary) << r.output;
        ++compared;
      }
    EXPECT_GT(compared, 0);
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

// A case's profile reaches the op: every case that says its op takes one,
// asked for the torch profile on the CPU, has its forward refused by the op's
// own check (the torch profile exists on CUDA only), its forward outputs
// still the canary. A case whose run functions dropped the profile would run
// in the portable profile instead, and fail here.
TEST(OpCases, TheTorchProfileReachesTheOpOfEveryCaseThatTakesOne) {
  int checked = 0;
  for (OpCase c : op_cases("", Suite::kTest, CaseContext{})) {
    if (!c.takes_profile || case_elements(c) > kMaxElements) continue;
    SCOPED_TRACE(c.full_name());
    c.numerics = Numerics::kTorch;
    Instance t;
    DETDIT_ASSERT_OK(instantiate(c, Device::cpu(), nullptr, &t));
    const Status s = run(c, Phase::kForward, t);
    EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
    EXPECT_NE(s.message().find("numerics=torch exists on CUDA only"), std::string::npos) << s.to_string();
    std::map<std::string, HostTensor> host;
    DETDIT_ASSERT_OK(download(c, t, &host));
    for (const TensorSpec& spec : c.tensors) {
      if (spec.output && spec.phase == Phase::kForward && host.at(spec.name).nbytes() > 0) {
        EXPECT_TRUE(all_bytes_are(host.at(spec.name), kCanary)) << spec.name << " was written";
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 50);
}

// A deliberately wrong comparison must fail: the mismatch report is not vacuous.
TEST(OpCases, AMismatchIsReported) {
  HostTensor a(DType::kBF16, {4}), b(DType::kBF16, {4});
  a.set(2, 1.0);
  b.set(2, 1.0078125);  // one bf16 ulp above 1
  const Mismatch m = compare(a, b);
  EXPECT_FALSE(m.equal());
  EXPECT_EQ(m.count, 1);
  EXPECT_EQ(m.first, 2);
  EXPECT_EQ(m.first_ulp, 1u);
  EXPECT_NE(m.describe().find("0x3f80"), std::string::npos) << m.describe();
}

}  // namespace
}  // namespace testing
}  // namespace detdit
