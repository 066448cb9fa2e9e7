// bench cases of the ops on the weights' shapes: timestep_mlp, adaln_projection
// (T = 1, 4), modulated rmsnorm and gate_residual forward (S = 4097, T = 3).
// Byte models count what one call must move at least: every input read once,
// every output written once. #wrong compares the last timed call's output
// bitwise with a fresh CPU reference call.
#include <cstring>
#include <map>

#include "bench.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/plan.h"
#include "detdit/rmsnorm.h"
#include "detdit/timestep.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

// One benchmarked op: its inputs live on the bench device; `call` runs it
// into `out` on any device (the CPU reference uses the same call).
struct OpState {
  std::vector<HostBuffer> host_inputs;
  std::vector<DeviceTensor> inputs;
  DeviceTensor out;
  std::vector<int64_t> out_shape;
  DType out_dtype = DType::kF32;
  std::function<Status(const std::vector<TensorView>& inputs, const TensorView& out, Stream stream)> call;
};

std::vector<TensorView> views(const std::vector<DeviceTensor>& tensors) {
  std::vector<TensorView> v;
  for (const DeviceTensor& t : tensors) v.push_back(t.view());
  return v;
}

double total_bytes(const std::vector<HostBuffer>& inputs, std::size_t out_bytes) {
  double bytes = static_cast<double>(out_bytes);
  for (const HostBuffer& b : inputs) bytes += static_cast<double>(b.nbytes());
  return bytes;
}

Status finish_instance(const BenchContext& ctx, std::shared_ptr<OpState> state, const std::string& byte_model,
                       BenchInstance* instance) {
  for (const HostBuffer& h : state->host_inputs) {
    DeviceTensor t;
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(h, ctx.device, &t));
    state->inputs.push_back(t);
  }
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(state->out_dtype, state->out_shape, ctx.device, &state->out));
  HostBuffer probe(state->out_dtype, state->out_shape);
  instance->bytes = total_bytes(state->host_inputs, probe.nbytes());
  instance->byte_model = byte_model;
  const Stream stream = ctx.stream;
  OpState* s = state.get();
  instance->run = [s, stream]() { return s->call(views(s->inputs), s->out.view(), stream); };
  instance->check = [s](int64_t* wrong, int64_t* compared) {
    HostBuffer got;
    DETDIT_RETURN_IF_ERROR(s->out.to_host(&got));
    std::vector<DeviceTensor> cpu_inputs(s->host_inputs.size());
    for (std::size_t i = 0; i < s->host_inputs.size(); ++i) {
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(s->host_inputs[i], Device::cpu(), &cpu_inputs[i]));
    }
    DeviceTensor reference;
    DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(s->out_dtype, s->out_shape, Device::cpu(), &reference));
    DETDIT_RETURN_IF_ERROR(s->call(views(cpu_inputs), reference.view(), nullptr));
    HostBuffer expected;
    DETDIT_RETURN_IF_ERROR(reference.to_host(&expected));
    const std::size_t width = dtype_size(s->out_dtype);
    *compared = got.numel();
    *wrong = 0;
    for (int64_t i = 0; i < got.numel(); ++i) {
      *wrong += std::memcmp(static_cast<const char*>(got.data()) + i * width,
                            static_cast<const char*>(expected.data()) + i * width, width) != 0;
    }
    return Status::ok_status();
  };
  instance->keep_alive = state;
  return Status::ok_status();
}

Status weight_copy(const BenchContext& ctx, const std::string& name, HostBuffer* out) {
  TensorView v;
  DETDIT_RETURN_IF_ERROR(ctx.weights->view(name, &v));
  *out = HostBuffer(v.dtype, std::vector<int64_t>(v.shape, v.shape + v.rank));
  std::memcpy(out->data(), v.data, out->nbytes());
  return Status::ok_status();
}

