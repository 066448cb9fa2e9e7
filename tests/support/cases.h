// GoogleTest helpers over the op-case library's index cases and oracles:
// plans built on the host (a failed build fails the test), tolerance and
// canary assertions.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "support/test_util.h"
#include "detdit/plan.h"

namespace detdit {
namespace testing {

// Host plans of a case: the AdaLN rows (R = 3T), the timestep index (R = T),
// an explicit (S,) row index.
IndexPlan adaln_plan(const IndexCase& c);
IndexPlan timestep_plan(const IndexCase& c);
IndexPlan plan_from_rows(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch);

// |got - ref| <= atol + rtol*|ref| for every element (reports the worst one).
::testing::AssertionResult within_tolerance(const HostTensor& got, const std::vector<double>& ref, double atol,
                                            double rtol);
// Every byte of every tensor is still kCanary (names the first one written).
::testing::AssertionResult still_canary(const std::vector<HostTensor*>& outputs);

}  // namespace testing
}  // namespace detdit
