// tests/support/cases.h.
#include "support/cases.h"

#include <cmath>

namespace detdit {
namespace testing {
namespace {
IndexPlan must_plan(const Status& s, const IndexPlan& plan) {
  EXPECT_TRUE(s.ok()) << s.to_string();
  return plan;
}
}  // namespace

IndexPlan adaln_plan(const IndexCase& c) {
  IndexPlan plan;
  return must_plan(cases::adaln_plan(c, Device::cpu(), &plan), plan);
}

IndexPlan timestep_plan(const IndexCase& c) {
  IndexPlan plan;
  return must_plan(cases::timestep_plan(c, Device::cpu(), &plan), plan);
}

IndexPlan plan_from_rows(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch) {
  IndexPlan plan;
  return must_plan(row_plan(rows, num_rows, batch, Device::cpu(), &plan), plan);
}

::testing::AssertionResult within_tolerance(const HostTensor& got, const std::vector<double>& ref, double atol,
                                            double rtol) {
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double err = std::fabs(got.get(i) - ref[i]), bound = atol + rtol * std::fabs(ref[i]);
    if (!(err <= bound)) {
      ++bad;
      if (worst < 0 || err - bound > worst_excess) {
        worst = i;
        worst_excess = err - bound;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements outside atol " << atol
                                       << " / rtol " << rtol << "; worst at " << worst << ": got " << got.get(worst)
                                       << ", reference " << ref[worst];
}

::testing::AssertionResult still_canary(const std::vector<HostTensor*>& outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (!all_bytes_are(*outputs[i], kCanary))
      return ::testing::AssertionFailure() << "output " << i << " of " << outputs.size() << " was written";
  return ::testing::AssertionSuccess();
}

}  // namespace testing
}  // namespace detdit
