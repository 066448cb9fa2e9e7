// final_adaln_out on CUDA: every case of cases/projection_cases.cc (bf16 and fp32, awkward and H3 shapes) byte-equal
// to the CPU reference, forward and every gradient.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(FinalAdalnOutCaseCuda, "final_adaln_out");

}  // namespace
}  // namespace testing
}  // namespace detdit
