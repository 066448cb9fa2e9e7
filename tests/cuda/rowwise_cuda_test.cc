// CPU vs GPU, bitwise, portable profile: rmsnorm (plain and modulated),
// gate_residual and adaln_row_gather, forward and every gradient, at awkward
// legal shapes and at H3 shapes (few), both packings; the split halves of the
// SP region (chunk selection + received rows); every launch tunable.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/backends.h"
#include "cuda/cuda_test_util.h"
#include "cuda/tuning.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

constexpr int64_t kH3Hidden = 5376;

// rmsnorm forward + backward of one case on both devices; every output compared.
// offset_table: shift and scale are (R, H) views at column 1 of (R, H + 1)
// tensors, so their rows are unaligned and the kernels take scalar loads.
void check_rmsnorm(DType dtype, int64_t hidden, const IndexCase& c, bool modulated, uint64_t seed,
                   DType table_grad_dtype = DType::kF32, bool offset_table = false) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " H=" + std::to_string(hidden) + " " + c.name() +
               (modulated ? " modulated" : " plain") + (offset_table ? " offset table" : ""));
  const int64_t rows = c.positions(), table_rows = c.num_rows();
  PlanPair plans = modulated ? adaln_plan_pair(c) : PlanPair{};
  Pair x = random_pair(dtype, {rows, hidden}, seed, 0.0, 3.0);
  Pair w = random_pair(dtype, {hidden}, seed + 1, 1.0, 0.5);
  const int64_t table_width = offset_table ? hidden + 1 : hidden;
  Pair shift = random_pair(dtype, {table_rows, table_width}, seed + 2, 0.0, 0.5);
  Pair scale = random_pair(dtype, {table_rows, table_width}, seed + 3, 0.0, 0.5);
  auto table_view = [&](const TensorView& t) { return offset_table ? t.narrow(1, 1, hidden) : t; };
  Pair out = output_pair(dtype, {rows, hidden}), rstd = output_pair(DType::kF32, {rows});
  RmsnormParams cpu, gpu;
  cpu.in.x = x.h(), gpu.in.x = x.d();
  cpu.in.weight = w.h(), gpu.in.weight = w.d();
  if (modulated) {
    cpu.in.shift = table_view(shift.h()), gpu.in.shift = table_view(shift.d());
    cpu.in.scale = table_view(scale.h()), gpu.in.scale = table_view(scale.d());
    cpu.in.plan = plans.host, gpu.in.plan = plans.dev;
  }
  cpu.out = out.h(), gpu.out = out.d();
  cpu.rstd = rstd.h(), gpu.rstd = rstd.d();
  DETDIT_ASSERT_OK(rmsnorm_forward(cpu));
  DETDIT_ASSERT_OK(rmsnorm_forward(gpu));
  EXPECT_GPU_EQ_CPU(out);
  EXPECT_GPU_EQ_CPU(rstd);

  Pair grad = random_pair(dtype, {rows, hidden}, seed + 4);
  Pair dx = output_pair(dtype, {rows, hidden}), d_weight = output_pair(DType::kF32, {hidden});
  Pair d_shift = output_pair(table_grad_dtype, {table_rows, hidden});
  Pair d_scale = output_pair(table_grad_dtype, {table_rows, hidden});
  RmsnormBackwardParams bc, bg;
  bc.in.x = cpu.in.x, bg.in.x = gpu.in.x;
  bc.in.weight = cpu.in.weight, bg.in.weight = gpu.in.weight;
  bc.in.shift = cpu.in.shift, bg.in.shift = gpu.in.shift;
  bc.in.scale = cpu.in.scale, bg.in.scale = gpu.in.scale;
  bc.in.plan = cpu.in.plan, bg.in.plan = gpu.in.plan;
  bc.rstd = rstd.h(), bg.rstd = rstd.d();  // each side its own (equal) saved rstd
  bc.grad = grad.h(), bg.grad = grad.d();
  bc.dx = dx.h(), bg.dx = dx.d();
  bc.d_weight = d_weight.h(), bg.d_weight = d_weight.d();
  if (modulated) {
    bc.d_shift = d_shift.h(), bg.d_shift = d_shift.d();
    bc.d_scale = d_scale.h(), bg.d_scale = d_scale.d();
  }
  DETDIT_ASSERT_OK(rmsnorm_backward(bc));
  DETDIT_ASSERT_OK(rmsnorm_backward(bg));
  EXPECT_GPU_EQ_CPU(dx);
  EXPECT_GPU_EQ_CPU(d_weight);
  if (modulated) {
    EXPECT_GPU_EQ_CPU(d_shift);
    EXPECT_GPU_EQ_CPU(d_scale);
  }
}

