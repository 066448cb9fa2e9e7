// The backend halves the sequence-parallel region runs (src/parallel/sp_region.cc):
// the rmsnorm and gate_residual partials of a chunk subset, with some positions
// read from rows received from other ranks (ExtraRows), byte-equal on both backends.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/backends.h"
#include "cuda/cuda_test_util.h"
#include "detdit/gate_residual.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

// The split halves the SP region runs: partials of a chunk subset, with some
// positions read from received rows (ExtraRows), on both backends.
TEST(SpHalvesCuda, PartialsOfAChunkSelectionWithReceivedRows) {
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
  ChunkSelection sel_gpu{static_cast<const int32_t*>(chunk_ids.d().data), 3,
                         static_cast<const int32_t*>(rows_of_positions.d().data)};
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
