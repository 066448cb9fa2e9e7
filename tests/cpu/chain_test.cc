// The conditioning chain (include/detdit/chain.h) on the CPU: every output
// and gradient repeats bitwise; row-local results (out, dx) are invariant to
// the batch; the fused-chain AdaLN W/b gradients are >= 99.5 % correctly
// rounded against an FP64 chain written here (rounding where the model stores
// bf16 values, forward and backward: hidden states, tables, the stored dx of
// each norm and the stored sum of the two gradient paths; straight-through
// derivatives); bad inputs fail closed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "support/cases.h"
#include "support/chain_fixture.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "detdit/chain.h"

namespace detdit {
namespace testing {
namespace {

constexpr int64_t kHidden = 12, kFrequencies = 32, kMlpHidden = 64, kEmbed = 64, kBlocks = 2;

// The chain at these sizes (ChainShape's defaults), two blocks.
using Chain = ChainProblem;

TEST(Chain, EveryOutputAndGradientRepeatsBitwise) {
  IndexCase c = testing::make_index_case(Packing::kInterleaved, 257, 3, 2);
  Chain a(c), b(c);
  DETDIT_ASSERT_OK(chain_forward_backward(a.params()));
  DETDIT_ASSERT_OK(chain_forward_backward(b.params()));
  for (std::size_t i = 0; i < a.outputs().size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_BITWISE_EQ(*a.outputs()[i], *b.outputs()[i]);
    EXPECT_FALSE(testing::all_bytes_are(*a.outputs()[i], kCanary));  // every output was written
  }
}

// out and dx of batch item 0 equal the same sequence run alone (B = 1).
TEST(Chain, RowLocalResultsAreInvariantToTheBatch) {
  for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
    IndexCase batched = testing::make_index_case(packing, 257, 3, 2), alone = testing::make_index_case(packing, 257, 3, 1);
    Chain big(batched), one(alone);
    const std::size_t rows_bytes = 257 * kHidden * 2;
    std::memcpy(one.x.data(), big.x.data(), rows_bytes);
    std::memcpy(one.grad_out.data(), big.grad_out.data(), rows_bytes);
    for (int64_t k = 0; k < 2 * kBlocks; ++k) {
      std::memcpy(static_cast<char*>(one.sub_out.data()) + k * rows_bytes,
                  static_cast<char*>(big.sub_out.data()) + 2 * k * rows_bytes, rows_bytes);
      std::memcpy(static_cast<char*>(one.sub_grad.data()) + k * rows_bytes,
                  static_cast<char*>(big.sub_grad.data()) + 2 * k * rows_bytes, rows_bytes);
    }
    DETDIT_ASSERT_OK(chain_forward_backward(big.params()));
    DETDIT_ASSERT_OK(chain_forward_backward(one.params()));
    EXPECT_TRUE(testing::bitwise_equal_bytes(big.out.data(), one.out.data(), 257 * kHidden, DType::kBF16));
    EXPECT_TRUE(testing::bitwise_equal_bytes(big.dx.data(), one.dx.data(), 257 * kHidden, DType::kBF16));
  }
}

// ---- FP64 chain -------------------------------------------------------------

double silu(double z) { return z / (1.0 + std::exp(-z)); }

TEST(Chain, AdalnWeightGradientsAreCorrectlyRoundedAgainstFp64) {
  for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
    IndexCase c = testing::make_index_case(packing, 4097, 3, 1);
    SCOPED_TRACE(c.name());
    Chain k(c);
    DETDIT_ASSERT_OK(chain_forward_backward(k.params()));
    const int64_t T = c.num_timesteps, M = c.positions(), H = kHidden, half = kFrequencies / 2;
    // timestep path in FP64 (FP32 model: no storage rounding)
    std::vector<double> features(T * kFrequencies), pre(T * kMlpHidden), temb(T * kEmbed, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < half; ++j) {
        const double arg = k.timesteps.get(t) * std::exp(-std::log(10000.0) * j / half);
        features[t * kFrequencies + j] = std::cos(arg);
        features[t * kFrequencies + half + j] = std::sin(arg);
      }
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t n = 0; n < kMlpHidden; ++n) {
        double acc = k.b1.get(n);
        for (int64_t j = 0; j < kFrequencies; ++j) acc += k.w1.get(n * kFrequencies + j) * features[t * kFrequencies + j];
        pre[t * kMlpHidden + n] = acc;
      }
      for (int64_t d = 0; d < kEmbed; ++d) {
        double acc = k.b2.get(d);
        for (int64_t n = 0; n < kMlpHidden; ++n) acc += k.w2.get(d * kMlpHidden + n) * silu(pre[t * kMlpHidden + n]);
        temb[t * kEmbed + d] = acc;
      }
    }
    HostTensor temb_t(DType::kF32, {T, kEmbed});
    for (int64_t i = 0; i < T * kEmbed; ++i) temb_t.set(i, temb[i]);  // the reference's temb, as the projections see it
    auto chunk_tensor = [&](const std::vector<double>& table, int64_t width, int64_t rows_per_t, int64_t col) {
      HostTensor out(DType::kBF16, {T * rows_per_t, H});
      for (int64_t r = 0; r < T * rows_per_t; ++r)
        for (int64_t i = 0; i < H; ++i) out.set(r * H + i, table[r * (width / rows_per_t) + col + i]);
      return out;
    };
    const std::vector<int64_t> adaln_rows = testing::adaln_rows_of_positions(c), t_rows = testing::timestep_rows_of_positions(c);
    // forward, storing bf16 where the model does
    std::vector<HostTensor> xs = {testing::clone(k.x)}, mids;
    std::vector<std::vector<HostTensor>> mods(kBlocks);
    for (int64_t l = 0; l < kBlocks; ++l) {
      const testing::ProjectionReference proj =
          testing::projection_reference(temb_t, k.adaln_w[l], k.adaln_b[l], nullptr, DType::kBF16);
      for (int ch = 0; ch < 6; ++ch) mods[l].push_back(chunk_tensor(proj.table, 18 * H, 3, ch * H));
      auto residual = [&](const HostTensor& x_in, int64_t sub, const HostTensor& gate) {
        HostTensor x_out(DType::kBF16, {M, H});
        for (int64_t p = 0; p < M; ++p)
          for (int64_t i = 0; i < H; ++i) {
            const double gy = testing::correctly_rounded(gate.get(adaln_rows[p] * H + i) * k.sub_out.get((sub * M + p) * H + i), DType::kBF16);
            x_out.set(p * H + i, testing::correctly_rounded(x_in.get(p * H + i) + gy, DType::kBF16));
          }
        return x_out;
      };
      mids.push_back(residual(xs.back(), 2 * l, mods[l][2]));
      xs.push_back(residual(mids.back(), 2 * l + 1, mods[l][5]));
    }
    // backward: exact arithmetic, hidden-state gradients stored in bf16 as the model stores them
    auto stored = [](double v) { return testing::correctly_rounded(v, DType::kBF16); };
    const testing::ProjectionReference final_proj = testing::projection_reference(temb_t, k.out_w, k.out_b, nullptr, DType::kBF16);
    HostTensor final_shift = chunk_tensor(final_proj.table, 2 * H, 1, 0), final_scale = chunk_tensor(final_proj.table, 2 * H, 1, H);
    const testing::RmsnormReference fin = testing::rmsnorm_reference(xs.back(), k.norm_out, &final_shift, &final_scale, t_rows, T,
                                                                     k.grad_out, 1e-5, DType::kBF16);
    std::vector<double> g(M * H);
    for (int64_t e = 0; e < M * H; ++e) g[e] = stored(fin.dx[e]);
    for (int64_t l = kBlocks - 1; l >= 0; --l) {
      std::vector<double> d_table(T * 18 * H, 0.0);  // (T, 18H) = (3T, 6H)
      auto put = [&](int ch, int64_t r, int64_t i, double v) { d_table[r * 6 * H + ch * H + i] += v; };
      for (int half_block = 1; half_block >= 0; --half_block) {
        const int64_t sub = 2 * l + half_block;
        const HostTensor& x_in = half_block ? mids[l] : xs[l];
        const int gate_ch = half_block ? 5 : 2, shift_ch = half_block ? 3 : 0;
        for (int64_t p = 0; p < M; ++p)
          for (int64_t i = 0; i < H; ++i) put(gate_ch, adaln_rows[p], i, g[p * H + i] * k.sub_out.get((sub * M + p) * H + i));
        HostTensor sub_grad(DType::kBF16, {M, H});
        std::memcpy(sub_grad.data(), static_cast<char*>(k.sub_grad.data()) + sub * M * H * 2, M * H * 2);
        const testing::RmsnormReference nr = testing::rmsnorm_reference(
            x_in, half_block ? k.norm2[l] : k.norm1[l], &mods[l][shift_ch], &mods[l][shift_ch + 1], adaln_rows, 3 * T, sub_grad, 1e-5,
            DType::kBF16);
        for (int64_t r = 0; r < 3 * T; ++r)
          for (int64_t i = 0; i < H; ++i) {
            put(shift_ch, r, i, nr.d_shift[r * H + i]);
            put(shift_ch + 1, r, i, nr.d_scale[r * H + i]);
          }
        for (int64_t e = 0; e < M * H; ++e) g[e] = stored(g[e] + stored(nr.dx[e]));
      }
      const testing::ProjectionReference proj =
          testing::projection_reference(temb_t, k.adaln_w[l], k.adaln_b[l], &d_table, DType::kBF16);
      const double dw = testing::fraction_correctly_rounded(k.d_adaln_w[l], proj.d_weight);
      const double db = testing::fraction_correctly_rounded(k.d_adaln_b[l], proj.d_bias);
      std::printf("%s block %lld: AdaLN dW %.3f %%, db %.3f %% correctly rounded\n", c.name().c_str(),
                  static_cast<long long>(l), 100 * dw, 100 * db);
      EXPECT_GE(dw, 0.995) << "block " << l;
      EXPECT_GE(db, 0.995) << "block " << l;
    }
  }
}