TEST(RmsnormCuda, AwkwardShapesEveryDtypeBothPackings) {
  DETDIT_SKIP_WITHOUT_CUDA();
  uint64_t seed = 100;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t hidden : {12, 20, 68, 256})
      for (int64_t seq_len : {1, 255, 256, 257})
        for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
          const IndexCase c = make_index_case(packing, seq_len, 3, seq_len == 257 ? 2 : 1);
          check_rmsnorm(dtype, hidden, c, true, seed++);
          if (packing == Packing::kBlock) check_rmsnorm(dtype, hidden, c, false, seed++);
        }
}

TEST(RmsnormCuda, TableGradientsInTheTableDtype) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_rmsnorm(DType::kBF16, 68, make_index_case(Packing::kInterleaved, 257, 4, 2), true, 7, DType::kBF16);
}

TEST(RmsnormCuda, H3Shapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_rmsnorm(DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 4097, 4, 2), true, 11);
  check_rmsnorm(DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 4097, 3, 1), true, 12);
  check_rmsnorm(DType::kF32, kH3Hidden, make_index_case(Packing::kBlock, 257, 8, 2), false, 13);
  check_rmsnorm(DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 32768, 1, 1), true, 14);
}

void check_gate(DType dtype, int64_t hidden, const IndexCase& c, uint64_t seed, bool strided_gate,
                DType gate_grad_dtype = DType::kF32) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " H=" + std::to_string(hidden) + " " + c.name() +
               (strided_gate ? " strided gate" : ""));
  const int64_t rows = c.positions(), table_rows = c.num_rows();
  PlanPair plans = adaln_plan_pair(c);
  Pair residual = random_pair(dtype, {rows, hidden}, seed);
  Pair y = random_pair(dtype, {rows, hidden}, seed + 1, 0.0, 3.0);
  // gate: chunk 2 of a (R, 6H) table (row stride 6H) or a contiguous (R, H).
  Pair table = random_pair(dtype, {table_rows, (strided_gate ? 6 : 1) * hidden}, seed + 2, 0.0, 0.5);
  auto gate_view = [&](const TensorView& t) { return strided_gate ? t.narrow(1, 2 * hidden, hidden) : t; };
  Pair out = output_pair(dtype, {rows, hidden});
  GateResidualParams cpu{{residual.h(), y.h(), gate_view(table.h()), plans.host}, out.h()};
  GateResidualParams gpu{{residual.d(), y.d(), gate_view(table.d()), plans.dev}, out.d()};
  DETDIT_ASSERT_OK(gate_residual_forward(cpu));
  DETDIT_ASSERT_OK(gate_residual_forward(gpu));
  EXPECT_GPU_EQ_CPU(out);

  Pair grad = random_pair(dtype, {rows, hidden}, seed + 3);
  Pair d_residual = output_pair(dtype, {rows, hidden}), d_y = output_pair(dtype, {rows, hidden});
  Pair d_gate = output_pair(gate_grad_dtype, {table_rows, hidden});
  GateResidualBackwardParams bc{cpu.in, grad.h(), d_residual.h(), d_y.h(), d_gate.h()};
  GateResidualBackwardParams bg{gpu.in, grad.d(), d_residual.d(), d_y.d(), d_gate.d()};
  DETDIT_ASSERT_OK(gate_residual_backward(bc));
  DETDIT_ASSERT_OK(gate_residual_backward(bg));
  EXPECT_GPU_EQ_CPU(d_residual);
  EXPECT_GPU_EQ_CPU(d_y);
  EXPECT_GPU_EQ_CPU(d_gate);
}

