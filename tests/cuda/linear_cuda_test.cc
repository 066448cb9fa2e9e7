// CPU vs GPU, bitwise, portable profile: linear (forward with bias / SiLU /
// pre-activation / fp32 output, d_x partials + fold, d_W, d_b), silu_cast,
// silu_backward, timestep_sinusoid, timestep_mlp, adaln_projection,
// adaln_modulation and final_adaln_out, forward and every gradient; awkward
// shapes (N = 64, 72, 128; K = 8, 24) and the H3 shapes (few); every linear
// launch tunable.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/backends.h"
#include "cuda/cuda_test_util.h"
#include "cuda/tuning.h"
#include "detdit/adaln.h"
#include "detdit/linear.h"
#include "detdit/timestep.h"

namespace detdit {
namespace testing {
namespace {

constexpr int64_t kH3Hidden = 5376, kH3TimeDim = 2688;

int64_t chunks_of(int64_t n) { return (n + kLinearChunkRows - 1) / kLinearChunkRows; }

void check_linear(DType dtype, int64_t rows, int64_t k, int64_t n, uint64_t seed, bool bias, bool silu,
                  DType out_dtype) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " T=" + std::to_string(rows) + " K=" + std::to_string(k) +
               " N=" + std::to_string(n) + (bias ? " bias" : "") + (silu ? " silu" : "") + " out " +
               dtype_name(out_dtype));
  Pair x = random_pair(dtype, {rows, k}, seed), w = random_pair(dtype, {n, k}, seed + 1, 0.0, 0.05);
  Pair b = random_pair(dtype, {n}, seed + 2);
  Pair out = output_pair(out_dtype, {rows, n}), pre = output_pair(DType::kF32, {rows, n});
  LinearParams cpu{x.h(), w.h(), bias ? b.h() : TensorView{}, out.h(), pre.h(),
                   silu ? Activation::kSilu : Activation::kNone};
  LinearParams gpu{x.d(), w.d(), bias ? b.d() : TensorView{}, out.d(), pre.d(),
                   silu ? Activation::kSilu : Activation::kNone};
  DETDIT_ASSERT_OK(linear_forward(cpu));
  DETDIT_ASSERT_OK(linear_forward(gpu));
  EXPECT_GPU_EQ_CPU(out);
  EXPECT_GPU_EQ_CPU(pre);

  Pair grad = random_pair(DType::kF32, {rows, n}, seed + 3);
  Pair partials = output_pair(DType::kF32, {chunks_of(n), rows, k}), d_x = output_pair(dtype, {rows, k});
  LinearBackwardInputParams ic{grad.h(), w.h(), partials.h(), d_x.h()};
  LinearBackwardInputParams ig{grad.d(), w.d(), partials.d(), d_x.d()};
  DETDIT_ASSERT_OK(linear_backward_input(ic));
  DETDIT_ASSERT_OK(linear_backward_input(ig));
  EXPECT_GPU_EQ_CPU(partials);
  EXPECT_GPU_EQ_CPU(d_x);
  // partials absent: internal stream-ordered scratch, the same bytes.
  Pair d_x_scratch = output_pair(dtype, {rows, k});
  DETDIT_ASSERT_OK(linear_backward_input({grad.d(), w.d(), TensorView(), d_x_scratch.d()}));
  EXPECT_BITWISE_EQ(d_x.host, d_x_scratch.result());

