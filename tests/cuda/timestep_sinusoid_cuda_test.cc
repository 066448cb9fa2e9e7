// timestep_sinusoid on CUDA: every case of cases/timestep_cases.cc (8192 timesteps with the edges 0, 1, 0.5, 1e-3,
// every dtype, C = 256, 254, 2, and the other DiT families' conventions: sigma * 1000, integer t, scale 1000,
// C = 1920, odd C, [sin | cos] with shift 1, guidance * 1000) byte-equal to the CPU reference, forward and every
// gradient; and the torch profile of every case with an FP64 oracle within the case's bound, the same bytes twice.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(TimestepSinusoidCaseCuda, "timestep_sinusoid");

// The torch profile has no CPU reference: its libdevice expf, sinf and cosf
// (within 2 ulps each) keep the features inside the bound the cases derive
// for the portable functions (2^-23 + |scale| t_max 2^-21 leaves room for
// them), and a second run gives the same bytes.
TEST(TimestepSinusoidTorchProfileCuda, OracleCasesMeetTheirBoundAndRepeat) {
  DETDIT_SKIP_WITHOUT_CUDA();
  int checked = 0;
  for (OpCase c : op_cases("timestep_sinusoid", Suite::kTest, CaseContext{})) {
    if (c.accuracy.empty()) continue;
    SCOPED_TRACE(c.full_name());
    c.numerics = Numerics::kTorch;
    std::map<std::string, HostTensor> runs[2];
    for (auto& host : runs) {
      Instance t;
      DETDIT_ASSERT_OK(instantiate(c, Device::cuda(0), nullptr, &t));
      DETDIT_ASSERT_OK(run(c, Phase::kForward, t));
      DETDIT_ASSERT_OK(run(c, Phase::kBackward, t));
      DETDIT_ASSERT_OK(download(c, t, &host));
    }
    for (const AccuracyCheck& a : c.accuracy) EXPECT_LE(a.error(runs[0]), a.bound) << a.name << " in " << a.unit;
    for (const char* name : {"features", "d_timesteps"}) EXPECT_BITWISE_EQ(runs[0].at(name), runs[1].at(name));
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
