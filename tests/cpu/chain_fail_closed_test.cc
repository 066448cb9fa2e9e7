// The chain's up-front validation (src/chain.cc): a gradient output of the
// wrong shape, dtype or device, or any tensor on another device, fails before
// the chain writes anything (the op that would reject it runs after others
// have written out, dx and earlier gradients), with the argument's name.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "support/cases.h"
#include "support/chain_fixture.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "detdit/chain.h"

namespace detdit {
namespace testing {
namespace {

constexpr int64_t kHidden = 12, kFrequencies = 16, kMlpHidden = 32, kEmbed = 24;

// One block, T = 2, S = 16, B = 1, bf16 activations, d_norm2 in bf16; every output a canary.
struct SmallChain : ChainProblem {
  SmallChain()
      : ChainProblem(make_index_case(Packing::kBlock, 16, 2, 1),
                     {kHidden, kFrequencies, kMlpHidden, kEmbed, 1, DType::kBF16}) {}
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
       [](SmallChain* k, ChainParams*) { k->block_grads[0].d_adaln_weight.dtype = DType::kF32; }},
      {ErrorKind::kValue, "grads.blocks[0].d_norm2_weight must be shaped like its weight",
       [](SmallChain* k, ChainParams*) { k->block_grads[0].d_norm2_weight.shape[0] = kHidden - 4; }},
      {ErrorKind::kType, "grads.d_mlp_b2 must be float32, got bfloat16",
       [](SmallChain*, ChainParams* p) { p->grads.d_mlp_b2.dtype = DType::kBF16; }},
      {ErrorKind::kValue, "got x on cpu and grads.blocks[0].d_norm1_weight on cuda:0",
       [](SmallChain* k, ChainParams*) { k->block_grads[0].d_norm1_weight.device = Device::cuda(0); }},
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
}  // namespace testing
}  // namespace detdit
