// verify cases of the whole conditioning chain (include/detdit/chain.h) on the
// run's device: sinusoid -> MLP -> per block projection, modulated norms and
// gated residuals with the seeded stand-in sublayers -> final_adaln_out,
// forward and backward on the first kChainMaxBlocks blocks of the weights
// (each block costs 0.5 GB of bf16 weight gradient). Checks: repeatability
// of the output and of every gradient, batch invariance of the row-local
// results (out and dx of batch item 0 alone = the same rows inside a batch of
// two, bitwise), and on CUDA every output and gradient equal to the CPU
// chain's, bitwise.
#include <algorithm>
#include <cstring>

#include "detdit/chain.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

constexpr int64_t kChainTimesteps = 2;
constexpr int64_t kChainMaxBlocks = 2;

int64_t chain_blocks(const Weights& w) { return std::min(w.config.blocks, kChainMaxBlocks); }

struct ChainRun {
  HostTensor out, dx;
  std::vector<HostTensor> grads;  // every weight gradient, in a fixed order
};

struct ChainInputs {
  int64_t seq_len = 0, batch = 1, hidden = 0;
  HostTensor timesteps, ti, tags, x, sublayer_out, sublayer_grad, grad_out;
};

// Weight views of the chain's blocks (host memory).
Status chain_weights(const Weights& w, std::vector<ChainBlockWeights>* blocks, ChainWeights* out) {
  blocks->resize(static_cast<std::size_t>(chain_blocks(w)));
  for (int64_t l = 0; l < chain_blocks(w); ++l) {
    const std::string prefix = "transformer_blocks." + std::to_string(l) + ".";
    DETDIT_RETURN_IF_ERROR(w.view(prefix + "adaln_proj.linear.weight", &(*blocks)[l].adaln_weight));
    DETDIT_RETURN_IF_ERROR(w.view(prefix + "adaln_proj.linear.bias", &(*blocks)[l].adaln_bias));
    DETDIT_RETURN_IF_ERROR(w.view(prefix + "norm1.weight", &(*blocks)[l].norm1_weight));
    DETDIT_RETURN_IF_ERROR(w.view(prefix + "norm2.weight", &(*blocks)[l].norm2_weight));
  }
  DETDIT_RETURN_IF_ERROR(w.view("time_embedder.linear_1.weight", &out->mlp_w1));
  DETDIT_RETURN_IF_ERROR(w.view("time_embedder.linear_1.bias", &out->mlp_b1));
  DETDIT_RETURN_IF_ERROR(w.view("time_embedder.linear_2.weight", &out->mlp_w2));
  DETDIT_RETURN_IF_ERROR(w.view("time_embedder.linear_2.bias", &out->mlp_b2));
  DETDIT_RETURN_IF_ERROR(w.view("norm_out.norm.weight", &out->norm_out_weight));
  DETDIT_RETURN_IF_ERROR(w.view("norm_out.linear.weight", &out->out_weight));
  DETDIT_RETURN_IF_ERROR(w.view("norm_out.linear.bias", &out->out_bias));
  out->blocks = blocks->data();
  out->num_blocks = chain_blocks(w);
  return Status::ok_status();
}

std::vector<int64_t> shape_of(const TensorView& v) { return std::vector<int64_t>(v.shape, v.shape + v.rank); }

// The chain's weights on one device: the weights' own host views on the CPU,
// device copies on CUDA (made once per case, shared by its runs).
struct ChainWeightsOn {
  Device device;
  std::vector<ChainBlockWeights> blocks;
  ChainWeights weights;
  std::vector<DeviceTensor> copies;
};

Status chain_weights_on(const Weights& w, const Device& device, ChainWeightsOn* out) {
  out->device = device;
  DETDIT_RETURN_IF_ERROR(chain_weights(w, &out->blocks, &out->weights));
  if (!device.is_cuda()) return Status::ok_status();
  // every weight view, each replaced by its device copy
  std::vector<TensorView*> views = {&out->weights.mlp_w1, &out->weights.mlp_b1, &out->weights.mlp_w2,
                                    &out->weights.mlp_b2, &out->weights.norm_out_weight, &out->weights.out_weight,
                                    &out->weights.out_bias};
  for (ChainBlockWeights& b : out->blocks)
    for (TensorView* v : {&b.adaln_weight, &b.adaln_bias, &b.norm1_weight, &b.norm2_weight}) views.push_back(v);
  out->copies.reserve(views.size());
  for (TensorView* v : views) {
    HostTensor host(v->dtype, shape_of(*v));
    std::memcpy(host.data(), v->data, host.nbytes());
    out->copies.emplace_back();
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(host, device, &out->copies.back()));
    *v = out->copies.back().view();
  }
  out->weights.blocks = out->blocks.data();
  return Status::ok_status();
}

