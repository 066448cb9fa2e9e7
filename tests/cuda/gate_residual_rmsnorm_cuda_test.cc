// gate_residual_rmsnorm on CUDA: every case of cases/rowwise_cases.cc (plain and modulated norms, with and
// without d_h, every dtype, both packings, table gradients in the table dtype, H3 shapes) byte-equal to the CPU
// reference, forward and every gradient, through the backward's two walks and the halves.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "cuda/tuning.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(GateResidualRmsnormCaseCuda, "gate_residual_rmsnorm");

// The cases above run the backward's walk where it applies (the modulated
// norm; src/cuda/tuning.h); the halves (rows, then each op's partials) give
// the same bytes as the CPU on every case too.
TEST(GateResidualRmsnormCuda, TheHalvesGiveTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  ScopedLaunchTuning tuning;
  tuning->region_backward_walk = false;
  expect_cases_match_cpu("gate_residual_rmsnorm");
}

// The row walk (sm_90) on every case it can take, down to a single chunk and
// with chunks whose segments alternate (each revisit resumes the segment's
// chains from its partial rows); and the column-block walk where the row walk
// would run by default (the H3 cases).
TEST(GateResidualRmsnormCuda, TheRowWalkGivesTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  ScopedLaunchTuning tuning;
  tuning->region_row_walk_min_chunks = 1;
  tuning->region_row_walk_max_segments = 32;
  expect_cases_match_cpu("gate_residual_rmsnorm");
}
TEST(GateResidualRmsnormCuda, TheColumnBlockWalkGivesTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  ScopedLaunchTuning tuning;
  tuning->region_row_walk = false;
  expect_cases_match_cpu("gate_residual_rmsnorm");
}

}  // namespace
}  // namespace testing
}  // namespace detdit
