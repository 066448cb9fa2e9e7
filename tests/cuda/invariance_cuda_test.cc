// Invariances on the GPU, bitwise: a row alone equals the same row inside a
// batch (rmsnorm, linear); repeated runs give the same bytes; a CUDA-graph
// capture of a forward+backward region replays to the eager bytes (so no op
// synchronises the host once its plan exists).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/linear.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

// Bytes [offset, offset + bytes) of a host tensor as its own tensor of `dtype`.
HostTensor slice(const HostTensor& t, std::size_t offset, std::size_t bytes, DType dtype) {
  HostTensor s(dtype, {static_cast<int64_t>(bytes / dtype_size(dtype))});
  std::memcpy(s.data(), static_cast<const char*>(t.data()) + offset, bytes);
  return s;
}

TEST(InvarianceCuda, RmsnormRowAloneEqualsRowInBatch) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const int64_t rows = 37, hidden = 5376;
  const DType dtype = DType::kBF16;
  HostTensor x = random_tensor(dtype, {rows, hidden}, 1, 0.0, 3.0), grad = random_tensor(dtype, {rows, hidden}, 2);
  DeviceTensor dx_all(dtype, {rows, hidden}), out(dtype, {rows, hidden}), rstd(DType::kF32, {rows});
  DeviceTensor xd = DeviceTensor::upload(x), gd = DeviceTensor::upload(grad);
  DeviceTensor w = DeviceTensor::upload(random_tensor(dtype, {hidden}, 3, 1.0, 0.5));
  RmsnormParams f;
  f.in.x = xd.view(), f.in.weight = w.view(), f.out = out.view(), f.rstd = rstd.view();
  DETDIT_ASSERT_OK(rmsnorm_forward(f));
  RmsnormBackwardParams b;
  b.in.x = xd.view(), b.in.weight = w.view(), b.rstd = rstd.view(), b.grad = gd.view(), b.dx = dx_all.view();
  DETDIT_ASSERT_OK(rmsnorm_backward(b));
  const HostTensor out_all = out.download(), rstd_all = rstd.download(), dx_host = dx_all.download();
  const std::size_t row_bytes = hidden * dtype_size(dtype);
  for (int64_t m : {0, 17, 36}) {
    SCOPED_TRACE("row " + std::to_string(m));
    DeviceTensor x1(dtype, {1, hidden}), g1(dtype, {1, hidden}), o1(dtype, {1, hidden}), r1(DType::kF32, {1});
    DeviceTensor d1(dtype, {1, hidden});
    cudaMemcpy(x1.data(), static_cast<char*>(xd.data()) + m * row_bytes, row_bytes, cudaMemcpyDeviceToDevice);
    cudaMemcpy(g1.data(), static_cast<char*>(gd.data()) + m * row_bytes, row_bytes, cudaMemcpyDeviceToDevice);
    RmsnormParams f1 = f;
    f1.in.x = x1.view(), f1.out = o1.view(), f1.rstd = r1.view();
    DETDIT_ASSERT_OK(rmsnorm_forward(f1));
    RmsnormBackwardParams b1 = b;
    b1.in.x = x1.view(), b1.rstd = r1.view(), b1.grad = g1.view(), b1.dx = d1.view();
    DETDIT_ASSERT_OK(rmsnorm_backward(b1));
    EXPECT_BITWISE_EQ(slice(out_all, m * row_bytes, row_bytes, dtype), o1.download());
    EXPECT_BITWISE_EQ(slice(rstd_all, m * 4, 4, DType::kF32), r1.download());
    EXPECT_BITWISE_EQ(slice(dx_host, m * row_bytes, row_bytes, dtype), d1.download());
  }
}