TEST(GateResidualCuda, AwkwardShapesEveryDtypeBothPackings) {
  DETDIT_SKIP_WITHOUT_CUDA();
  uint64_t seed = 200;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t hidden : {12, 20, 68, 7})
      for (int64_t seq_len : {1, 255, 256, 257})
        for (Packing packing : {Packing::kBlock, Packing::kInterleaved})
          check_gate(dtype, hidden, make_index_case(packing, seq_len, 3, seq_len == 257 ? 2 : 1), seed++,
                     seq_len == 255);
  check_gate(DType::kBF16, 20, make_index_case(Packing::kInterleaved, 257, 3, 2), seed++, false, DType::kBF16);
}

TEST(GateResidualCuda, H3Shapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_gate(DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 4097, 4, 2), 21, true);
  check_gate(DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 4097, 8, 1), 22, false);
  check_gate(DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 32768, 3, 2), 23, false);
}

void check_gather(DType dtype, int64_t hidden, const IndexCase& c, uint64_t seed, bool strided_rows,
                  DType rows_grad_dtype) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " H=" + std::to_string(hidden) + " " + c.name());
  const int64_t table_rows = c.num_rows(), width = 6 * hidden;
  PlanPair plans = adaln_plan_pair(c);
  // rows: (R, 6H), or a (R, 6H) view with row stride 6H + 3 (unit column stride).
  const int64_t stride = strided_rows ? width + 3 : width;
  Pair storage = random_pair(dtype, {table_rows, stride}, seed);
  auto rows_view = [&](const TensorView& t) {
    return TensorView::strided(t.data, dtype, {table_rows, width}, {stride, 1}, t.device);
  };
  Pair out = output_pair(dtype, {6, c.seq_len, hidden});
  AdalnRowGatherParams cpu{rows_view(storage.h()), plans.host, out.h()};
  AdalnRowGatherParams gpu{rows_view(storage.d()), plans.dev, out.d()};
  DETDIT_ASSERT_OK(adaln_row_gather_forward(cpu));
  DETDIT_ASSERT_OK(adaln_row_gather_forward(gpu));
  EXPECT_GPU_EQ_CPU(out);

  Pair grad = random_pair(dtype, {6, c.positions(), hidden}, seed + 1);
  Pair d_rows = output_pair(rows_grad_dtype, {table_rows, width});
  AdalnRowGatherBackwardParams bc{grad.h(), plans.host, d_rows.h()};
  AdalnRowGatherBackwardParams bg{grad.d(), plans.dev, d_rows.d()};
  DETDIT_ASSERT_OK(adaln_row_gather_backward(bc));
  DETDIT_ASSERT_OK(adaln_row_gather_backward(bg));
  EXPECT_GPU_EQ_CPU(d_rows);
}

TEST(AdalnRowGatherCuda, AwkwardShapesEveryDtypeBothPackings) {
  DETDIT_SKIP_WITHOUT_CUDA();
  uint64_t seed = 300;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t hidden : {12, 20, 68, 7})
      for (int64_t seq_len : {1, 255, 256, 257})
        for (Packing packing : {Packing::kBlock, Packing::kInterleaved})
          check_gather(dtype, hidden, make_index_case(packing, seq_len, 3, seq_len == 257 ? 2 : 1), seed++,
                       hidden == 7, seq_len == 256 ? dtype : DType::kF32);
}

TEST(AdalnRowGatherCuda, H3Shapes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_gather(DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 4097, 4, 2), 31, false, DType::kF32);
  check_gather(DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 32768, 8, 1), 32, false,
               DType::kBF16);
}