// One chain call on the weights' device; every output comes back to the host.
Status run_chain(const ChainWeightsOn& w, const ChainInputs& in, bool weight_grads, ChainRun* run) {
  const Device& device = w.device;
  ChainParams p;
  p.weights = w.weights;
  DeviceTensor ti, tags, timesteps, x, sublayer_out, sublayer_grad, grad_out, out, dx;
  for (const auto& [host, tensor] : {std::make_pair(&in.ti, &ti), std::make_pair(&in.tags, &tags),
                                     std::make_pair(&in.timesteps, &timesteps), std::make_pair(&in.x, &x),
                                     std::make_pair(&in.sublayer_out, &sublayer_out),
                                     std::make_pair(&in.sublayer_grad, &sublayer_grad),
                                     std::make_pair(&in.grad_out, &grad_out)})
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(*host, device, tensor));
  DETDIT_RETURN_IF_ERROR(IndexPlan::from_timesteps_and_tags(ti.view(), tags.view(), kChainTimesteps, in.batch,
                                                           &p.adaln_plan));
  DETDIT_RETURN_IF_ERROR(IndexPlan::from_row_index(ti.view(), kChainTimesteps, in.batch, &p.timestep_plan));
  p.timesteps = timesteps.view();
  p.x = x.view();
  p.sublayer_out = sublayer_out.view();
  p.sublayer_grad = sublayer_grad.view();
  p.grad_out = grad_out.view();
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(in.x.dtype(), in.x.shape(), device, &out));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(in.x.dtype(), in.x.shape(), device, &dx));
  p.out = out.view();
  p.grads.dx = dx.view();
  std::vector<ChainBlockGrads> block_grads(w.blocks.size());
  std::vector<DeviceTensor> grads;
  if (weight_grads) {
    // Reserve first: the gradient views point into these tensors.
    grads.reserve(8 + 4 * w.blocks.size());
    auto add = [&](const TensorView& like_this, TensorView* grad) {
      grads.emplace_back();
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(like_this.dtype, shape_of(like_this), device, &grads.back()));
      *grad = grads.back().view();
      return Status::ok_status();
    };
    DETDIT_RETURN_IF_ERROR(add(p.timesteps, &p.grads.d_timesteps));
    DETDIT_RETURN_IF_ERROR(add(p.weights.mlp_w1, &p.grads.d_mlp_w1));
    DETDIT_RETURN_IF_ERROR(add(p.weights.mlp_b1, &p.grads.d_mlp_b1));
    DETDIT_RETURN_IF_ERROR(add(p.weights.mlp_w2, &p.grads.d_mlp_w2));
    DETDIT_RETURN_IF_ERROR(add(p.weights.mlp_b2, &p.grads.d_mlp_b2));
    for (std::size_t l = 0; l < w.blocks.size(); ++l) {
      DETDIT_RETURN_IF_ERROR(add(w.blocks[l].adaln_weight, &block_grads[l].d_adaln_weight));
      DETDIT_RETURN_IF_ERROR(add(w.blocks[l].adaln_bias, &block_grads[l].d_adaln_bias));
      DETDIT_RETURN_IF_ERROR(add(w.blocks[l].norm1_weight, &block_grads[l].d_norm1_weight));
      DETDIT_RETURN_IF_ERROR(add(w.blocks[l].norm2_weight, &block_grads[l].d_norm2_weight));
    }
    p.grads.blocks = block_grads.data();
    DETDIT_RETURN_IF_ERROR(add(p.weights.norm_out_weight, &p.grads.d_norm_out_weight));
    DETDIT_RETURN_IF_ERROR(add(p.weights.out_weight, &p.grads.d_out_weight));
    DETDIT_RETURN_IF_ERROR(add(p.weights.out_bias, &p.grads.d_out_bias));
  }
  DETDIT_RETURN_IF_ERROR(chain_forward_backward(p));
  DETDIT_RETURN_IF_ERROR(out.to_host(&run->out));
  DETDIT_RETURN_IF_ERROR(dx.to_host(&run->dx));
  run->grads.assign(grads.size(), HostTensor());
  for (std::size_t i = 0; i < grads.size(); ++i) DETDIT_RETURN_IF_ERROR(grads[i].to_host(&run->grads[i]));
  return Status::ok_status();
}

// Every output of two runs compared bytewise.
void compare_runs(const ChainRun& expected, const ChainRun& actual, CheckRow* row) {
  compare_bytes(expected.out.data(), actual.out.data(), expected.out.nbytes(), expected.out.dtype(), "out", row);
  compare_bytes(expected.dx.data(), actual.dx.data(), expected.dx.nbytes(), expected.dx.dtype(), "dx", row);
  for (std::size_t i = 0; i < expected.grads.size() && i < actual.grads.size(); ++i)
    compare_bytes(expected.grads[i].data(), actual.grads[i].data(), expected.grads[i].nbytes(), expected.grads[i].dtype(),
                  "gradient " + std::to_string(i), row);
}