  Pair d_w = output_pair(dtype, {n, k}), d_b = output_pair(dtype, {n});
  LinearBackwardWeightParams wc{grad.h(), x.h(), d_w.h(), d_b.h()};
  LinearBackwardWeightParams wg{grad.d(), x.d(), d_w.d(), d_b.d()};
  DETDIT_ASSERT_OK(linear_backward_weight(wc));
  DETDIT_ASSERT_OK(linear_backward_weight(wg));
  EXPECT_GPU_EQ_CPU(d_w);
  EXPECT_GPU_EQ_CPU(d_b);
}

TEST(LinearCuda, AwkwardShapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  uint64_t seed = 1000;
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (int64_t rows : {1, 3, 9})
      for (int64_t k : {8, 24, 264})
        for (int64_t n : {64, 72, 128, 1})
          check_linear(dtype, rows, k, n, seed++, n != 72, rows == 3, rows == 9 ? DType::kF32 : dtype);
}

TEST(LinearCuda, EveryLaunchTuningGivesTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const cuda::LaunchTuning saved = cuda::launch_tuning();
  for (int columns : {1, 2, 4})
    for (int partial_rows : {1, 2, 4})
      for (int threads : {64, 1024}) {
        SCOPED_TRACE("columns " + std::to_string(columns) + " partial rows " + std::to_string(partial_rows) +
                     " threads " + std::to_string(threads));
        cuda::launch_tuning().linear_columns_per_warp = columns;
        cuda::launch_tuning().linear_partial_rows = partial_rows;
        cuda::launch_tuning().elementwise_threads = threads;
        check_linear(DType::kBF16, 9, 264, 200, 1100, true, true, DType::kBF16);
        check_linear(DType::kF32, 5, 24, 72, 1101, true, false, DType::kF32);
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

TEST(TimestepSinusoidCuda, ManyTimestepsEveryDtype) {
  DETDIT_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t channels : {256, 254, 2}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " C=" + std::to_string(channels));
      const int64_t count = 8192;
      HostTensor t(dtype, {count});
      fill_uniform(&t, 1300, 0.0, 1.0);
      const double edges[4] = {0.0, 1.0, 0.5, 1e-3};
      for (int i = 0; i < 4; ++i) t.set(i, edges[i]);
      Pair ts = input_pair(t);
      Pair features = output_pair(DType::kF32, {count, channels});
      DETDIT_ASSERT_OK(timestep_sinusoid_forward(TimestepSinusoidParams{{ts.h()}, features.h()}));
      DETDIT_ASSERT_OK(timestep_sinusoid_forward(TimestepSinusoidParams{{ts.d()}, features.d()}));
      EXPECT_GPU_EQ_CPU(features);
      Pair grad = random_pair(DType::kF32, {count, channels}, 1301), d_t = output_pair(dtype, {count});
      DETDIT_ASSERT_OK(timestep_sinusoid_backward(TimestepSinusoidBackwardParams{{ts.h()}, grad.h(), d_t.h()}));
      DETDIT_ASSERT_OK(timestep_sinusoid_backward(TimestepSinusoidBackwardParams{{ts.d()}, grad.d(), d_t.d()}));
      EXPECT_GPU_EQ_CPU(d_t);
    }
}

void check_timestep_mlp(int64_t rows, int64_t k, int64_t hidden, int64_t dim, uint64_t seed) {
  SCOPED_TRACE("T=" + std::to_string(rows) + " K=" + std::to_string(k) + " H=" + std::to_string(hidden) +
               " D=" + std::to_string(dim));
  Pair f = random_pair(DType::kF32, {rows, k}, seed), w1 = random_pair(DType::kF32, {hidden, k}, seed + 1, 0.0, 0.05);
  Pair b1 = random_pair(DType::kF32, {hidden}, seed + 2), w2 = random_pair(DType::kF32, {dim, hidden}, seed + 3, 0.0, 0.02);
  Pair b2 = random_pair(DType::kF32, {dim}, seed + 4);
  Pair temb = output_pair(DType::kF32, {rows, dim}), pre = output_pair(DType::kF32, {rows, hidden});
  Pair hid = output_pair(DType::kF32, {rows, hidden});
  DETDIT_ASSERT_OK(timestep_mlp_forward(
      TimestepMlpParams{{f.h(), w1.h(), b1.h(), w2.h(), b2.h()}, temb.h(), pre.h(), hid.h()}));
  DETDIT_ASSERT_OK(timestep_mlp_forward(
      TimestepMlpParams{{f.d(), w1.d(), b1.d(), w2.d(), b2.d()}, temb.d(), pre.d(), hid.d()}));
  EXPECT_GPU_EQ_CPU(temb);
  EXPECT_GPU_EQ_CPU(pre);
  EXPECT_GPU_EQ_CPU(hid);
  Pair g = random_pair(DType::kF32, {rows, dim}, seed + 5);
  Pair d_f = output_pair(DType::kF32, {rows, k}), d_w1 = output_pair(DType::kF32, {hidden, k});
  Pair d_b1 = output_pair(DType::kF32, {hidden}), d_w2 = output_pair(DType::kF32, {dim, hidden});
  Pair d_b2 = output_pair(DType::kF32, {dim});
  DETDIT_ASSERT_OK(timestep_mlp_backward(TimestepMlpBackwardParams{
      {f.h(), w1.h(), b1.h(), w2.h(), b2.h()}, pre.h(), hid.h(), g.h(), d_f.h(), d_w1.h(), d_b1.h(), d_w2.h(), d_b2.h()}));
  DETDIT_ASSERT_OK(timestep_mlp_backward(TimestepMlpBackwardParams{
      {f.d(), w1.d(), b1.d(), w2.d(), b2.d()}, pre.d(), hid.d(), g.d(), d_f.d(), d_w1.d(), d_b1.d(), d_w2.d(), d_b2.d()}));
  for (const Pair* p : {&d_f, &d_w1, &d_b1, &d_w2, &d_b2}) EXPECT_GPU_EQ_CPU(*p);
}

TEST(TimestepMlpCuda, AwkwardAndH3Shapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_timestep_mlp(3, 24, 72, 64, 1400);
  check_timestep_mlp(8, 256, kH3Hidden, kH3TimeDim, 1401);
}

void check_projection(int64_t rows, int64_t dim, int64_t n, DType dtype, uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " T=" + std::to_string(rows) + " D=" + std::to_string(dim) +
               " N=" + std::to_string(n));
  Pair temb = random_pair(DType::kF32, {rows, dim}, seed, 0.0, 3.0);
  Pair w = random_pair(dtype, {n, dim}, seed + 1, 0.0, 0.02), b = random_pair(dtype, {n}, seed + 2);
  Pair table = output_pair(dtype, {rows, n}), act = output_pair(dtype, {rows, dim});
  DETDIT_ASSERT_OK(adaln_projection_forward(AdalnProjectionParams{{temb.h(), w.h(), b.h()}, table.h(), act.h()}));
  DETDIT_ASSERT_OK(adaln_projection_forward(AdalnProjectionParams{{temb.d(), w.d(), b.d()}, table.d(), act.d()}));
  EXPECT_GPU_EQ_CPU(table);
  EXPECT_GPU_EQ_CPU(act);
  Pair grad = random_pair(DType::kF32, {rows, n}, seed + 3);
  Pair d_temb = output_pair(DType::kF32, {rows, dim}), d_w = output_pair(dtype, {n, dim}), d_b = output_pair(dtype, {n});
  DETDIT_ASSERT_OK(adaln_projection_backward(
      AdalnProjectionBackwardParams{{temb.h(), w.h(), b.h()}, act.h(), grad.h(), d_temb.h(), d_w.h(), d_b.h()}));
  DETDIT_ASSERT_OK(adaln_projection_backward(
      AdalnProjectionBackwardParams{{temb.d(), w.d(), b.d()}, act.d(), grad.d(), d_temb.d(), d_w.d(), d_b.d()}));
  EXPECT_GPU_EQ_CPU(d_temb);
  EXPECT_GPU_EQ_CPU(d_w);
  EXPECT_GPU_EQ_CPU(d_b);
}

