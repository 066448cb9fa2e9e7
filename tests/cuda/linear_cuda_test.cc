// linear on CUDA: every case of cases/projection_cases.cc (bias / SiLU / pre-activation / fp32 output; d_x through
// the chunk partials, given or internal scratch; d_W, d_b) byte-equal to the CPU reference at every launch tunable;
// the chunk fold d_x goes through at the edges of its kernels; linear_backward_weight_and_input (the fused d_W +
// d_x partials kernel) at the row counts the projection and MLP cases leave out; and the SiLU cast and VJP the
// projections use.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

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
  ScopedLaunchTuning tuning;
  for (bool shared_x : {true, false})
    for (int columns : {0, 1, 2, 4})
      for (int partial_rows : {1, 2, 4})
        for (int threads : {64, 1024}) {
          SCOPED_TRACE(std::string(shared_x ? "x shared" : "x global") + " columns " + std::to_string(columns) +
                       " partial rows " + std::to_string(partial_rows) + " threads " + std::to_string(threads));
          tuning->linear_shared_x = shared_x;
          tuning->linear_columns_per_warp = columns;
          tuning->linear_partial_rows = partial_rows;
          tuning->elementwise_threads = threads;
          expect_cases_match_cpu("linear", [](const OpCase& c) {
            return c.name.find("N=200") != std::string::npos || c.name.find("T=5 ") != std::string::npos ||
                   c.name.find("K=2688") != std::string::npos;
          });
        }
}

// The chunk fold on its own (d_x's fold, rmsnorm's d_weight, the SP chain's continued folds), byte-equal to the
// CPU at the edges of both kernels (one thread per column up to 64 chunks, the 64-row x 32-column shared-memory
// tiles beyond): no chunks; 64, 65, 128 and 129 chunks around the stage; widths off the 32-column tile; partial
// rows longer than the width, starting 4 bytes in; out with a stride of 2; every output dtype; from +0.0, from
// running, and in place (out is running, as in the SP chain's links).
TEST(ChunkFoldCuda, BothKernelsAtTheirEdgesMatchTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  struct Shape {
    int64_t chunks, width;
  };
  uint64_t seed = 1900;
  for (const Shape& shape : {Shape{0, 40}, Shape{64, 33}, Shape{65, 1}, Shape{128, 64}, Shape{129, 33},
                             Shape{200, 100}, Shape{1512, 2695}}) {
    const int64_t chunks = shape.chunks, width = shape.width;
    SCOPED_TRACE("chunks " + std::to_string(chunks) + " width " + std::to_string(width));
    // (chunks, width) views of (max(chunks, 1), width + 3): rows of width + 3, from column 1.
    const Pair buffer = random_pair(DType::kF32, {std::max<int64_t>(chunks, 1), width + 3}, seed++);
    const TensorView partials_h = buffer.h().narrow(0, 0, chunks).narrow(1, 1, width);
    const TensorView partials_d = buffer.d().narrow(0, 0, chunks).narrow(1, 1, width);
    const Pair running = random_pair(DType::kF32, {width}, seed++);
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      for (bool from_running : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + (from_running ? " from running" : " from +0.0"));
        const Pair out = output_pair(dtype, {width, 2});  // out is column 0: (width,) with a stride of 2
        const TensorView out_h = TensorView::strided(out.h().data, dtype, {width}, {2}, out.h().device);
        const TensorView out_d = TensorView::strided(out.d().data, dtype, {width}, {2}, out.d().device);
        const TensorView start_h = from_running ? running.h() : TensorView();
        const TensorView start_d = from_running ? running.d() : TensorView();
        DETDIT_ASSERT_OK(cpu::continue_chunk_fold(partials_h, start_h, out_h, nullptr));
        DETDIT_ASSERT_OK(cuda::continue_chunk_fold(partials_d, start_d, out_d, nullptr));
        EXPECT_GPU_EQ_CPU(out);
      }
    const Pair sums = input_pair(running.host);
    DETDIT_ASSERT_OK(cpu::continue_chunk_fold(partials_h, sums.h(), sums.h(), nullptr));
    DETDIT_ASSERT_OK(cuda::continue_chunk_fold(partials_d, sums.d(), sums.d(), nullptr));
    EXPECT_GPU_EQ_CPU(sums);
  }
}

// The fused kernel's paths that adaln_projection (bf16 T = 1, 3, 4) and timestep_mlp (fp32 T = 3, 8) leave out:
// T = 2 (16-byte vectors, 2 rows), T = 5, 6 (8-byte vectors, rows < 8), bf16 T = 8. N = 200 ends in a partial
// chunk; K = 1032 leaves the last K block partly idle at both vector widths.
TEST(LinearCuda, FusedBackwardEqualsCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const int64_t in_features = 1032, out_features = 200;
  const int64_t chunks = (out_features + kLinearChunkRows - 1) / kLinearChunkRows;
  struct Shape {
    DType dtype;
    int64_t rows;
  };
  uint64_t seed = 1950;
  for (const Shape& s : {Shape{DType::kBF16, 2}, Shape{DType::kBF16, 6}, Shape{DType::kBF16, 8},
                         Shape{DType::kF32, 2}, Shape{DType::kF32, 5}}) {
    SCOPED_TRACE(std::string(dtype_name(s.dtype)) + " T=" + std::to_string(s.rows));
    Pair x = random_pair(s.dtype, {s.rows, in_features}, seed++);
    Pair weight = random_pair(s.dtype, {out_features, in_features}, seed++, 0.0, 0.05);
    Pair grad = random_pair(DType::kF32, {s.rows, out_features}, seed++);
    Pair partials = output_pair(DType::kF32, {chunks, s.rows, in_features});
    Pair d_x = output_pair(s.dtype, {s.rows, in_features});
    Pair d_weight = output_pair(s.dtype, {out_features, in_features});
    Pair d_bias = output_pair(s.dtype, {out_features});
    for (bool device : {false, true}) {
      const auto view = [device](const Pair& p) { return device ? p.d() : p.h(); };
      DETDIT_ASSERT_OK(linear_backward_weight_and_input({view(grad), view(x), view(d_weight), view(d_bias)},
                                                        {view(grad), view(weight), view(partials), view(d_x)}));
    }
    EXPECT_GPU_EQ_CPU(partials);
    EXPECT_GPU_EQ_CPU(d_x);
    EXPECT_GPU_EQ_CPU(d_weight);
    EXPECT_GPU_EQ_CPU(d_bias);
  }
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
