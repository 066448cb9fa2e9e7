// Invariances on the GPU, bitwise: a position alone equals the same position inside a batch (every op case with a
// one-position form, in both profiles); repeated runs
// give the same bytes; a CUDA-graph capture of a forward+backward region replays to the eager bytes (so no op
// synchronises the host once its plan exists).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/linear.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

// Every test case with a one-position form (rmsnorm, gate_residual,
// final_adaln_out, linear, the timestep path): probe positions alone on the
// GPU give the bytes of the same positions inside the batch.
TEST(InvarianceCuda, PositionAloneEqualsPositionInBatch) {
  DETDIT_SKIP_WITHOUT_CUDA();
  int checked = 0;
  for (const OpCase& c : op_cases("", Suite::kTest, CaseContext{})) {
    if (!c.alone || c.positions < 2 || c.positions > 100000) continue;
    const std::vector<int64_t> probes = {0, c.positions / 2, c.positions - 1};
    std::vector<OutputReport> reports;
    DETDIT_ASSERT_OK(compare_positions_alone(c, Device::cuda(0), probes, &reports));
    for (const OutputReport& r : reports) EXPECT_TRUE(r.mismatch.equal()) << c.full_name() << " " << r.output << ": " << r.mismatch.describe();
    EXPECT_FALSE(reports.empty()) << c.full_name();
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

// The torch profile (hardware exp, sin, cos, rsqrt) has no CPU reference, so
// what it promises besides equality with PyTorch eager (scripts/torch_parity.py)
// is checked here on every test case of an op that takes a profile: two runs
// give the same bytes (every output written), and probe positions alone equal
// the same positions inside the batch.
TEST(InvarianceCuda, TorchProfileRepeatsAndPositionAloneEqualsPositionInBatch) {
  DETDIT_SKIP_WITHOUT_CUDA();
  int checked = 0;
  for (OpCase c : op_cases("", Suite::kTest, CaseContext{})) {
    if (!c.takes_profile || c.positions > 100000) continue;
    c.numerics = Numerics::kTorch;
    std::map<std::string, HostTensor> runs[2];
    for (auto& outputs : runs) {
      Instance t;
      DETDIT_ASSERT_OK(instantiate(c, Device::cuda(0), nullptr, &t));
      DETDIT_ASSERT_OK(run(c, Phase::kForward, t));
      if (c.has(Phase::kBackward)) DETDIT_ASSERT_OK(run(c, Phase::kBackward, t));
      DETDIT_ASSERT_OK(download_outputs(c, t, &outputs));
    }
    for (Phase phase : {Phase::kForward, Phase::kBackward}) {
      if (!c.has(phase)) continue;
      for (const OutputReport& r : compare_outputs(c, phase, runs[0], runs[1])) {
        EXPECT_FALSE(r.still_canary) << c.full_name() << " " << r.output << ": never written";
        EXPECT_TRUE(r.mismatch.equal()) << c.full_name() << " " << r.output << ": " << r.mismatch.describe();
      }
    }
    if (c.alone && c.positions >= 2) {
      std::vector<OutputReport> reports;
      DETDIT_ASSERT_OK(compare_positions_alone(c, Device::cuda(0), {0, c.positions / 2, c.positions - 1}, &reports));
      for (const OutputReport& r : reports)
        EXPECT_TRUE(r.mismatch.equal()) << c.full_name() << " " << r.output << ": " << r.mismatch.describe();
    }
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

// The region a trainer captures: fused modulation, modulated norm, gated
// residual, forward and backward, on one stream.
struct Region {
  int64_t hidden = 256, dim = 64, seq_len = 1000, batch = 2, timesteps = 3;
  IndexCase index = make_index_case(Packing::kInterleaved, 1000, 3, 2);
  PlanPair plans = adaln_plan_pair(index);
  int64_t rows = index.positions();
  DeviceTensor temb = upload(random_tensor(DType::kF32, {timesteps, dim}, 10, 0.0, 3.0));
  DeviceTensor weight = upload(random_tensor(DType::kBF16, {18 * hidden, dim}, 11, 0.0, 0.05));
  DeviceTensor bias = upload(random_tensor(DType::kBF16, {18 * hidden}, 12));
  DeviceTensor x = upload(random_tensor(DType::kBF16, {rows, hidden}, 13, 0.0, 3.0));
  DeviceTensor y = upload(random_tensor(DType::kBF16, {rows, hidden}, 14));
  DeviceTensor norm_w = upload(random_tensor(DType::kBF16, {hidden}, 15, 1.0, 0.3));
  DeviceTensor grad = upload(random_tensor(DType::kBF16, {rows, hidden}, 16));
  DeviceTensor table = device_empty(DType::kBF16, {timesteps, 18 * hidden});
  DeviceTensor act = device_empty(DType::kBF16, {timesteps, dim});
  DeviceTensor mod = device_empty(DType::kBF16, {6, seq_len, hidden});
  DeviceTensor normed = device_empty(DType::kBF16, {rows, hidden});
  DeviceTensor rstd = device_empty(DType::kF32, {rows});
  DeviceTensor out = device_empty(DType::kBF16, {rows, hidden});
  DeviceTensor d_y = device_empty(DType::kBF16, {rows, hidden});
  DeviceTensor dx = device_empty(DType::kBF16, {rows, hidden});
  DeviceTensor d_norm_w = device_empty(DType::kF32, {hidden});
  DeviceTensor d_shift = device_empty(DType::kBF16, {3 * timesteps, hidden});
  DeviceTensor d_scale = device_empty(DType::kBF16, {3 * timesteps, hidden});
  DeviceTensor d_gate_t = device_empty(DType::kBF16, {3 * timesteps, hidden});
  DeviceTensor d_mod = device_empty(DType::kBF16, {6, rows, hidden});
  DeviceTensor d_temb = device_empty(DType::kF32, {timesteps, dim});
  DeviceTensor d_weight = device_empty(DType::kBF16, {18 * hidden, dim});
  DeviceTensor d_bias = device_empty(DType::kBF16, {18 * hidden});

  std::vector<const DeviceTensor*> outputs() const {
    return {&table, &act, &mod, &normed, &rstd, &out, &d_y, &dx, &d_norm_w, &d_shift, &d_scale, &d_gate_t,
            &d_temb, &d_weight, &d_bias};
  }
  void poison() {
    for (const DeviceTensor* t : outputs()) fill_device(const_cast<DeviceTensor*>(t), kCanary);
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
    for (const DeviceTensor* t : outputs()) r.push_back(download(*t));
    return r;
  }
};

// Eager run, repeat, and two replays of a CUDA graph captured on a stream
// made with `stream_flags`: every output's bytes equal the first run's.
void check_repeat_and_replay(unsigned stream_flags) {
  Region region;
  region.d_mod = upload(random_tensor(DType::kBF16, {6, region.rows, region.hidden}, 17));
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