// Every launch tunable gives the same bytes (numerics fixes the orders; the
// tunables only change who computes what). Compared against the CPU, which
// has no tunables, so each setting is checked independently.
TEST(RowwiseCuda, EveryLaunchTuningGivesTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const cuda::LaunchTuning saved = cuda::launch_tuning();
  for (int threads : {64, 256, 1024})
    for (int vector_bytes : {16, 8, 4, 2})
      for (int cols : {1, 2, 4}) {
        SCOPED_TRACE("threads " + std::to_string(threads) + " vector " + std::to_string(vector_bytes) + " cols " +
                     std::to_string(cols));
        cuda::launch_tuning().elementwise_threads = threads;
        cuda::launch_tuning().vector_bytes = vector_bytes;
        cuda::launch_tuning().partial_columns_per_thread = cols;
        const IndexCase c = make_index_case(Packing::kInterleaved, 257, 3, 2);
        check_rmsnorm(DType::kBF16, 68, c, true, 400);
        check_gate(DType::kBF16, 68, c, 401, true);
        check_gather(DType::kBF16, 68, c, 402, false, DType::kF32);
      }
  cuda::launch_tuning() = saved;
}

// rmsnorm's table partials in the d_weight pass (fused, when every chunk's
// segment sums fit in shared memory) or in a second pass: the same bytes, for every
// column count, unaligned table rows (scalar loads) and plans with up to 12
// segments in a chunk (interleaved, T = 4: fused for 1 and 2 columns only).
TEST(RmsnormCuda, FusedAndTwoPassTablePartialsGiveTheSameBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const cuda::LaunchTuning saved = cuda::launch_tuning();
  for (bool fused : {true, false})
    for (int cols : {1, 2, 4}) {
      SCOPED_TRACE(std::string(fused ? "fused" : "two-pass") + " cols " + std::to_string(cols));
      cuda::launch_tuning().rmsnorm_fused_partials = fused;
      cuda::launch_tuning().partial_columns_per_thread = cols;
      check_rmsnorm(DType::kBF16, 68, make_index_case(Packing::kInterleaved, 257, 3, 2), true, 410);
      check_rmsnorm(DType::kBF16, 68, make_index_case(Packing::kInterleaved, 700, 4, 2), true, 411);
      check_rmsnorm(DType::kF32, 20, make_index_case(Packing::kBlock, 1000, 2, 1), true, 412);
      check_rmsnorm(DType::kF16, 1028, make_index_case(Packing::kInterleaved, 513, 2, 1), true, 413, DType::kF16);
      check_rmsnorm(DType::kBF16, 68, make_index_case(Packing::kInterleaved, 300, 2, 2), true, 414, DType::kF32, true);
    }
  cuda::launch_tuning() = saved;
}

