// adaln_table_add on CUDA: every case of cases/projection_cases.cc (Wan's and
// LTX-Video's promotions, the (T, 1, H) broadcast, T past one 256-row chunk)
// byte-equal to the CPU reference, forward and both gradients.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(AdalnTableAddCaseCuda, "adaln_table_add");

}  // namespace
}  // namespace testing
}  // namespace detdit