TEST(AdalnProjectionCuda, AwkwardShapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_projection(3, 24, 18 * 4, DType::kBF16, 1500);
  check_projection(1, 8, 18 * 7, DType::kF32, 1501);
}

TEST(AdalnProjectionCuda, H3Shapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_projection(4, kH3TimeDim, 18 * kH3Hidden, DType::kBF16, 1510);
  check_projection(1, kH3TimeDim, 18 * kH3Hidden, DType::kBF16, 1511);
}

void check_modulation(int64_t hidden, int64_t dim, const IndexCase& c, uint64_t seed) {
  SCOPED_TRACE("H=" + std::to_string(hidden) + " D=" + std::to_string(dim) + " " + c.name());
  const DType dtype = DType::kBF16;
  const int64_t rows = c.num_timesteps, n = 18 * hidden;
  PlanPair plans = adaln_plan_pair(c);
  Pair temb = random_pair(DType::kF32, {rows, dim}, seed, 0.0, 3.0);
  Pair w = random_pair(dtype, {n, dim}, seed + 1, 0.0, 0.02), b = random_pair(dtype, {n}, seed + 2);
  Pair table = output_pair(dtype, {rows, n}), act = output_pair(dtype, {rows, dim});
  Pair out = output_pair(dtype, {6, c.seq_len, hidden});
  AdalnModulationParams cpu, gpu;
  cpu.in = {temb.h(), w.h(), b.h(), plans.host};
  gpu.in = {temb.d(), w.d(), b.d(), plans.dev};
  cpu.table = table.h(), gpu.table = table.d();
  cpu.act = act.h(), gpu.act = act.d();
  cpu.out = out.h(), gpu.out = out.d();
  DETDIT_ASSERT_OK(adaln_modulation_forward(cpu));
  DETDIT_ASSERT_OK(adaln_modulation_forward(gpu));
  EXPECT_GPU_EQ_CPU(table);
  EXPECT_GPU_EQ_CPU(act);
  EXPECT_GPU_EQ_CPU(out);
  Pair grad = random_pair(dtype, {6, c.positions(), hidden}, seed + 3);
  Pair d_temb = output_pair(DType::kF32, {rows, dim}), d_w = output_pair(dtype, {n, dim}), d_b = output_pair(dtype, {n});
  AdalnModulationBackwardParams bc, bg;
  bc.in = cpu.in, bg.in = gpu.in;
  bc.act = act.h(), bg.act = act.d();
  bc.grad = grad.h(), bg.grad = grad.d();
  bc.d_temb = d_temb.h(), bg.d_temb = d_temb.d();
  bc.d_weight = d_w.h(), bg.d_weight = d_w.d();
  bc.d_bias = d_b.h(), bg.d_bias = d_b.d();
  DETDIT_ASSERT_OK(adaln_modulation_backward(bc));
  DETDIT_ASSERT_OK(adaln_modulation_backward(bg));
  EXPECT_GPU_EQ_CPU(d_temb);
  EXPECT_GPU_EQ_CPU(d_w);
  EXPECT_GPU_EQ_CPU(d_b);
}

