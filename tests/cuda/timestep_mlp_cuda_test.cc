// timestep_mlp on CUDA: every case of cases/timestep_cases.cc (an awkward and the H3 shape, FP32) and of
// cases/embedding_cases.cc (bf16: Flux's and SD3's time and pooled-text MLPs scaled down, Flux's time MLP and both
// pooled-text MLPs at their real shapes; an fp32 pooled-text one) byte-equal to the CPU reference, forward and every
// gradient.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(TimestepMlpCaseCuda, "timestep_mlp");

}  // namespace
}  // namespace testing
}  // namespace detdit
