// The chain's op cases (include/detdit/chain.h): sinusoid -> MLP -> per block
// projection, modulated norms and gated residuals with the seeded stand-in
// sublayers -> final_adaln_out, forward and backward as one call (the case's
// forward phase), on the first kChainMaxBlocks blocks of the context's
// weights (each H3 block costs 0.5 GB of bf16 weight gradient).
//
// kVerify only: S = 512 (--quick 64), B = 2, T = 2 at the weights' H, bf16
// activations; timesteps 0.25 and 0.8125, position s at timestep s*T/S with
// tag 1 where s % 7 == 0, else 2 where s % 5 == 0, else 0. Batch item b's
// inputs depend on b alone (x, grad_out N(0, 1) from verify's stream at seeds
// seed + 100 + b and seed + 200 + b; the stand-ins chain_stand_ins(seed + 300
// + b)), so the batch item is the case's position: the row-invariance check
// runs each item alone (B = 1) and compares its out and dx. The weight
// gradients are sums over the batch and are compared by repeatability (and on
// CUDA against the CPU) only. Without weights (no context weights) the
// weights are generated at the context's dimensions.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cases/op_case.h"
#include "detdit/chain.h"

namespace detdit {
namespace cases {
namespace {

constexpr int64_t kChainTimesteps = 2;
constexpr int64_t kChainMaxBlocks = 2;

struct ChainShape {
  int64_t seq_len = 0, batch = 1, hidden = 0, blocks = 0;
  bool weight_grads = true;  // the alone cases compute out and dx only
};

std::string block_prefix(int64_t l) { return "transformer_blocks." + std::to_string(l) + "."; }

// The blocks the context's weights have, at most kChainMaxBlocks (without weights: that many).
int64_t chain_blocks(const CaseContext& ctx) {
  if (!ctx.weight) return kChainMaxBlocks;
  int64_t l = 0;
  TensorView w;
  while (l < kChainMaxBlocks && ctx.weight(block_prefix(l) + "adaln_proj.linear.weight", &w).ok()) ++l;
  return l;
}

// An input per batch item: item b's (S, ...) slice made by fill_item(b, slice).
Fill per_item(int64_t batch, const std::function<void(int64_t item, HostTensor* slice)>& fill_item) {
  return [batch, fill_item](HostTensor* t) {
    std::vector<int64_t> shape = t->shape();
    shape[0] = 1;
    const std::size_t bytes = t->nbytes() / static_cast<std::size_t>(batch);
    for (int64_t b = 0; b < batch; ++b) {
      HostTensor item(t->dtype(), shape);
      fill_item(b, &item);
      std::memcpy(static_cast<char*>(t->data()) + b * bytes, item.data(), bytes);
    }
  };
}

// The (2L, B, S, H) stand-in tensors: item b's (2L, S, H) from
// chain_stand_ins(seed + 300 + b). One call makes both tensors (12 uniforms
// an element), so the two fills share it: the first makes both, the second
// takes the other's bytes (a pure function of the case all the same).
struct StandIns {
  HostTensor out, grad;
};

Fill stand_ins(uint64_t seed, int64_t batch, bool grad, const std::shared_ptr<StandIns>& made) {
  return [seed, batch, grad, made](HostTensor* t) {
    HostTensor& mine = grad ? made->grad : made->out;
    if (mine.nbytes() != t->nbytes()) {
      const std::vector<int64_t>& shape = t->shape();  // (2L, B, S, H)
      const int64_t sublayers = shape[0], S = shape[2], H = shape[3];
      const std::size_t item_bytes = static_cast<std::size_t>(S * H) * dtype_size(t->dtype());
      made->out = HostTensor(t->dtype(), shape);
      made->grad = HostTensor(t->dtype(), shape);
      for (int64_t b = 0; b < batch; ++b) {
        HostTensor out(t->dtype(), {sublayers, S, H}), g(t->dtype(), {sublayers, S, H});
        // Both tensors are contiguous CPU (2L, S, H) of one float dtype: a failure is a bug in this file.
        if (!chain_stand_ins(seed + 300 + b, out.view(), g.view()).ok()) std::abort();
        for (int64_t k = 0; k < sublayers; ++k) {
          const std::size_t at = (k * batch + b) * item_bytes, from = k * item_bytes;
          std::memcpy(static_cast<char*>(made->out.data()) + at, static_cast<const char*>(out.data()) + from, item_bytes);
          std::memcpy(static_cast<char*>(made->grad.data()) + at, static_cast<const char*>(g.data()) + from, item_bytes);
        }
      }
    }
    std::memcpy(t->data(), mine.data(), t->nbytes());
  };
}

// The weights, each an input named as in the weights file: the context's
// tensor (its dtype, shape and bytes), or generated at the H3 layout.
struct WeightInput {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

std::vector<WeightInput> weight_inputs(const CaseContext& ctx, int64_t blocks) {
  const int64_t H = ctx.hidden, D = ctx.time_embed_dim, Ht = ctx.time_embed_hidden, F = ctx.freq_dim;
  const DType f32 = DType::kF32, bf16 = DType::kBF16;
  std::vector<WeightInput> w = {{"time_embedder.linear_1.weight", f32, {Ht, F}},
                                {"time_embedder.linear_1.bias", f32, {Ht}},
                                {"time_embedder.linear_2.weight", f32, {D, Ht}},
                                {"time_embedder.linear_2.bias", f32, {D}}};
  for (int64_t l = 0; l < blocks; ++l) {
    const std::string p = block_prefix(l);
    w.push_back({p + "adaln_proj.linear.weight", bf16, {18 * H, D}});
    w.push_back({p + "adaln_proj.linear.bias", bf16, {18 * H}});
    w.push_back({p + "norm1.weight", bf16, {H}});
    w.push_back({p + "norm2.weight", bf16, {H}});
  }
  w.push_back({"norm_out.norm.weight", bf16, {H}});
  w.push_back({"norm_out.linear.weight", bf16, {2 * H, D}});
  w.push_back({"norm_out.linear.bias", bf16, {2 * H}});
  for (WeightInput& in : w) {
    TensorView view;
    if (ctx.weight && ctx.weight(in.name, &view).ok()) {
      in.dtype = view.dtype;
      in.shape.assign(view.shape, view.shape + view.rank);
    }
  }
  return w;
}

// Views of the instance's weights (block views in `blocks`) and, with
// weight_grads, of its gradients (block gradient views in `block_grads`).
void bind(const Instance& t, int64_t num_blocks, bool weight_grads, std::vector<ChainBlockWeights>* blocks,
          std::vector<ChainBlockGrads>* block_grads, ChainParams* p) {
  ChainWeights& w = p->weights;
  w.mlp_w1 = t["time_embedder.linear_1.weight"];
  w.mlp_b1 = t["time_embedder.linear_1.bias"];
  w.mlp_w2 = t["time_embedder.linear_2.weight"];
  w.mlp_b2 = t["time_embedder.linear_2.bias"];
  w.norm_out_weight = t["norm_out.norm.weight"];
  w.out_weight = t["norm_out.linear.weight"];
  w.out_bias = t["norm_out.linear.bias"];
  blocks->resize(static_cast<std::size_t>(num_blocks));
  block_grads->resize(static_cast<std::size_t>(num_blocks));
  for (int64_t l = 0; l < num_blocks; ++l) {
    const std::string prefix = block_prefix(l);
    (*blocks)[l] = {t[prefix + "adaln_proj.linear.weight"], t[prefix + "adaln_proj.linear.bias"],
                    t[prefix + "norm1.weight"], t[prefix + "norm2.weight"]};
    if (weight_grads)
      (*block_grads)[l] = {t["d_" + prefix + "adaln_proj.linear.weight"], t["d_" + prefix + "adaln_proj.linear.bias"],
                           t["d_" + prefix + "norm1.weight"], t["d_" + prefix + "norm2.weight"]};
  }
  w.blocks = blocks->data();
  w.num_blocks = num_blocks;
  if (!weight_grads) return;
  ChainGrads& g = p->grads;
  g.d_timesteps = t["d_timesteps"];
  g.d_mlp_w1 = t["d_time_embedder.linear_1.weight"];
  g.d_mlp_b1 = t["d_time_embedder.linear_1.bias"];
  g.d_mlp_w2 = t["d_time_embedder.linear_2.weight"];
  g.d_mlp_b2 = t["d_time_embedder.linear_2.bias"];
  g.blocks = block_grads->data();
  g.d_norm_out_weight = t["d_norm_out.norm.weight"];
  g.d_out_weight = t["d_norm_out.linear.weight"];
  g.d_out_bias = t["d_norm_out.linear.bias"];
}

// A contiguous view with dimensions d and d + 1 merged: (B, S, H) as the
// chain's (B*S, H), (2L, B, S, H) as its (2L, B*S, H). (The chain documents
// x as (B*S, H) or (B, S, H), but its internal gate_residual wants the
// (B*S, H) of its scratch tensors, so every per-position tensor goes in flat.)
TensorView merged(TensorView v, int d) {
  v.shape[d] *= v.shape[d + 1];
  v.strides[d] = v.strides[d + 1];
  for (int i = d + 1; i + 1 < v.rank; ++i) {
    v.shape[i] = v.shape[i + 1];
    v.strides[i] = v.strides[i + 1];
  }
  --v.rank;
  v.shape[v.rank] = 0;
  v.strides[v.rank] = 0;
  return v;
}

OpCase chain_case(const CaseContext& ctx, const ChainShape& s) {
  OpCase c;
  c.op = "chain";
  c.name = "blocks 0.." + std::to_string(s.blocks - 1) + ", fwd+bwd, T=" + std::to_string(kChainTimesteps);
  const int64_t S = s.seq_len, B = s.batch, H = s.hidden, L = s.blocks;
  IndexCase index;
  index.packing = Packing::kBlock;
  index.seq_len = S;
  index.num_timesteps = kChainTimesteps;
  index.batch = B;
  for (int64_t p = 0; p < S; ++p) {
    index.timestep_indices.push_back(p * kChainTimesteps / S);
    index.tags.push_back(p % 7 == 0 ? 1 : p % 5 == 0 ? 2 : 0);
  }
  c.plans.push_back({"adaln", index, PlanSpec::Rows::kAdaln});
  c.plans.push_back({"timestep", index, PlanSpec::Rows::kTimestep});
  c.input("timesteps", Phase::kForward, DType::kF32, {kChainTimesteps}, [](HostTensor* t) {
    t->ptr<float>()[0] = 0.25f;
    t->ptr<float>()[1] = 0.8125f;
  });
  const std::vector<WeightInput> weights = weight_inputs(ctx, L);
  uint64_t weight_seed = 400;
  for (const WeightInput& w : weights)
    c.input(w.name, Phase::kForward, w.dtype, w.shape, weight_or(ctx, w.name, uniform_values(weight_seed++, 0.0, 0.02)));
  const uint64_t seed = ctx.seed;
  auto normal = [seed](uint64_t offset) {
    return [seed, offset](int64_t b, HostTensor* item) { fill_stream_normal(item, seed + offset + b, "verify"); };
  };
  c.input("x", Phase::kForward, DType::kBF16, {B, S, H}, per_item(B, normal(100)), 0);
  c.input("grad_out", Phase::kForward, DType::kBF16, {B, S, H}, per_item(B, normal(200)), 0);
  const auto made = std::make_shared<StandIns>();
  c.input("sublayer_out", Phase::kForward, DType::kBF16, {2 * L, B, S, H}, stand_ins(seed, B, false, made), 1);
  c.input("sublayer_grad", Phase::kForward, DType::kBF16, {2 * L, B, S, H}, stand_ins(seed, B, true, made), 1);
  c.output("out", Phase::kForward, DType::kBF16, {B, S, H}, 0);
  c.output("dx", Phase::kForward, DType::kBF16, {B, S, H}, 0);
  if (s.weight_grads) {
    c.output("d_timesteps", Phase::kForward, DType::kF32, {kChainTimesteps});
    for (const WeightInput& w : weights) c.output("d_" + w.name, Phase::kForward, w.dtype, w.shape);
  }
  const bool weight_grads = s.weight_grads;
  c.forward = [L, weight_grads](const Instance& t, Stream stream) {
    ChainParams p;
    std::vector<ChainBlockWeights> blocks;
    std::vector<ChainBlockGrads> block_grads;
    bind(t, L, weight_grads, &blocks, &block_grads, &p);
    p.timesteps = t["timesteps"];
    p.adaln_plan = t.plan("adaln");
    p.timestep_plan = t.plan("timestep");
    p.x = merged(t["x"], 0);
    p.sublayer_out = merged(t["sublayer_out"], 1);
    p.sublayer_grad = merged(t["sublayer_grad"], 1);
    p.grad_out = merged(t["grad_out"], 0);
    p.out = merged(t["out"], 0);
    p.grads.dx = merged(t["dx"], 0);
    return chain_forward_backward(p, stream);
  };
  c.positions = B;
  c.alone = [ctx, s](int64_t) {
    ChainShape one = s;
    one.batch = 1;
    one.weight_grads = false;
    return chain_case(ctx, one);
  };
  return c;
}

std::vector<OpCase> chain_cases(Suite suite, const CaseContext& ctx) {
  if (suite != Suite::kVerify) return {};
  ChainShape s;
  s.seq_len = ctx.quick ? 64 : 512;
  s.batch = 2;
  s.hidden = ctx.hidden;
  s.blocks = chain_blocks(ctx);
  return {chain_case(ctx, s)};
}

}  // namespace

DETDIT_OP_CASES("chain", chain_cases);

}  // namespace cases
}  // namespace detdit