Status setup_mlp(const BenchContext& ctx, int64_t count, BenchInstance* instance) {
  auto state = std::make_shared<OpState>();
  state->host_inputs.resize(5);
  state->host_inputs[0] = HostBuffer(DType::kF32, {count, ctx.weights->config.freq_dim});
  state->host_inputs[0].fill_normal(ctx.seed + 1, 0.0, 0.7);
  const char* names[] = {"time_embedder.linear_1.weight", "time_embedder.linear_1.bias",
                         "time_embedder.linear_2.weight", "time_embedder.linear_2.bias"};
  for (int i = 0; i < 4; ++i) DETDIT_RETURN_IF_ERROR(weight_copy(ctx, names[i], &state->host_inputs[i + 1]));
  state->out_shape = {count, ctx.weights->config.time_embed_dim};
  state->call = [](const std::vector<TensorView>& in, const TensorView& out, Stream stream) {
    TimestepMlpParams p;
    p.in.features = in[0];
    p.in.w1 = in[1];
    p.in.b1 = in[2];
    p.in.w2 = in[3];
    p.in.b2 = in[4];
    p.temb = out;
    return timestep_mlp_forward(p, stream);
  };
  return finish_instance(ctx, state, "features + W1 + b1 + W2 + b2 + temb", instance);
}
Status setup_mlp_1(const BenchContext& ctx, BenchInstance* i) { return setup_mlp(ctx, 1, i); }
Status setup_mlp_4(const BenchContext& ctx, BenchInstance* i) { return setup_mlp(ctx, 4, i); }
DETDIT_BENCH_CASE("timestep_mlp", "T=1", true, true, setup_mlp_1);
DETDIT_BENCH_CASE("timestep_mlp", "T=4", true, true, setup_mlp_4);

Status setup_projection(const BenchContext& ctx, int64_t count, BenchInstance* instance) {
  auto state = std::make_shared<OpState>();
  state->host_inputs.resize(3);
  state->host_inputs[0] = HostBuffer(DType::kF32, {count, ctx.weights->config.time_embed_dim});
  state->host_inputs[0].fill_normal(ctx.seed + 2);
  DETDIT_RETURN_IF_ERROR(weight_copy(ctx, "transformer_blocks.0.adaln_proj.linear.weight", &state->host_inputs[1]));
  DETDIT_RETURN_IF_ERROR(weight_copy(ctx, "transformer_blocks.0.adaln_proj.linear.bias", &state->host_inputs[2]));
  state->out_shape = {count, state->host_inputs[1].shape()[0]};
  state->out_dtype = DType::kBF16;
  state->call = [](const std::vector<TensorView>& in, const TensorView& out, Stream stream) {
    AdalnProjectionParams p;
    p.in.temb = in[0];
    p.in.weight = in[1];
    p.in.bias = in[2];
    p.table = out;
    return adaln_projection_forward(p, stream);
  };
  return finish_instance(ctx, state, "temb + W + b + table", instance);
}
Status setup_projection_1(const BenchContext& ctx, BenchInstance* i) { return setup_projection(ctx, 1, i); }
Status setup_projection_4(const BenchContext& ctx, BenchInstance* i) { return setup_projection(ctx, 4, i); }
DETDIT_BENCH_CASE("adaln_projection", "T=1", true, true, setup_projection_1);
DETDIT_BENCH_CASE("adaln_projection", "T=4", true, true, setup_projection_4);

// Row-wise cases: S positions, T = 3, row index = (p * 9 / S) (3 rows per
// timestep in order), table (3T, 6H) bf16. A trainer builds the plan once per
// step and reuses it in every block, so the plan of each index buffer is built
// on its first (warm-up) call and reused: the timed calls are the op alone.
constexpr int64_t kRowwiseTimesteps = 3;

class PlanCache {
 public:
  Status get(const TensorView& index, Stream stream, IndexPlan* plan) {
    IndexPlan& cached = plans_[index.data];
    if (!cached.valid())
      DETDIT_RETURN_IF_ERROR(IndexPlan::from_row_index(index, 3 * kRowwiseTimesteps, 1, &cached, stream));
    *plan = cached;
    return Status();
  }

