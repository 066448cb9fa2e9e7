// gate_residual_rmsnorm on CUDA: every case of cases/rowwise_cases.cc (plain and modulated norms, with and
// without d_h, every dtype, both packings, table gradients in the table dtype, H3 shapes) byte-equal to the CPU
// reference, forward and every gradient.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(GateResidualRmsnormCaseCuda, "gate_residual_rmsnorm");

}  // namespace
}  // namespace testing
}  // namespace detdit