// Inputs of `batch` items; item b's rows [b*S, (b+1)*S) depend only on b.
Status make_inputs(const VerifyContext& ctx, int64_t batch, ChainInputs* in) {
  const int64_t S = ctx.quick ? 64 : 512, H = ctx.weights->config.hidden, L = chain_blocks(*ctx.weights);
  in->seq_len = S;
  in->batch = batch;
  in->hidden = H;
  in->timesteps = HostTensor(DType::kF32, {kChainTimesteps});
  in->timesteps.ptr<float>()[0] = 0.25f;
  in->timesteps.ptr<float>()[1] = 0.8125f;
  in->ti = HostTensor(DType::kI32, {S});
  in->tags = HostTensor(DType::kI32, {S});
  for (int64_t s = 0; s < S; ++s) {
    in->ti.ptr<int32_t>()[s] = static_cast<int32_t>(s * kChainTimesteps / S);
    in->tags.ptr<int32_t>()[s] = static_cast<int32_t>(s % 7 == 0 ? 1 : s % 5 == 0 ? 2 : 0);
  }
  in->x = HostTensor(DType::kBF16, {batch * S, H});
  in->grad_out = HostTensor(DType::kBF16, {batch * S, H});
  in->sublayer_out = HostTensor(DType::kBF16, {2 * L, batch * S, H});
  in->sublayer_grad = HostTensor(DType::kBF16, {2 * L, batch * S, H});
  const std::size_t item_bytes = static_cast<std::size_t>(S * H) * 2;
  for (int64_t b = 0; b < batch; ++b) {
    HostTensor x(DType::kBF16, {S, H}), g(DType::kBF16, {S, H});
    HostTensor so(DType::kBF16, {2 * L, S, H}), sg(DType::kBF16, {2 * L, S, H});
    fill_verify_normal(&x, ctx.seed + 100 + b);
    fill_verify_normal(&g, ctx.seed + 200 + b);
    DETDIT_RETURN_IF_ERROR(chain_stand_ins(ctx.seed + 300 + b, so.view(), sg.view()));
    std::memcpy(static_cast<char*>(in->x.data()) + b * item_bytes, x.data(), item_bytes);
    std::memcpy(static_cast<char*>(in->grad_out.data()) + b * item_bytes, g.data(), item_bytes);
    for (int64_t k = 0; k < 2 * L; ++k) {
      std::memcpy(static_cast<char*>(in->sublayer_out.data()) + (k * batch + b) * item_bytes,
                  static_cast<const char*>(so.data()) + k * item_bytes, item_bytes);
      std::memcpy(static_cast<char*>(in->sublayer_grad.data()) + (k * batch + b) * item_bytes,
                  static_cast<const char*>(sg.data()) + k * item_bytes, item_bytes);
    }
  }
  return Status::ok_status();
}

Status verify_chain(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  ChainInputs pair, single;
  DETDIT_RETURN_IF_ERROR(make_inputs(ctx, 2, &pair));
  DETDIT_RETURN_IF_ERROR(make_inputs(ctx, 1, &single));
  ChainWeightsOn weights;
  DETDIT_RETURN_IF_ERROR(chain_weights_on(*ctx.weights, ctx.device, &weights));
  ChainRun first;
  rows->push_back(timed_check("forward+backward repeatability (out, dx, every grad)", [&](CheckRow* row) {
    ChainRun second;
    DETDIT_RETURN_IF_ERROR(run_chain(weights, pair, true, &first));
    DETDIT_RETURN_IF_ERROR(run_chain(weights, pair, true, &second));
    compare_runs(first, second, row);
    return Status::ok_status();
  }));
  rows->push_back(timed_check("batch invariance of out and dx (B=1 vs B=2)", [&](CheckRow* row) {
    ChainRun alone;
    DETDIT_RETURN_IF_ERROR(run_chain(weights, single, false, &alone));
    if (first.out.nbytes() == 0) DETDIT_RETURN_IF_ERROR(run_chain(weights, pair, false, &first));
    compare_bytes(alone.out.data(), first.out.data(), alone.out.nbytes(), alone.out.dtype(), "out of item 0", row);
    compare_bytes(alone.dx.data(), first.dx.data(), alone.dx.nbytes(), alone.dx.dtype(), "dx of item 0", row);
    return Status::ok_status();
  }));
  if (ctx.device.is_cuda()) {
    rows->push_back(timed_check("cuda = cpu reference (out, dx, every grad)", [&](CheckRow* row) {
      ChainWeightsOn host_weights;
      DETDIT_RETURN_IF_ERROR(chain_weights_on(*ctx.weights, Device::cpu(), &host_weights));
      ChainRun reference;
      DETDIT_RETURN_IF_ERROR(run_chain(host_weights, pair, true, &reference));
      if (first.grads.size() != reference.grads.size()) DETDIT_RETURN_IF_ERROR(run_chain(weights, pair, true, &first));
      compare_runs(reference, first, row);
      return Status::ok_status();
    }));
  }
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("chain", "blocks 0..1, fwd+bwd, T=2", true, true, verify_chain);

}  // namespace
}  // namespace cli
}  // namespace detdit