 private:
  std::map<const void*, IndexPlan> plans_;  // one per (rotated) index buffer
};

HostBuffer rowwise_index(int64_t seq_len) {
  HostBuffer rows(DType::kI32, {seq_len});
  for (int64_t p = 0; p < seq_len; ++p) rows.ptr<int32_t>()[p] = static_cast<int32_t>(p * 3 * kRowwiseTimesteps / seq_len);
  return rows;
}

TensorView chunk_of(const TensorView& table, int64_t hidden, int chunk) {
  TensorView v = table;
  v.shape[1] = hidden;
  v.data = static_cast<char*>(table.data) + chunk * hidden * 2;
  return v;
}

Status setup_rmsnorm(const BenchContext& ctx, BenchInstance* instance) {
  const int64_t S = 4097, H = ctx.weights->config.hidden;
  auto state = std::make_shared<OpState>();
  state->host_inputs.resize(4);
  state->host_inputs[0] = HostBuffer(DType::kBF16, {S, H});
  state->host_inputs[0].fill_normal(ctx.seed + 3);
  DETDIT_RETURN_IF_ERROR(weight_copy(ctx, "transformer_blocks.0.norm1.weight", &state->host_inputs[1]));
  state->host_inputs[2] = HostBuffer(DType::kBF16, {3 * kRowwiseTimesteps, 6 * H});
  state->host_inputs[2].fill_normal(ctx.seed + 4, 0.0, 0.5);
  state->host_inputs[3] = rowwise_index(S);
  state->out_shape = {S, H};
  state->out_dtype = DType::kBF16;
  state->call = [H, plans = std::make_shared<PlanCache>()](const std::vector<TensorView>& in, const TensorView& out,
                                                           Stream stream) {
    RmsnormParams p;
    DETDIT_RETURN_IF_ERROR(plans->get(in[3], stream, &p.in.plan));
    p.in.x = in[0];
    p.in.weight = in[1];
    p.in.shift = chunk_of(in[2], H, 0);
    p.in.scale = chunk_of(in[2], H, 1);
    p.out = out;
    return rmsnorm_forward(p, stream);
  };
  return finish_instance(ctx, state, "x + w + table + index + out", instance);
}
DETDIT_BENCH_CASE("rmsnorm", "modulated S=4097", true, true, setup_rmsnorm);

Status setup_gate(const BenchContext& ctx, BenchInstance* instance) {
  const int64_t S = 4097, H = ctx.weights->config.hidden;
  auto state = std::make_shared<OpState>();
  state->host_inputs.resize(4);
  state->host_inputs[0] = HostBuffer(DType::kBF16, {S, H});
  state->host_inputs[0].fill_normal(ctx.seed + 5);
  state->host_inputs[1] = HostBuffer(DType::kBF16, {S, H});
  state->host_inputs[1].fill_normal(ctx.seed + 6, 0.0, 3.0);
  state->host_inputs[2] = HostBuffer(DType::kBF16, {3 * kRowwiseTimesteps, 6 * H});
  state->host_inputs[2].fill_normal(ctx.seed + 7, 0.0, 0.5);
  state->host_inputs[3] = rowwise_index(S);
  state->out_shape = {S, H};
  state->out_dtype = DType::kBF16;
  state->call = [H, plans = std::make_shared<PlanCache>()](const std::vector<TensorView>& in, const TensorView& out,
                                                           Stream stream) {
    GateResidualParams p;
    DETDIT_RETURN_IF_ERROR(plans->get(in[3], stream, &p.in.plan));
    p.in.residual = in[0];
    p.in.y = in[1];
    p.in.gate = chunk_of(in[2], H, 2);
    p.out = out;
    return gate_residual_forward(p, stream);
  };
  return finish_instance(ctx, state, "residual + y + table + index + out", instance);
}
DETDIT_BENCH_CASE("gate_residual", "S=4097", true, true, setup_gate);

}  // namespace
}  // namespace cli
}  // namespace detdit
