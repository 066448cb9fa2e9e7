// timestep_sinusoid on CUDA: every case of cases/timestep_cases.cc (8192 timesteps with the edges 0, 1, 0.5, 1e-3,
// every dtype, C = 256, 254, 2) byte-equal to the CPU reference, forward and every gradient.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(TimestepSinusoidCaseCuda, "timestep_sinusoid");

}  // namespace
}  // namespace testing
}  // namespace detdit
