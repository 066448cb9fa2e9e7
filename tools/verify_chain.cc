// verify cases of the whole conditioning chain (include/detdit/chain.h, CPU):
// sinusoid -> MLP -> per block projection, modulated norms and gated
// residuals with the seeded stand-in sublayers -> final_adaln_out, forward
// and backward on the first kChainMaxBlocks blocks of the weights (each block
// costs 0.5 GB of bf16 weight gradient). Checks: repeatability
// of the output and of every gradient, and batch invariance of the row-local
// results (out and dx of batch item 0 alone = the same rows inside a batch of
// two, bitwise).
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
  HostBuffer out, dx;
  std::vector<HostBuffer> grads;  // every weight gradient, in a fixed order
};

struct ChainInputs {
  int64_t seq_len = 0, batch = 1, hidden = 0;
  HostBuffer timesteps, ti, tags, x, sublayer_out, sublayer_grad, grad_out;
};

// Weight views of the chain's blocks.
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

HostBuffer like(const TensorView& v) {
  return HostBuffer(v.dtype, std::vector<int64_t>(v.shape, v.shape + v.rank));
}

Status run_chain(const Weights& weights, const ChainInputs& in, bool weight_grads, ChainRun* run) {
  std::vector<ChainBlockWeights> blocks;
  ChainParams p;
  DETDIT_RETURN_IF_ERROR(chain_weights(weights, &blocks, &p.weights));
  DETDIT_RETURN_IF_ERROR(IndexPlan::from_timesteps_and_tags(in.ti.view(), in.tags.view(), kChainTimesteps, in.batch,
                                                           &p.adaln_plan));
  DETDIT_RETURN_IF_ERROR(IndexPlan::from_row_index(in.ti.view(), kChainTimesteps, in.batch, &p.timestep_plan));
  p.timesteps = in.timesteps.view();
  p.x = in.x.view();
  p.sublayer_out = in.sublayer_out.view();
  p.sublayer_grad = in.sublayer_grad.view();
  p.grad_out = in.grad_out.view();
  run->out = HostBuffer(in.x.dtype(), in.x.shape());
  run->dx = HostBuffer(in.x.dtype(), in.x.shape());
  p.out = run->out.view();
  p.grads.dx = run->dx.view();
  std::vector<ChainBlockGrads> block_grads(blocks.size());
  run->grads.clear();
  if (weight_grads) {
    // Reserve first: the gradient views point into these buffers.
    run->grads.reserve(8 + 4 * blocks.size());
    auto add = [&](const TensorView& like_this, TensorView* grad) {
      run->grads.push_back(like(like_this));
      *grad = run->grads.back().view();
    };
    run->grads.push_back(HostBuffer(in.timesteps.dtype(), in.timesteps.shape()));
    p.grads.d_timesteps = run->grads.back().view();
    add(p.weights.mlp_w1, &p.grads.d_mlp_w1);
    add(p.weights.mlp_b1, &p.grads.d_mlp_b1);
    add(p.weights.mlp_w2, &p.grads.d_mlp_w2);
    add(p.weights.mlp_b2, &p.grads.d_mlp_b2);
    for (std::size_t l = 0; l < blocks.size(); ++l) {
      add(blocks[l].adaln_weight, &block_grads[l].d_adaln_weight);
      add(blocks[l].adaln_bias, &block_grads[l].d_adaln_bias);
      add(blocks[l].norm1_weight, &block_grads[l].d_norm1_weight);
      add(blocks[l].norm2_weight, &block_grads[l].d_norm2_weight);
    }
    p.grads.blocks = block_grads.data();
    add(p.weights.norm_out_weight, &p.grads.d_norm_out_weight);
    add(p.weights.out_weight, &p.grads.d_out_weight);
    add(p.weights.out_bias, &p.grads.d_out_bias);
  }
  return chain_forward_backward(p);
}

// Inputs of `batch` items; item b's rows [b*S, (b+1)*S) depend only on b.
Status make_inputs(const VerifyContext& ctx, int64_t batch, ChainInputs* in) {
  const int64_t S = ctx.quick ? 64 : 512, H = ctx.weights->config.hidden, L = chain_blocks(*ctx.weights);
  in->seq_len = S;
  in->batch = batch;
  in->hidden = H;
  in->timesteps = HostBuffer(DType::kF32, {kChainTimesteps});
  in->timesteps.ptr<float>()[0] = 0.25f;
  in->timesteps.ptr<float>()[1] = 0.8125f;
  in->ti = HostBuffer(DType::kI32, {S});
  in->tags = HostBuffer(DType::kI32, {S});
  for (int64_t s = 0; s < S; ++s) {
    in->ti.ptr<int32_t>()[s] = static_cast<int32_t>(s * kChainTimesteps / S);
    in->tags.ptr<int32_t>()[s] = static_cast<int32_t>(s % 7 == 0 ? 1 : s % 5 == 0 ? 2 : 0);
  }
  in->x = HostBuffer(DType::kBF16, {batch * S, H});
  in->grad_out = HostBuffer(DType::kBF16, {batch * S, H});
  in->sublayer_out = HostBuffer(DType::kBF16, {2 * L, batch * S, H});
  in->sublayer_grad = HostBuffer(DType::kBF16, {2 * L, batch * S, H});
  const std::size_t item_bytes = static_cast<std::size_t>(S * H) * 2;
  for (int64_t b = 0; b < batch; ++b) {
    HostBuffer x(DType::kBF16, {S, H}), g(DType::kBF16, {S, H});
    HostBuffer so(DType::kBF16, {2 * L, S, H}), sg(DType::kBF16, {2 * L, S, H});
    x.fill_normal(ctx.seed + 100 + b);
    g.fill_normal(ctx.seed + 200 + b);
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
  ChainRun first;
  rows->push_back(timed_check("forward+backward repeatability (out, dx, every grad)", [&](CheckRow* row) {
    ChainRun second;
    DETDIT_RETURN_IF_ERROR(run_chain(*ctx.weights, pair, true, &first));
    DETDIT_RETURN_IF_ERROR(run_chain(*ctx.weights, pair, true, &second));
    compare_bytes(first.out.data(), second.out.data(), first.out.nbytes(), first.out.dtype(), "out", row);
    compare_bytes(first.dx.data(), second.dx.data(), first.dx.nbytes(), first.dx.dtype(), "dx", row);
    for (std::size_t i = 0; i < first.grads.size(); ++i) {
      compare_bytes(first.grads[i].data(), second.grads[i].data(), first.grads[i].nbytes(), first.grads[i].dtype(),
                    "gradient " + std::to_string(i), row);
    }
    return Status::ok_status();
  }));
  rows->push_back(timed_check("batch invariance of out and dx (B=1 vs B=2)", [&](CheckRow* row) {
    ChainRun alone;
    DETDIT_RETURN_IF_ERROR(run_chain(*ctx.weights, single, false, &alone));
    if (first.out.nbytes() == 0) DETDIT_RETURN_IF_ERROR(run_chain(*ctx.weights, pair, false, &first));
    compare_bytes(alone.out.data(), first.out.data(), alone.out.nbytes(), alone.out.dtype(), "out of item 0", row);
    compare_bytes(alone.dx.data(), first.dx.data(), alone.dx.nbytes(), alone.dx.dtype(), "dx of item 0", row);
    return Status::ok_status();
  }));
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("chain", "blocks 0..1, fwd+bwd, T=2", true, false, verify_chain);

}  // namespace
}  // namespace cli
}  // namespace detdit
