// adaln_modulation on CUDA: every case of cases/projection_cases.cc (awkward and H3 shapes, both packings) byte-equal
// to the CPU reference, forward and every gradient.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(AdalnModulationCaseCuda, "adaln_modulation");

}  // namespace
}  // namespace testing
}  // namespace detdit