TEST(AdalnModulationCuda, AwkwardAndH3Shapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_modulation(20, 24, make_index_case(Packing::kInterleaved, 257, 3, 2), 1600);
  check_modulation(12, 8, make_index_case(Packing::kBlock, 1, 1, 1), 1601);
  check_modulation(kH3Hidden, kH3TimeDim, make_index_case(Packing::kBlock, 4097, 4, 2), 1602);
}

void check_final_out(DType dtype, int64_t hidden, int64_t dim, const IndexCase& c, uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " H=" + std::to_string(hidden) + " D=" + std::to_string(dim) +
               " " + c.name());
  const int64_t rows = c.num_timesteps, m = c.positions();
  PlanPair plans = timestep_plan_pair(c);
  Pair x = random_pair(dtype, {m, hidden}, seed, 0.0, 3.0), nw = random_pair(dtype, {hidden}, seed + 1, 1.0, 0.3);
  Pair temb = random_pair(DType::kF32, {rows, dim}, seed + 2, 0.0, 3.0);
  Pair w = random_pair(dtype, {2 * hidden, dim}, seed + 3, 0.0, 0.02), b = random_pair(dtype, {2 * hidden}, seed + 4);
  Pair out = output_pair(dtype, {m, hidden}), table = output_pair(dtype, {rows, 2 * hidden});
  Pair act = output_pair(dtype, {rows, dim}), rstd = output_pair(DType::kF32, {m});
  FinalAdalnOutParams fc, fg;
  fc.in.x = x.h(), fg.in.x = x.d();
  fc.in.norm_weight = nw.h(), fg.in.norm_weight = nw.d();
  fc.in.temb = temb.h(), fg.in.temb = temb.d();
  fc.in.weight = w.h(), fg.in.weight = w.d();
  fc.in.bias = b.h(), fg.in.bias = b.d();
  fc.in.plan = plans.host, fg.in.plan = plans.dev;
  fc.out = out.h(), fg.out = out.d();
  fc.table = table.h(), fg.table = table.d();
  fc.act = act.h(), fg.act = act.d();
  fc.rstd = rstd.h(), fg.rstd = rstd.d();
  DETDIT_ASSERT_OK(final_adaln_out_forward(fc));
  DETDIT_ASSERT_OK(final_adaln_out_forward(fg));
  for (const Pair* p : {&out, &table, &act, &rstd}) EXPECT_GPU_EQ_CPU(*p);
  Pair grad = random_pair(dtype, {m, hidden}, seed + 5);
  Pair dx = output_pair(dtype, {m, hidden}), d_nw = output_pair(DType::kF32, {hidden});
  Pair d_temb = output_pair(DType::kF32, {rows, dim}), d_w = output_pair(dtype, {2 * hidden, dim});
  Pair d_b = output_pair(dtype, {2 * hidden});
  FinalAdalnOutBackwardParams bc, bg;
  bc.in.x = fc.in.x, bg.in.x = fg.in.x;
  bc.in.norm_weight = fc.in.norm_weight, bg.in.norm_weight = fg.in.norm_weight;
  bc.in.temb = fc.in.temb, bg.in.temb = fg.in.temb;
  bc.in.weight = fc.in.weight, bg.in.weight = fg.in.weight;
  bc.table = fc.table, bg.table = fg.table;
  bc.act = fc.act, bg.act = fg.act;
  bc.rstd = fc.rstd, bg.rstd = fg.rstd;
  bc.in.plan = fc.in.plan, bg.in.plan = fg.in.plan;
  bc.grad = grad.h(), bg.grad = grad.d();
  bc.dx = dx.h(), bg.dx = dx.d();
  bc.d_norm_weight = d_nw.h(), bg.d_norm_weight = d_nw.d();
  bc.d_temb = d_temb.h(), bg.d_temb = d_temb.d();
  bc.d_weight = d_w.h(), bg.d_weight = d_w.d();
  bc.d_bias = d_b.h(), bg.d_bias = d_b.d();
  DETDIT_ASSERT_OK(final_adaln_out_backward(bc));
  DETDIT_ASSERT_OK(final_adaln_out_backward(bg));
  for (const Pair* p : {&dx, &d_nw, &d_temb, &d_w, &d_b}) EXPECT_GPU_EQ_CPU(*p);
}

TEST(FinalAdalnOutCuda, AwkwardAndH3Shapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_final_out(DType::kBF16, 20, 24, make_index_case(Packing::kInterleaved, 257, 3, 2), 1700);
  check_final_out(DType::kF32, 12, 8, make_index_case(Packing::kBlock, 255, 1, 1), 1701);
  check_final_out(DType::kBF16, kH3Hidden, kH3TimeDim, make_index_case(Packing::kBlock, 4097, 4, 1), 1702);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
