// timestep_mlp (docs/numerics.md 5.3, 6.3) on the CPU reference: FP64 accuracy
// at the H3 shape (256 -> 5376 -> 2688), composition from the public linear
// ops, row invariance, repeatability, optional outputs, validation.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "detdit/linear.h"
#include "detdit/timestep.h"

namespace detdit {
namespace testing {
namespace {

// The library's timestep_mlp case (FP32) at T rows, K -> H -> D, and the
// op's params from its views (the tests vary them).
struct Mlp : CpuCase {
  int64_t rows, in_features, hidden_size, out_features;
  Mlp(int64_t t, int64_t k, int64_t h, int64_t d, uint64_t seed,
      const std::map<std::string, HostTensor>* inputs = nullptr)
      : CpuCase(timestep_mlp_case({t, k, h, d, seed}), inputs), rows(t), in_features(k), hidden_size(h),
        out_features(d) {}
  TimestepMlpInputs inputs() const { return {view("features"), view("w1"), view("b1"), view("w2"), view("b2")}; }
  TimestepMlpParams forward() const { return {inputs(), view("temb"), view("pre"), view("hidden")}; }
  TimestepMlpBackwardParams backward() const {
    return {inputs(),       view("pre"),  view("hidden"), view("grad_temb"), view("d_features"),
            view("d_w1"), view("d_b1"), view("d_w2"),   view("d_b2")};
  }
};

TEST(TimestepMlpAccuracy, H3ShapeMatchesFp64) {
  Mlp m(4, 256, 5376, 2688, 1000);
  DETDIT_ASSERT_OK(m.run());
  // FP64 graph: pre = W1 f + b1, hidden = silu(pre), temb = W2 hidden + b2.
  const std::vector<double> f = to_doubles(m["features"]), w1 = to_doubles(m["w1"]), w2 = to_doubles(m["w2"]);
  const std::vector<double> pre = linear64(f, w1, to_doubles(m["b1"]), m.rows, m.in_features, m.hidden_size);
  std::vector<double> hidden(pre.size()), silu_grad(pre.size());
  for (std::size_t i = 0; i < pre.size(); ++i) {
    hidden[i] = silu64(pre[i]);
    silu_grad[i] = silu_derivative64(pre[i]);
  }
  const std::vector<double> temb = linear64(hidden, w2, to_doubles(m["b2"]), m.rows, m.hidden_size, m.out_features);
  std::printf("[ measured ] temb max|err|/max|ref| vs FP64: %.3g\n", relative_max_error(m["temb"], temb));
  EXPECT_LE(relative_max_error(m["temb"], temb), 1e-4);
  EXPECT_LE(relative_max_error(m["pre"], pre), 1e-4);
  EXPECT_LE(relative_max_error(m["hidden"], hidden), 1e-4);
  const std::vector<double> g = to_doubles(m["grad_temb"]);
  std::vector<double> d_pre = linear_d_x64(g, w2, m.rows, m.hidden_size, m.out_features);
  for (std::size_t i = 0; i < d_pre.size(); ++i) d_pre[i] *= silu_grad[i];
  EXPECT_LE(relative_max_error(m["d_w2"], linear_d_w64(g, hidden, m.rows, m.hidden_size, m.out_features)), 1e-4);
  EXPECT_LE(relative_max_error(m["d_b2"], linear_d_b64(g, m.rows, m.out_features)), 1e-4);
  EXPECT_LE(relative_max_error(m["d_w1"], linear_d_w64(d_pre, f, m.rows, m.in_features, m.hidden_size)), 1e-4);
  EXPECT_LE(relative_max_error(m["d_b1"], linear_d_b64(d_pre, m.rows, m.hidden_size)), 1e-4);
  EXPECT_LE(relative_max_error(m["d_features"], linear_d_x64(d_pre, w1, m.rows, m.in_features, m.hidden_size)), 1e-4);
}

// The MLP is the two public linear ops plus silu_backward, bit for bit.
TEST(TimestepMlpComposition, EqualsTheLinearOpsInSequence) {
  Mlp m(3, 32, 96, 40, 2000);
  DETDIT_ASSERT_OK(m.run());
  HostTensor pre(DType::kF32, {3, 96}), hidden(DType::kF32, {3, 96}), temb(DType::kF32, {3, 40});
  LinearParams first;
  first.x = m["features"].view();
  first.weight = m["w1"].view();
  first.bias = m["b1"].view();
  first.out = hidden.view();
  first.pre_activation = pre.view();
  first.activation = Activation::kSilu;
  DETDIT_ASSERT_OK(linear_forward(first));
  LinearParams second;
  second.x = hidden.view();
  second.weight = m["w2"].view();
  second.bias = m["b2"].view();
  second.out = temb.view();
  DETDIT_ASSERT_OK(linear_forward(second));
  EXPECT_BITWISE_EQ(pre, m["pre"]);
  EXPECT_BITWISE_EQ(hidden, m["hidden"]);
  EXPECT_BITWISE_EQ(temb, m["temb"]);
  HostTensor d_hidden(DType::kF32, {3, 96}), d_pre(DType::kF32, {3, 96}), d_features(DType::kF32, {3, 32});
  LinearBackwardInputParams back2;
  back2.grad = m["grad_temb"].view();
  back2.weight = m["w2"].view();
  back2.d_x = d_hidden.view();
  DETDIT_ASSERT_OK(linear_backward_input(back2));
  SiluBackwardParams silu;
  silu.grad = d_hidden.view();
  silu.pre = pre.view();
  silu.d_pre = d_pre.view();
  DETDIT_ASSERT_OK(silu_backward(silu));
  LinearBackwardInputParams back1;
  back1.grad = d_pre.view();
  back1.weight = m["w1"].view();
  back1.d_x = d_features.view();
  DETDIT_ASSERT_OK(linear_backward_input(back1));
  EXPECT_BITWISE_EQ(d_features, m["d_features"]);
}

TEST(TimestepMlpOptional, AbsentSavesAndPartialGradientsGiveTheSameBytes) {
  Mlp m(5, 32, 64, 48, 3000);
  DETDIT_ASSERT_OK(m.run());
  HostTensor temb(DType::kF32, {5, 48});
  TimestepMlpParams p = m.forward();
  p.temb = temb.view();
  p.pre = TensorView();
  p.hidden = TensorView();
  DETDIT_ASSERT_OK(timestep_mlp_forward(p));
  EXPECT_BITWISE_EQ(m["temb"], temb);
  // Only d_w2 / only d_w1 requested.
  HostTensor d_w2(DType::kF32, {48, 64}), d_w1(DType::kF32, {64, 32});
  TimestepMlpBackwardParams b = m.backward();
  b.d_features = b.d_w1 = b.d_b1 = b.d_b2 = TensorView();
  b.d_w2 = d_w2.view();
  DETDIT_ASSERT_OK(timestep_mlp_backward(b));
  EXPECT_BITWISE_EQ(m["d_w2"], d_w2);
  b.d_w2 = TensorView();
  b.d_w1 = d_w1.view();
  DETDIT_ASSERT_OK(timestep_mlp_backward(b));
  EXPECT_BITWISE_EQ(m["d_w1"], d_w1);
}

TEST(TimestepMlpInvariance, RowsAreBitwiseIndependentOfTheBatch) {
  const int64_t pool = 9;
  const Mlp reference(pool, 32, 64, 48, 4000);
  auto run = [&](const std::vector<int64_t>& members, HostTensor* temb, HostTensor* d_features) {
    const int64_t count = static_cast<int64_t>(members.size());
    std::map<std::string, HostTensor> inputs = reference.tensors();  // the same weights; rows replaced below
    inputs["features"] = HostTensor(DType::kF32, {count, 32});
    inputs["grad_temb"] = HostTensor(DType::kF32, {count, 48});
    for (int64_t j = 0; j < count; ++j) {
      copy_row(reference["features"], members[j], &inputs["features"], j);
      copy_row(reference["grad_temb"], members[j], &inputs["grad_temb"], j);
    }
    Mlp m(count, 32, 64, 48, 4000, &inputs);
    DETDIT_ASSERT_OK(m.run());
    *temb = m["temb"];
    *d_features = m["d_features"];
  };
  std::vector<HostTensor> alone_temb(pool), alone_d(pool);
  for (int64_t r = 0; r < pool; ++r) run({r}, &alone_temb[r], &alone_d[r]);
  for (int64_t batch = 1; batch <= pool; ++batch)
    for (int64_t rotation = 0; rotation < pool; ++rotation)
      for (bool reversed : {false, true}) {
        std::vector<int64_t> members;
        for (int64_t j = 0; j < batch; ++j) members.push_back((rotation + (reversed ? pool - j : j)) % pool);
        HostTensor temb, d_features;
        run(members, &temb, &d_features);
        for (int64_t j = 0; j < batch; ++j) {
          SCOPED_TRACE("batch " + std::to_string(batch) + " position " + std::to_string(j));
          ASSERT_TRUE(rows_bitwise_equal(alone_temb[members[j]], 0, temb, j));
          ASSERT_TRUE(rows_bitwise_equal(alone_d[members[j]], 0, d_features, j));
        }
      }
}

TEST(TimestepMlpRepeatability, TwoRunsGiveTheSameBytes) {
  EXPECT_TRUE(repeats_bitwise(timestep_mlp_case({4, 64, 128, 96, 5000})));
}

TEST(TimestepMlpValidation, ForwardRejectsBadArgumentsAndWritesNothing) {
  Mlp m(3, 32, 64, 48, 6000);
  const TensorView w1 = m.view("w1"), b1 = m.view("b1"), w2 = m.view("w2"), pre = m.view("pre"), hidden = m.view("hidden");
  HostTensor w1_bf16(DType::kBF16, {64, 32}), features_bf16(DType::kBF16, {3, 32}), wide(DType::kF32, {48 * 64 + 8});
  HostTensor odd_features(DType::kF32, {3, 30}), odd_w1(DType::kF32, {64, 30});
  struct Case {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(TimestepMlpParams*)> edit;
  };
  const std::vector<Case> cases = {
      {"bf16 w1", ErrorKind::kType, "w1 must be float32 like features (one MLP runs in one dtype), got bfloat16",
       [&](auto* p) { p->in.w1 = w1_bf16.view(); }},
      {"bf16 features", ErrorKind::kType, "w1 must be bfloat16 like features (one MLP runs in one dtype), got float32",
       [&](auto* p) { p->in.features = features_bf16.view(); }},
      {"w1 K mismatch", ErrorKind::kValue, "w1 must be (H, K)", [&](auto* p) { p->in.w1 = w1.reshaped({128, 16}); }},
      {"b1 shape", ErrorKind::kValue, "b1 must be (H,)", [&](auto* p) { p->in.b1 = b1.reshaped({32}); }},
      {"w2 shape", ErrorKind::kValue, "w2 must be (D, H)", [&](auto* p) { p->in.w2 = w2.reshaped({96, 32}); }},
      {"b2 shape", ErrorKind::kValue, "b2 must be (D,)", [&](auto* p) { p->in.b2 = m.view("b2").reshaped({24}); }},
      {"temb shape", ErrorKind::kValue, "temb must be (T, D)", [&](auto* p) { p->temb = m.view("temb").reshaped({48, 3}); }},
      {"features 1-D", ErrorKind::kValue, "features must be (T, K)", [&](auto* p) { p->in.features = m.view("features").reshaped({96}); }},
      {"zero rows", ErrorKind::kValue, "features must be a non-empty (T, K) matrix", [&](auto* p) {
         p->in.features = m.view("features").reshaped({0, 32});
         p->temb = m.view("temb").reshaped({0, 48});
         p->pre = pre.reshaped({0, 64});
         p->hidden = hidden.reshaped({0, 64});
       }},
      {"K not a multiple of 4", ErrorKind::kValue, "16-byte vector load", [&](auto* p) {
         p->in.features = odd_features.view();
         p->in.w1 = odd_w1.view();
       }},
      // H % 4 != 0 fails only in the second linear: checked before the first writes.
      {"H not a multiple of 4", ErrorKind::kValue, "H = w1.shape[0] = 62", [&](auto* p) {
         p->in.w1 = w1.reshaped({62, 32});
         p->in.b1 = b1.reshaped({62});
         p->in.w2 = w2.reshaped({48, 62});
         p->pre = pre.reshaped({3, 62});
         p->hidden = hidden.reshaped({3, 62});
       }},
      {"misaligned w2", ErrorKind::kValue, "16-byte aligned", [&](auto* p) {
         p->in.w2 = TensorView::contiguous(wide.ptr<float>() + 1, DType::kF32, {48, 64});
       }},
      {"non-contiguous w1", ErrorKind::kValue, "w1 must be contiguous", [&](auto* p) {
         p->in.w1 = TensorView::strided(w1.data, DType::kF32, {32, 32}, {64, 1});
         p->in.b1 = b1.reshaped({32});
         p->in.w2 = w2.reshaped({96, 32});
         p->pre = pre.reshaped({6, 32});
       }},
      {"pre on another device", ErrorKind::kValue, "pre is on cuda:0", [&](auto* p) { p->pre.device = Device::cuda(0); }},
      {"temb aliases w1", ErrorKind::kValue, "must not overlap", [&](auto* p) {
         p->temb = TensorView::contiguous(w1.data, DType::kF32, {3, 48});
       }},
      {"torch numerics on the CPU", ErrorKind::kValue, "CUDA only", [&](auto* p) { p->in.numerics = Numerics::kTorch; }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    const HostTensor w1_before = m.current("w1");
    TimestepMlpParams p = m.forward();
    bad.edit(&p);
    Status s = timestep_mlp_forward(p);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    HostTensor temb_now = m.current("temb"), pre_now = m.current("pre"), hidden_now = m.current("hidden");
    EXPECT_TRUE(still_canary({&temb_now, &pre_now, &hidden_now}));
    EXPECT_BITWISE_EQ(w1_before, m.current("w1"));
  }
  DETDIT_EXPECT_OK(timestep_mlp_forward(m.forward()));
}

TEST(TimestepMlpValidation, BackwardRejectsBadArgumentsAndWritesNothing) {
  Mlp m(3, 32, 64, 48, 7000);
  DETDIT_ASSERT_OK(timestep_mlp_forward(m.forward()));
  HostTensor grad_bf16(DType::kBF16, {3, 48});
  struct Case {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(TimestepMlpBackwardParams*)> edit;
  };
  const std::vector<Case> cases = {
      {"bf16 grad_temb", ErrorKind::kType, "grad_temb must be float32 like features (one MLP runs in one dtype), got bfloat16",
       [&](auto* p) { p->grad_temb = grad_bf16.view(); }},
      {"pre missing", ErrorKind::kValue, "pre is required", [&](auto* p) { p->pre = TensorView(); }},
      {"d_w1 shape", ErrorKind::kValue, "d_w1 must be (H, K)", [&](auto* p) { p->d_w1 = m.view("d_w1").reshaped({32, 64}); }},
      {"d_b2 dtype", ErrorKind::kType, "d_b2 must be float32", [&](auto* p) { p->d_b2.dtype = DType::kBF16; }},
      {"hidden shape", ErrorKind::kValue, "hidden must be (T, H)", [&](auto* p) { p->hidden = m.view("hidden").reshaped({64, 3}); }},
      {"d_w2 aliases d_w1", ErrorKind::kValue, "must not overlap", [&](auto* p) {
         p->d_w2 = TensorView::contiguous(m.view("d_w1").data, DType::kF32, {48, 64});
       }},
      {"torch numerics on the CPU", ErrorKind::kValue, "CUDA only", [&](auto* p) { p->in.numerics = Numerics::kTorch; }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    TimestepMlpBackwardParams p = m.backward();
    bad.edit(&p);
    Status s = timestep_mlp_backward(p);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    std::vector<HostTensor> grads;
    for (const char* name : {"d_features", "d_w1", "d_b1", "d_w2", "d_b2"}) grads.push_back(m.current(name));
    EXPECT_TRUE(still_canary({&grads[0], &grads[1], &grads[2], &grads[3], &grads[4]}));
  }
  DETDIT_EXPECT_OK(timestep_mlp_backward(m.backward()));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
