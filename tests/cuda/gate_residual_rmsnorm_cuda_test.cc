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

// The single-pass backward (sm_90 clusters; off by default, src/cuda/tuning.h;
// the cases above run the halves): the same bytes as the CPU on every case.
TEST(GateResidualRmsnormCuda, TheSinglePassGivesTheSameBytes) { expect_single_pass_cases_match_cpu("gate_residual_rmsnorm"); }

}  // namespace
}  // namespace testing
}  // namespace detdit