// The split halves the SP region runs: partials of a chunk subset, with some
// positions read from received rows (ExtraRows), on both backends.
TEST(RowwiseCuda, SplitHalvesWithChunkSelectionAndReceivedRows) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const DType dtype = DType::kBF16;
  const int64_t hidden = 68;
  const IndexCase c = make_index_case(Packing::kInterleaved, 700, 3, 2);  // P = 1400: 6 chunks
  PlanPair plans = adaln_plan_pair(c);
  const int64_t positions = c.positions(), table_rows = c.num_rows();
  // Every third position lives in the received rows, at extra row p / 3.
  const int64_t extra_count = (positions + 2) / 3;
  HostTensor position_row(DType::kI32, {positions});
  for (int64_t p = 0; p < positions; ++p)
    position_row.ptr<int32_t>()[p] = p % 3 == 0 ? static_cast<int32_t>(-1 - p / 3) : static_cast<int32_t>(p);
  HostTensor chunks(DType::kI32, {3});
  const int32_t selected[3] = {1, 2, 5};
  for (int i = 0; i < 3; ++i) chunks.ptr<int32_t>()[i] = selected[i];
  Pair chunk_ids = input_pair(chunks), rows_of_positions = input_pair(position_row);
  ChunkSelection sel_cpu{chunks.ptr<int32_t>(), 3, position_row.ptr<int32_t>()};
  ChunkSelection sel_gpu{static_cast<const int32_t*>(chunk_ids.dev.data()), 3,
                         static_cast<const int32_t*>(rows_of_positions.dev.data())};
  int64_t segments = 0;
  for (int32_t k : selected)
    segments += plans.host.host_tables().chunk_segment_begin[k + 1] - plans.host.host_tables().chunk_segment_begin[k];

  Pair x = random_pair(dtype, {positions, hidden}, 500, 0.0, 3.0), grad = random_pair(dtype, {positions, hidden}, 501);
  Pair y = random_pair(dtype, {positions, hidden}, 502);
  Pair extra_x = random_pair(dtype, {extra_count, hidden}, 503, 0.0, 3.0);
  Pair extra_grad = random_pair(dtype, {extra_count, hidden}, 504), extra_y = random_pair(dtype, {extra_count, hidden}, 505);
  Pair rstd = random_pair(DType::kF32, {positions}, 506, 1.0, 0.1);
  Pair extra_rstd = random_pair(DType::kF32, {extra_count}, 507, 1.0, 0.1);
  Pair w = random_pair(dtype, {hidden}, 508, 1.0, 0.5);
  Pair shift = random_pair(dtype, {table_rows, hidden}, 509), scale = random_pair(dtype, {table_rows, hidden}, 510);

  Pair weight_partials = output_pair(DType::kF32, {3, hidden});
  Pair table_partials = output_pair(DType::kF32, {segments, 2 * hidden});
  RmsnormBackwardParams pc, pg;
  pc.in.x = x.h(), pg.in.x = x.d();
  pc.in.weight = w.h(), pg.in.weight = w.d();
  pc.in.shift = shift.h(), pg.in.shift = shift.d();
  pc.in.scale = scale.h(), pg.in.scale = scale.d();
  pc.in.plan = plans.host, pg.in.plan = plans.dev;
  pc.rstd = rstd.h(), pg.rstd = rstd.d();
  pc.grad = grad.h(), pg.grad = grad.d();
  ExtraRows ec{extra_x.h(), extra_grad.h(), TensorView{}, extra_rstd.h()};
  ExtraRows eg{extra_x.d(), extra_grad.d(), TensorView{}, extra_rstd.d()};
  DETDIT_ASSERT_OK(cpu::rmsnorm_backward_partials(pc, sel_cpu, ec, weight_partials.h(), table_partials.h(), nullptr));
  DETDIT_ASSERT_OK(cuda::rmsnorm_backward_partials(pg, sel_gpu, eg, weight_partials.d(), table_partials.d(), nullptr));
  EXPECT_GPU_EQ_CPU(weight_partials);
  EXPECT_GPU_EQ_CPU(table_partials);

  Pair gate_partials = output_pair(DType::kF32, {segments, hidden});
  GateResidualBackwardParams gc, gg;
  gc.grad = grad.h(), gg.grad = grad.d();
  gc.in.y = y.h(), gg.in.y = y.d();
  gc.in.gate = shift.h(), gg.in.gate = shift.d();
  gc.in.plan = plans.host, gg.in.plan = plans.dev;
  ExtraRows xc{TensorView{}, extra_grad.h(), extra_y.h(), TensorView{}};
  ExtraRows xg{TensorView{}, extra_grad.d(), extra_y.d(), TensorView{}};
  DETDIT_ASSERT_OK(cpu::gate_residual_backward_partials(gc, sel_cpu, xc, gate_partials.h(), nullptr));
  DETDIT_ASSERT_OK(cuda::gate_residual_backward_partials(gg, sel_gpu, xg, gate_partials.d(), nullptr));
  EXPECT_GPU_EQ_CPU(gate_partials);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
