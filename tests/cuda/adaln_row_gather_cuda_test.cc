// adaln_row_gather on CUDA: every case of cases/rowwise_cases.cc (every dtype, strided rows, d_rows in the rows'
// dtype, H3 shapes) byte-equal to the CPU reference, forward and backward, at every launch tunable.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "cuda/tuning.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(AdalnRowGatherCaseCuda, "adaln_row_gather");

TEST(AdalnRowGatherCuda, EveryLaunchTuningGivesTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  ScopedLaunchTuning tuning;
  for (int vector_bytes : {16, 8, 4, 2})
    for (int cols : {1, 2, 4}) {
      SCOPED_TRACE("vector " + std::to_string(vector_bytes) + " cols " + std::to_string(cols));
      tuning->vector_bytes = vector_bytes;
      tuning->partial_columns_per_thread = cols;
      expect_cases_match_cpu("adaln_row_gather", [](const OpCase& c) { return c.name.find("S257") != std::string::npos; });
    }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