TEST(InvarianceCuda, LinearRowAloneEqualsRowInBatch) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const int64_t rows = 8, k = 2688, n = 1000;
  HostTensor x = random_tensor(DType::kBF16, {rows, k}, 4);
  DeviceTensor xd = DeviceTensor::upload(x), out(DType::kBF16, {rows, n});
  DeviceTensor w = DeviceTensor::upload(random_tensor(DType::kBF16, {n, k}, 5, 0.0, 0.02));
  DeviceTensor bias = DeviceTensor::upload(random_tensor(DType::kBF16, {n}, 6));
  LinearParams all_rows;
  all_rows.x = xd.view(), all_rows.weight = w.view(), all_rows.bias = bias.view(), all_rows.out = out.view();
  DETDIT_ASSERT_OK(linear_forward(all_rows));
  const HostTensor all = out.download();
  const std::size_t x_row = k * 2, out_row = n * 2;
  for (int64_t t : {0, 5, 7}) {
    DeviceTensor x1(DType::kBF16, {1, k}), o1(DType::kBF16, {1, n});
    cudaMemcpy(x1.data(), static_cast<char*>(xd.data()) + t * x_row, x_row, cudaMemcpyDeviceToDevice);
    LinearParams one_row;
    one_row.x = x1.view(), one_row.weight = w.view(), one_row.bias = bias.view(), one_row.out = o1.view();
    DETDIT_ASSERT_OK(linear_forward(one_row));
    EXPECT_BITWISE_EQ(slice(all, t * out_row, out_row, DType::kBF16), o1.download()) << "row " << t;
  }
}

// The region a trainer captures: fused modulation, modulated norm, gated
// residual, forward and backward, on one stream.
struct Region {
  int64_t hidden = 256, dim = 64, seq_len = 1000, batch = 2, timesteps = 3;
  IndexCase index = make_index_case(Packing::kInterleaved, 1000, 3, 2);
  PlanPair plans = adaln_plan_pair(index);
  int64_t rows = index.positions();
  DeviceTensor temb = DeviceTensor::upload(random_tensor(DType::kF32, {timesteps, dim}, 10, 0.0, 3.0));
  DeviceTensor weight = DeviceTensor::upload(random_tensor(DType::kBF16, {18 * hidden, dim}, 11, 0.0, 0.05));
  DeviceTensor bias = DeviceTensor::upload(random_tensor(DType::kBF16, {18 * hidden}, 12));
  DeviceTensor x = DeviceTensor::upload(random_tensor(DType::kBF16, {rows, hidden}, 13, 0.0, 3.0));
  DeviceTensor y = DeviceTensor::upload(random_tensor(DType::kBF16, {rows, hidden}, 14));
  DeviceTensor norm_w = DeviceTensor::upload(random_tensor(DType::kBF16, {hidden}, 15, 1.0, 0.3));
  DeviceTensor grad = DeviceTensor::upload(random_tensor(DType::kBF16, {rows, hidden}, 16));
  DeviceTensor table{DType::kBF16, {timesteps, 18 * hidden}}, act{DType::kBF16, {timesteps, dim}};
  DeviceTensor mod{DType::kBF16, {6, seq_len, hidden}}, normed{DType::kBF16, {rows, hidden}};
  DeviceTensor rstd{DType::kF32, {rows}}, out{DType::kBF16, {rows, hidden}};
  DeviceTensor d_y{DType::kBF16, {rows, hidden}};
  DeviceTensor dx{DType::kBF16, {rows, hidden}}, d_norm_w{DType::kF32, {hidden}};
  DeviceTensor d_shift{DType::kBF16, {3 * timesteps, hidden}}, d_scale{DType::kBF16, {3 * timesteps, hidden}};
  DeviceTensor d_gate_t{DType::kBF16, {3 * timesteps, hidden}};
  DeviceTensor d_mod{DType::kBF16, {6, rows, hidden}};
  DeviceTensor d_temb{DType::kF32, {timesteps, dim}}, d_weight{DType::kBF16, {18 * hidden, dim}};
  DeviceTensor d_bias{DType::kBF16, {18 * hidden}};

