// linear on CUDA: every case of cases/projection_cases.cc (bias / SiLU / pre-activation / fp32 output; d_x through
// the chunk partials, given or internal scratch; d_W, d_b) byte-equal to the CPU reference at every launch tunable;
// and the SiLU cast and VJP the projections use.
#include <gtest/gtest.h>

#include "common/backends.h"
#include "cuda/cuda_test_util.h"
#include "cuda/tuning.h"
#include "detdit/linear.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(LinearCaseCuda, "linear");

TEST(LinearCuda, EveryLaunchTuningGivesTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const cuda::LaunchTuning saved = cuda::launch_tuning();
  for (bool shared_x : {true, false})
    for (int columns : {1, 2, 4})
      for (int partial_rows : {1, 2, 4})
        for (int threads : {64, 1024}) {
          SCOPED_TRACE(std::string(shared_x ? "x shared" : "x global") + " columns " + std::to_string(columns) +
                       " partial rows " + std::to_string(partial_rows) + " threads " + std::to_string(threads));
          cuda::launch_tuning().linear_shared_x = shared_x;
          cuda::launch_tuning().linear_columns_per_warp = columns;
          cuda::launch_tuning().linear_partial_rows = partial_rows;
          cuda::launch_tuning().elementwise_threads = threads;
          expect_cases_match_cpu("linear", [](const OpCase& c) {
            return c.name.find("N=200") != std::string::npos || c.name.find("T=5 ") != std::string::npos ||
                   c.name.find("K=2688") != std::string::npos;
          });
        }
  cuda::launch_tuning() = saved;
}

TEST(SiluCuda, CastAndBackward) {
  DETDIT_SKIP_WITHOUT_CUDA();
  Pair temb = random_pair(DType::kF32, {7, 333}, 1200, 0.0, 8.0);
  for (DType act_dtype : {DType::kBF16, DType::kF32, DType::kF16}) {
    Pair act = output_pair(act_dtype, {7, 333});
    DETDIT_ASSERT_OK(cpu::silu_cast(temb.h(), act.h(), Numerics::kPortable, nullptr));
    DETDIT_ASSERT_OK(cuda::silu_cast(temb.d(), act.d(), Numerics::kPortable, nullptr));
    EXPECT_GPU_EQ_CPU(act);
  }
  Pair grad = random_pair(DType::kF32, {7, 333}, 1201), d_pre = output_pair(DType::kF32, {7, 333});
  DETDIT_ASSERT_OK(silu_backward(SiluBackwardParams{grad.h(), temb.h(), d_pre.h()}));
  DETDIT_ASSERT_OK(silu_backward(SiluBackwardParams{grad.d(), temb.d(), d_pre.d()}));
  EXPECT_GPU_EQ_CPU(d_pre);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
