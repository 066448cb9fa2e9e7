// gate_residual on CUDA: every case of cases/rowwise_cases.cc (every dtype, H not a multiple of the widest vector,
// strided and contiguous gates, d_gate in the gate's dtype, H3 shapes) byte-equal to the CPU reference, forward and
// every gradient, at every launch tunable.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "cuda/tuning.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(GateResidualCaseCuda, "gate_residual");

// The halves (rows kernel, then partials) at every tunable: the same bytes.
TEST(GateResidualCuda, EveryLaunchTuningGivesTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  ScopedLaunchTuning tuning;
  for (int threads : {64, 256, 1024})
    for (int vector_bytes : {16, 8, 4, 2})
      for (int cols : {1, 2, 4}) {
        SCOPED_TRACE("threads " + std::to_string(threads) + " vector " + std::to_string(vector_bytes) + " cols " +
                     std::to_string(cols));
        tuning->elementwise_threads = threads;
        tuning->vector_bytes = vector_bytes;
        tuning->partial_columns_per_thread = cols;
        expect_cases_match_cpu("gate_residual", [](const OpCase& c) { return c.positions == 514; });
      }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