  std::vector<const DeviceTensor*> outputs() const {
    return {&table, &act, &mod, &normed, &rstd, &out, &d_y, &dx, &d_norm_w, &d_shift, &d_scale, &d_gate_t,
            &d_temb, &d_weight, &d_bias};
  }
  void poison() {
    for (const DeviceTensor* t : outputs()) const_cast<DeviceTensor*>(t)->fill_bytes(kCanary);
  }
  // (3T, H) view of chunk c of the (T, 18H) table.
  TensorView table_chunk(int c) const {
    TensorView v;
    Status s = adaln_table_chunk(table.view(), hidden, c, &v);
    if (!s.ok()) ADD_FAILURE() << s.to_string();
    return v;
  }
  Status run(cudaStream_t stream) {
    const Stream st = stream;
    DETDIT_RETURN_IF_ERROR(adaln_modulation_forward(AdalnModulationParams{
        {temb.view(), weight.view(), bias.view(), plans.dev}, table.view(), act.view(), mod.view()}, st));
    RmsnormParams f;
    f.in.x = x.view(), f.in.weight = norm_w.view(), f.in.shift = table_chunk(0), f.in.scale = table_chunk(1);
    f.in.plan = plans.dev, f.out = normed.view(), f.rstd = rstd.view();
    DETDIT_RETURN_IF_ERROR(rmsnorm_forward(f, st));
    DETDIT_RETURN_IF_ERROR(
        gate_residual_forward(GateResidualParams{{x.view(), y.view(), table_chunk(2), plans.dev}, out.view()}, st));
    DETDIT_RETURN_IF_ERROR(gate_residual_backward(GateResidualBackwardParams{
        {x.view(), y.view(), table_chunk(2), plans.dev}, grad.view(), TensorView{}, d_y.view(), d_gate_t.view()}, st));
    RmsnormBackwardParams b;
    b.in.x = x.view(), b.in.weight = norm_w.view(), b.in.shift = f.in.shift, b.in.scale = f.in.scale, b.in.plan = plans.dev;
    b.rstd = rstd.view(), b.grad = grad.view(), b.dx = dx.view(), b.d_weight = d_norm_w.view();
    b.d_shift = d_shift.view(), b.d_scale = d_scale.view();
    DETDIT_RETURN_IF_ERROR(rmsnorm_backward(b, st));
    AdalnModulationBackwardParams mb;
    mb.in.temb = temb.view(), mb.in.weight = weight.view(), mb.act = act.view(), mb.in.plan = plans.dev;
    mb.grad = d_mod.view(), mb.d_temb = d_temb.view(), mb.d_weight = d_weight.view(), mb.d_bias = d_bias.view();
    return adaln_modulation_backward(mb, st);
  }
  std::vector<HostTensor> results() const {
    std::vector<HostTensor> r;
    for (const DeviceTensor* t : outputs()) r.push_back(t->download());
    return r;
  }
};

// Eager run, repeat, and two replays of a CUDA graph captured on a stream
// made with `stream_flags`: every output's bytes equal the first run's.
void check_repeat_and_replay(unsigned stream_flags) {
  Region region;
  region.d_mod = DeviceTensor::upload(random_tensor(DType::kBF16, {6, region.rows, region.hidden}, 17));
  cudaStream_t stream;
  DETDIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, stream_flags));
  region.poison();
  DETDIT_ASSERT_OK(region.run(stream));
  DETDIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<HostTensor> eager = region.results();
  for (const HostTensor& t : eager) EXPECT_FALSE(all_bytes_are(t, kCanary)) << "an output was never written";

  region.poison();
  DETDIT_ASSERT_OK(region.run(stream));
  DETDIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<HostTensor> again = region.results();
  for (std::size_t i = 0; i < eager.size(); ++i) EXPECT_BITWISE_EQ(eager[i], again[i]) << "repeat, output " << i;

  region.poison();
  cudaGraph_t graph;
  DETDIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status captured = region.run(stream);
  DETDIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  DETDIT_ASSERT_OK(captured);
  cudaGraphExec_t exec;
  DETDIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    region.poison();
    DETDIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    DETDIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<HostTensor> replayed = region.results();
    for (std::size_t i = 0; i < eager.size(); ++i)
      EXPECT_BITWISE_EQ(eager[i], replayed[i]) << "graph replay " << replay << ", output " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(InvarianceCuda, RepeatedRunsAndGraphReplayGiveTheEagerBytes) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_repeat_and_replay(cudaStreamNonBlocking);
}

// On a blocking stream, any work the library put on the legacy default stream
// while the stream captures is an error (cudaErrorStreamCaptureImplicit)
// instead of an unordered race: the capture proves the ops' stream discipline
// (PyTorch captures on such a stream).
TEST(InvarianceCuda, CaptureOnABlockingStreamProvesStreamDiscipline) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_repeat_and_replay(cudaStreamDefault);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
