// gate_residual_rmsnorm on CUDA: every case of cases/rowwise_cases.cc (plain and modulated norms, with and
// without d_h, every dtype, both packings, table gradients in the table dtype, H3 shapes) byte-equal to the CPU
// reference, forward and every gradient, through the single-pass kernel and through the halves.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "cuda/tuning.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(GateResidualRmsnormCaseCuda, "gate_residual_rmsnorm");

// The composition of the halves (the path of GPUs without clusters): the same bytes as the CPU.
TEST(GateResidualRmsnormCuda, TheHalvesGiveTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const cuda::LaunchTuning saved = cuda::launch_tuning();
  cuda::launch_tuning().single_pass = false;
  expect_cases_match_cpu("gate_residual_rmsnorm", [](const OpCase& c) { return c.positions <= 2000; });
  cuda::launch_tuning() = saved;
}

}  // namespace
}  // namespace testing
}  // namespace detdit
