// The chain's up-front validation (src/chain.cc): a gradient output of the
// wrong shape, dtype or device, or any tensor on another device, fails before
// the chain writes anything (the op that would reject it runs after others
// have written out, dx and earlier gradients), with the argument's name.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "detdit/chain.h"

namespace detdit {
namespace {

using testing::HostTensor;
using testing::kCanary;
using testing::random_tensor;

constexpr int64_t kHidden = 12, kFrequencies = 16, kMlpHidden = 32, kEmbed = 24;

// One block, T = 2, S = 16, B = 1, bf16 activations; every output a canary.
struct SmallChain {
  testing::IndexCase c = testing::make_index_case(testing::Packing::kBlock, 16, 2, 1);
  HostTensor timesteps{DType::kF32, {2}};
  HostTensor w1 = random_tensor(DType::kF32, {kMlpHidden, kFrequencies}, 1, 0, 0.2);
  HostTensor b1 = random_tensor(DType::kF32, {kMlpHidden}, 2, 0, 0.1);
  HostTensor w2 = random_tensor(DType::kF32, {kEmbed, kMlpHidden}, 3, 0, 0.2);
  HostTensor b2 = random_tensor(DType::kF32, {kEmbed}, 4, 0, 0.1);
  HostTensor norm_out = random_tensor(DType::kBF16, {kHidden}, 5, 1, 0.1);
  HostTensor out_w = random_tensor(DType::kBF16, {2 * kHidden, kEmbed}, 6, 0, 0.1);
  HostTensor out_b = random_tensor(DType::kBF16, {2 * kHidden}, 7, 0, 0.1);
  HostTensor adaln_w = random_tensor(DType::kBF16, {18 * kHidden, kEmbed}, 8, 0, 0.1);
  HostTensor adaln_b = random_tensor(DType::kBF16, {18 * kHidden}, 9, 0, 0.1);
  HostTensor norm1 = random_tensor(DType::kBF16, {kHidden}, 10, 1, 0.1);
  HostTensor norm2 = random_tensor(DType::kBF16, {kHidden}, 11, 1, 0.1);
  HostTensor x = random_tensor(DType::kBF16, {16, kHidden}, 12);
  HostTensor grad_out = random_tensor(DType::kBF16, {16, kHidden}, 13);
  HostTensor sub_out = random_tensor(DType::kBF16, {2, 16, kHidden}, 14);
  HostTensor sub_grad = random_tensor(DType::kBF16, {2, 16, kHidden}, 15);
  HostTensor out{DType::kBF16, {16, kHidden}}, dx{DType::kBF16, {16, kHidden}}, d_t{DType::kF32, {2}};
  HostTensor d_w1{DType::kF32, {kMlpHidden, kFrequencies}}, d_b1{DType::kF32, {kMlpHidden}};
  HostTensor d_w2{DType::kF32, {kEmbed, kMlpHidden}}, d_b2{DType::kF32, {kEmbed}};
  HostTensor d_norm_out{DType::kF32, {kHidden}}, d_out_w{DType::kBF16, {2 * kHidden, kEmbed}};
  HostTensor d_out_b{DType::kBF16, {2 * kHidden}}, d_adaln_w{DType::kBF16, {18 * kHidden, kEmbed}};
  HostTensor d_adaln_b{DType::kBF16, {18 * kHidden}}, d_norm1{DType::kF32, {kHidden}}, d_norm2{DType::kBF16, {kHidden}};
  ChainBlockWeights block_weights;
  ChainBlockGrads block_grads;

  SmallChain() {
    timesteps.set(0, 0.25);
    timesteps.set(1, 0.75);
    block_weights = {adaln_w.view(), adaln_b.view(), norm1.view(), norm2.view()};
    block_grads = {d_adaln_w.view(), d_adaln_b.view(), d_norm1.view(), d_norm2.view()};
    for (HostTensor* t : outputs()) t->fill_bytes(kCanary);
  }
  std::vector<HostTensor*> outputs() {
    return {&out, &dx, &d_t, &d_w1, &d_b1, &d_w2, &d_b2, &d_norm_out, &d_out_w, &d_out_b,
            &d_adaln_w, &d_adaln_b, &d_norm1, &d_norm2};
  }
  ChainParams params() const {
    ChainParams p;
    p.weights = {w1.view(), b1.view(), w2.view(), b2.view(), &block_weights, 1, norm_out.view(), out_w.view(), out_b.view()};
    p.timesteps = timesteps.view();
    p.adaln_plan = testing::adaln_plan(c);
    p.timestep_plan = testing::timestep_plan(c);
    p.x = x.view();
    p.sublayer_out = sub_out.view();
    p.sublayer_grad = sub_grad.view();
    p.grad_out = grad_out.view();
    p.out = out.view();
    p.grads = {d_t.view(), d_w1.view(), d_b1.view(), d_w2.view(), d_b2.view(), &block_grads,
               d_norm_out.view(), d_out_w.view(), d_out_b.view(), dx.view()};
    return p;
  }
};

TEST(ChainFailClosed, ValidParamsRunAndWriteEveryOutput) {
  SmallChain k;
  DETDIT_ASSERT_OK(chain_forward_backward(k.params()));
  for (HostTensor* t : k.outputs()) EXPECT_FALSE(testing::all_bytes_are(*t, kCanary));
}

TEST(ChainFailClosed, BadGradientsAndMixedDevicesWriteNothing) {
  struct Case {
    ErrorKind kind;
    const char* message;
    std::function<void(SmallChain*, ChainParams*)> mutate;
  };
  const Case cases[] = {
      {ErrorKind::kValue, "grads.d_out_weight must be shaped like its weight",
       [](SmallChain*, ChainParams* p) { p->grads.d_out_weight.shape[1] = kEmbed - 8; }},
      {ErrorKind::kType, "grads.blocks[0].d_adaln_weight must be bfloat16, got float32",
       [](SmallChain* k, ChainParams*) { k->block_grads.d_adaln_weight.dtype = DType::kF32; }},
      {ErrorKind::kValue, "grads.blocks[0].d_norm2_weight must be shaped like its weight",
       [](SmallChain* k, ChainParams*) { k->block_grads.d_norm2_weight.shape[0] = kHidden - 4; }},
      {ErrorKind::kType, "grads.d_mlp_b2 must be float32, got bfloat16",
       [](SmallChain*, ChainParams* p) { p->grads.d_mlp_b2.dtype = DType::kBF16; }},
      {ErrorKind::kValue, "got x on cpu and grads.blocks[0].d_norm1_weight on cuda:0",
       [](SmallChain* k, ChainParams*) { k->block_grads.d_norm1_weight.device = Device::cuda(0); }},
      {ErrorKind::kValue, "got x on cpu and weights.out_bias on cuda:0",
       [](SmallChain*, ChainParams* p) { p->weights.out_bias.device = Device::cuda(0); }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.message);
    SmallChain k;
    ChainParams p = k.params();
    bad.mutate(&k, &p);
    EXPECT_TRUE(testing::refused(chain_forward_backward(p), bad.kind, bad.message));
    EXPECT_TRUE(testing::still_canary(k.outputs()));
  }
}

}  // namespace
}  // namespace detdit
