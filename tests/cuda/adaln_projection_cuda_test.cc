// adaln_projection on CUDA: every case of cases/projection_cases.cc (awkward and H3 shapes) byte-equal to the CPU
// reference, forward and every gradient.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(AdalnProjectionCaseCuda, "adaln_projection");

}  // namespace
}  // namespace testing
}  // namespace detdit
