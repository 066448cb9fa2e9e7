// The conditioning chain's problem for the CPU tests (the op-case library
// has no chain case): the FP32 timestep MLP's weights, bf16 AdaLN
// projections, norm weights and activations (random_tensor, from one seed),
// the seeded sublayer stand-ins (chain_stand_ins), and every output and
// gradient a canary. Header-only, so every suite can use it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "support/cases.h"
#include "support/test_util.h"
#include "detdit/chain.h"

namespace detdit {
namespace testing {

struct ChainShape {
  int64_t hidden = 12, frequencies = 32, mlp_hidden = 64, embed = 64, blocks = 2;
  DType d_norm2_dtype = DType::kF32;  // the chain takes the norm gradients in fp32 or bf16
};

struct ChainProblem {
  IndexCase c;
  ChainShape shape;
  HostTensor timesteps, w1, b1, w2, b2, norm_out, out_w, out_b;
  std::vector<HostTensor> adaln_w, adaln_b, norm1, norm2;
  HostTensor x, sub_out, sub_grad, grad_out, out, dx, d_t, d_w1, d_b1, d_w2, d_b2, d_norm_out, d_out_w, d_out_b;
  std::vector<HostTensor> d_adaln_w, d_adaln_b, d_norm1, d_norm2;
  std::vector<ChainBlockWeights> block_weights;
  std::vector<ChainBlockGrads> block_grads;

  explicit ChainProblem(const IndexCase& index, const ChainShape& s = {}, uint64_t seed = 11)
      : c(index), shape(s), timesteps(DType::kF32, {index.num_timesteps}),
        w1(random_tensor(DType::kF32, {s.mlp_hidden, s.frequencies}, seed, 0, 0.2)),
        b1(random_tensor(DType::kF32, {s.mlp_hidden}, seed + 1, 0, 0.1)),
        w2(random_tensor(DType::kF32, {s.embed, s.mlp_hidden}, seed + 2, 0, 0.2)),
        b2(random_tensor(DType::kF32, {s.embed}, seed + 3, 0, 0.1)),
        norm_out(random_tensor(DType::kBF16, {s.hidden}, seed + 4, 1, 0.1)),
        out_w(random_tensor(DType::kBF16, {2 * s.hidden, s.embed}, seed + 5, 0, 0.1)),
        out_b(random_tensor(DType::kBF16, {2 * s.hidden}, seed + 6, 0, 0.1)),
        x(random_tensor(DType::kBF16, {index.positions(), s.hidden}, seed + 7)),
        sub_out(DType::kBF16, {2 * s.blocks, index.positions(), s.hidden}),
        sub_grad(DType::kBF16, {2 * s.blocks, index.positions(), s.hidden}),
        grad_out(random_tensor(DType::kBF16, {index.positions(), s.hidden}, seed + 8)),
        out(DType::kBF16, {index.positions(), s.hidden}), dx(DType::kBF16, {index.positions(), s.hidden}),
        d_t(DType::kF32, {index.num_timesteps}), d_w1(DType::kF32, {s.mlp_hidden, s.frequencies}),
        d_b1(DType::kF32, {s.mlp_hidden}), d_w2(DType::kF32, {s.embed, s.mlp_hidden}), d_b2(DType::kF32, {s.embed}),
        d_norm_out(DType::kF32, {s.hidden}), d_out_w(DType::kBF16, {2 * s.hidden, s.embed}),
        d_out_b(DType::kBF16, {2 * s.hidden}) {
    for (int64_t t = 0; t < index.num_timesteps; ++t) timesteps.set(t, (t + 1.0) / (index.num_timesteps + 1.0));
    for (int64_t l = 0; l < s.blocks; ++l) {
      adaln_w.push_back(random_tensor(DType::kBF16, {18 * s.hidden, s.embed}, seed + 20 + l, 0, 0.1));
      adaln_b.push_back(random_tensor(DType::kBF16, {18 * s.hidden}, seed + 30 + l, 0, 0.1));
      norm1.push_back(random_tensor(DType::kBF16, {s.hidden}, seed + 40 + l, 1, 0.1));
      norm2.push_back(random_tensor(DType::kBF16, {s.hidden}, seed + 50 + l, 1, 0.1));
      d_adaln_w.emplace_back(DType::kBF16, std::vector<int64_t>{18 * s.hidden, s.embed});
      d_adaln_b.emplace_back(DType::kBF16, std::vector<int64_t>{18 * s.hidden});
      d_norm1.emplace_back(DType::kF32, std::vector<int64_t>{s.hidden});
      d_norm2.emplace_back(s.d_norm2_dtype, std::vector<int64_t>{s.hidden});
    }
    for (int64_t l = 0; l < s.blocks; ++l) {
      block_weights.push_back({adaln_w[l].view(), adaln_b[l].view(), norm1[l].view(), norm2[l].view()});
      block_grads.push_back({d_adaln_w[l].view(), d_adaln_b[l].view(), d_norm1[l].view(), d_norm2[l].view()});
    }
    Status st = chain_stand_ins(seed + 9, sub_out.view(), sub_grad.view());
    EXPECT_TRUE(st.ok()) << st.to_string();
    for (HostTensor* t : outputs()) t->fill_bytes(kCanary);
  }
  std::vector<HostTensor*> outputs() {
    std::vector<HostTensor*> all = {&out, &dx, &d_t, &d_w1, &d_b1, &d_w2, &d_b2, &d_norm_out, &d_out_w, &d_out_b};
    for (int64_t l = 0; l < shape.blocks; ++l)
      for (HostTensor* t : {&d_adaln_w[l], &d_adaln_b[l], &d_norm1[l], &d_norm2[l]}) all.push_back(t);
    return all;
  }
  ChainParams params() const {
    ChainParams p;
    p.weights = {w1.view(), b1.view(), w2.view(), b2.view(), block_weights.data(), shape.blocks,
                 norm_out.view(), out_w.view(), out_b.view()};
    p.timesteps = timesteps.view();
    p.adaln_plan = adaln_plan(c);
    p.timestep_plan = timestep_plan(c);
    p.x = x.view();
    p.sublayer_out = sub_out.view();
    p.sublayer_grad = sub_grad.view();
    p.grad_out = grad_out.view();
    p.out = out.view();
    p.grads = {d_t.view(), d_w1.view(), d_b1.view(), d_w2.view(), d_b2.view(), block_grads.data(),
               d_norm_out.view(), d_out_w.view(), d_out_b.view(), dx.view()};
    return p;
  }
};

}  // namespace testing
}  // namespace detdit
