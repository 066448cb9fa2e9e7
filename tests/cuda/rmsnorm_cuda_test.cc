// rmsnorm on CUDA: every case of cases/rowwise_cases.cc (plain and modulated, every dtype, awkward and H3 shapes,
// both packings, unaligned table rows, table gradients in the table dtype) byte-equal to the CPU reference, forward
// and every gradient, at every launch tunable.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "cuda/tuning.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(RmsnormCaseCuda, "rmsnorm");

// The table partials fused into the d_weight walk (when every chunk's segment
// sums fit in shared memory) or in a second walk, at every column count: the
// same bytes (numerics fixes the orders; tunables only change who computes
// what).
TEST(RmsnormCuda, EveryLaunchTuningGivesTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  ScopedLaunchTuning tuning;
  for (bool fused : {true, false})
    for (int cols : {1, 2, 4}) {
      SCOPED_TRACE(std::string(fused ? "fused" : "two-pass") + " cols " + std::to_string(cols));
      tuning->rmsnorm_fused_partials = fused;
      tuning->partial_columns_per_thread = cols;
      expect_cases_match_cpu("rmsnorm", [](const OpCase& c) { return c.positions >= 257 && c.positions <= 2000; });
    }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