TEST(Chain, BadInputsGetClearErrorsAndWriteNothing) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 16, 2, 2);
  IndexPlan sharded = testing::adaln_plan(testing::make_index_case(Packing::kBlock, 8, 2, 2));
  Chain k(c);
  struct Case {
    const char* message;
    std::function<void(ChainParams*)> mutate;
  };
  const Case cases[] = {
      {"x must be (B*S, H) rows with S = plan.seq_len() = 8", [&](ChainParams* p) { p->adaln_plan = sharded; }},
      {"timestep_plan must index the same (B, S)", [&](ChainParams* p) { p->timestep_plan = p->adaln_plan; }},
      {"sublayer_out must be (2L, B*S, H) = (4, 32, 12)", [](ChainParams* p) { p->sublayer_out.shape[0] = 3; }},
      {"timesteps must be (T,) with T = timestep_plan.num_rows() = 2", [](ChainParams* p) { p->timesteps.shape[0] = 3; }},
      {"weights.blocks must hold num_blocks = 2", [](ChainParams* p) { p->weights.blocks = nullptr; }},
      {"chain_forward_backward runs on CPU tensors", [](ChainParams* p) { p->x.device = Device::cuda(0); }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.message);
    ChainParams p = k.params();
    bad.mutate(&p);
    EXPECT_TRUE(testing::refused(chain_forward_backward(p), ErrorKind::kValue, bad.message));
    EXPECT_TRUE(testing::still_canary(k.outputs()));
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
