// The families' timestep embeddings in the activation dtype on the CPU
// reference (docs/numerics.md 5.3, 6.3): timestep_mlp in bf16 at eager's
// rounding points, built from the public linear op; its gradients against
// the FP64 oracle (cases/oracle.h); combined_timestep_embedding equal to its
// MLPs and the rounded adds, forward and backward; fp16 and mixed dtypes
// refused; nothing written on error.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "cases/case_builders.h"
#include "cases/oracle.h"
#include "support/cases.h"
#include "support/test_util.h"
#include "detdit/linear.h"
#include "detdit/timestep.h"

namespace detdit {
namespace testing {
namespace {

using cases::EmbeddingShape;
using cases::MlpShape;

OpCase bf16_mlp_case(int64_t rows, int64_t k, int64_t h, int64_t d, uint64_t seed) {
  MlpShape s{rows, k, h, d, seed};
  s.dtype = DType::kBF16;
  return cases::timestep_mlp_case(s);
}

// pre = R(linear(f, W1, b1)) and temb = R(linear(hidden, W2, b2)) are the
// public linear with a bf16 out, bit for bit; hidden is R(silu(pre)) with the
// SiLU read from the rounded pre: every element the correctly rounded
// silu(pre) of FP64 here (an FP32 SiLU a few ulps off could flip one only at
// a bf16 tie, which these inputs do not reach), where a SiLU of the unrounded
// pre differs from it in many.
TEST(TimestepMlpBf16, RoundsWhereEagerRounds) {
  CpuCase m(bf16_mlp_case(3, 32, 48, 40, 5100));
  DETDIT_ASSERT_OK(m.run());
  HostTensor pre(DType::kBF16, {3, 48}), temb(DType::kBF16, {3, 40});
  LinearParams first;
  first.x = m["features"].view();
  first.weight = m["w1"].view();
  first.bias = m["b1"].view();
  first.out = pre.view();
  DETDIT_ASSERT_OK(linear_forward(first));
  EXPECT_BITWISE_EQ(pre, m["pre"]);
  const HostTensor& hidden = m["hidden"];
  int64_t differ_unrounded = 0;
  HostTensor pre_f32(DType::kF32, {3, 48});
  first.out = pre_f32.view();
  DETDIT_ASSERT_OK(linear_forward(first));
  for (int64_t i = 0; i < hidden.numel(); ++i) {
    EXPECT_EQ(hidden.get(i), cases::correctly_rounded(cases::silu64(pre.get(i)), DType::kBF16)) << "element " << i;
    differ_unrounded += hidden.get(i) != cases::correctly_rounded(cases::silu64(pre_f32.get(i)), DType::kBF16);
  }
  EXPECT_GT(differ_unrounded, 0) << "the inputs do not tell the two rounding points apart";
  LinearParams second;
  second.x = hidden.view();
  second.weight = m["w2"].view();
  second.bias = m["b2"].view();
  second.out = temb.view();
  DETDIT_ASSERT_OK(linear_forward(second));
  EXPECT_BITWISE_EQ(temb, m["temb"]);
}

// Every gradient (bf16, rounded once) against FP64 straight through the
// roundings, from the run's pre and hidden.
TEST(TimestepMlpBf16, GradientsMatchFp64) {
  CpuCase m(bf16_mlp_case(4, 64, 96, 80, 5200));
  DETDIT_ASSERT_OK(m.run());
  const cases::MlpReference r =
      cases::mlp_case_reference(m.tensors(), cases::mlp_case_names("features", "temb", ""), true);
  for (const auto& [name, ref] : std::vector<std::pair<std::string, const std::vector<double>*>>{
           {"d_features", &r.d_x}, {"d_w1", &r.d_w1}, {"d_b1", &r.d_b1}, {"d_w2", &r.d_w2}, {"d_b2", &r.d_b2}}) {
    const double err = cases::relative_max_error(m[name], *ref);
    EXPECT_LE(err, 1e-2) << name;
    EXPECT_GT(err, 0) << name << " equals FP64 exactly: the check cannot tell a rounding";
  }
}

// An fp32 grad_temb and fp32 gradient outputs are allowed: the same FP32
// arithmetic, each output rounded once (the bf16 outputs are the fp32 ones
// rounded once).
TEST(TimestepMlpBf16, Fp32GradientsRoundToTheBf16Ones) {
  CpuCase m(bf16_mlp_case(3, 32, 48, 40, 5300));
  DETDIT_ASSERT_OK(m.run());
  HostTensor grad(DType::kF32, {3, 40});
  for (int64_t i = 0; i < grad.numel(); ++i) grad.set(i, m["grad_temb"].get(i));
  std::map<std::string, HostTensor> out{{"d_features", HostTensor(DType::kF32, {3, 32})},
                                        {"d_w1", HostTensor(DType::kF32, {48, 32})},
                                        {"d_b1", HostTensor(DType::kF32, {48})},
                                        {"d_w2", HostTensor(DType::kF32, {40, 48})},
                                        {"d_b2", HostTensor(DType::kF32, {40})}};
  TimestepMlpInputs in{m["features"].view(), m["w1"].view(), m["b1"].view(), m["w2"].view(), m["b2"].view()};
  DETDIT_ASSERT_OK(timestep_mlp_backward({in, m["pre"].view(), m["hidden"].view(), grad.view(),
                                          out["d_features"].view(), out["d_w1"].view(), out["d_b1"].view(),
                                          out["d_w2"].view(), out["d_b2"].view()}));
  for (auto& [name, t] : out) {
    HostTensor rounded(DType::kBF16, t.shape());
    for (int64_t i = 0; i < t.numel(); ++i) rounded.set(i, t.get(i));
    EXPECT_BITWISE_EQ(rounded, m[name]) << name;
  }
}

TEST(TimestepMlpBf16, RefusesFp16AndMixedDtypes) {
  CpuCase m(bf16_mlp_case(2, 32, 48, 40, 5400));
  TimestepMlpParams p{{m.view("features"), m.view("w1"), m.view("b1"), m.view("w2"), m.view("b2")},
                      m.view("temb"), m.view("pre"), m.view("hidden")};
  TimestepMlpParams fp16 = p;
  fp16.in.features.dtype = DType::kF16;
  Status s = timestep_mlp_forward(fp16);
  EXPECT_EQ(s.kind(), ErrorKind::kType) << s.to_string();
  EXPECT_NE(s.message().find("features must be float32 or bfloat16"), std::string::npos) << s.to_string();
  TimestepMlpParams mixed = p;
  mixed.hidden.dtype = DType::kF32;
  mixed.hidden.shape[1] = 24;  // the same bytes as fp32
  mixed.hidden.strides[0] = 24;
  s = timestep_mlp_forward(mixed);
  EXPECT_EQ(s.kind(), ErrorKind::kType) << s.to_string();
  EXPECT_NE(s.message().find("hidden must be bfloat16 like features"), std::string::npos) << s.to_string();
  for (HostTensor* out : m.outputs()) EXPECT_TRUE(all_bytes_are(*out, kCanary)) << "written on error";
}

// ---- combined_timestep_embedding ------------------------------------------------------

// The MLP of one embedder of a combined case, run alone as timestep_mlp on the case's tensors.
std::map<std::string, HostTensor> run_alone(const CpuCase& c, const std::string& x, const std::string& prefix) {
  std::map<std::string, HostTensor> inputs{{"features", c[x]},
                                           {"w1", c[prefix + "w1"]},
                                           {"b1", c[prefix + "b1"]},
                                           {"w2", c[prefix + "w2"]},
                                           {"b2", c[prefix + "b2"]},
                                           {"grad_temb", c["grad_temb"]}};
  const HostTensor& w1 = c[prefix + "w1"];
  MlpShape s{c[x].shape()[0], c[x].shape()[1], w1.shape()[0], c[prefix + "w2"].shape()[0], 0};
  s.dtype = c[x].dtype();
  CpuCase alone(cases::timestep_mlp_case(s), &inputs);
  EXPECT_TRUE(alone.run().ok());
  return alone.tensors();
}

// temb[i] = R(rn(a[i] + b[i])) in the tensors' dtype (numerics 5.10), on the host.
HostTensor rounded_sum(const HostTensor& a, const HostTensor& b) {
  HostTensor out(a.dtype(), a.shape());
  for (int64_t i = 0; i < a.numel(); ++i) {
    volatile float sum = static_cast<float>(a.get(i)) + static_cast<float>(b.get(i));  // one FP32 add
    out.set(i, sum);
  }
  return out;
}

void expect_combined_is_its_parts(const EmbeddingShape& shape) {
  CpuCase c(cases::combined_timestep_embedding_case(shape));
  DETDIT_ASSERT_OK(c.run());
  std::vector<std::pair<std::string, std::string>> mlps{{"timestep_features", "timestep_"}, {"pooled", "text_"}};
  if (shape.guided) mlps.insert(mlps.begin() + 1, {"guidance_features", "guidance_"});
  HostTensor sum;
  bool first = true;
  for (const auto& [x, prefix] : mlps) {
    SCOPED_TRACE(prefix);
    const std::map<std::string, HostTensor> alone = run_alone(c, x, prefix);
    EXPECT_BITWISE_EQ(alone.at("pre"), c[prefix + "pre"]);
    EXPECT_BITWISE_EQ(alone.at("hidden"), c[prefix + "hidden"]);
    for (const char* w : {"w1", "b1", "w2", "b2"}) EXPECT_BITWISE_EQ(alone.at(std::string("d_") + w), c["d_" + prefix + w]);
    EXPECT_BITWISE_EQ(alone.at("d_features"), c["d_" + x]);
    // (t_emb + g_emb) + text_emb, in that order
    sum = first ? alone.at("temb") : rounded_sum(sum, alone.at("temb"));
    first = false;
  }
  EXPECT_BITWISE_EQ(sum, c["temb"]);
}

TEST(CombinedTimestepEmbedding, FluxLayoutIsItsMlpsAndRoundedAdds) {
  expect_combined_is_its_parts({DType::kBF16, 3, 32, 24, 48, true, 5600});
}
TEST(CombinedTimestepEmbedding, Sd3LayoutIsItsMlpsAndOneRoundedAdd) {
  expect_combined_is_its_parts({DType::kBF16, 2, 32, 64, 40, false, 5700});
}
TEST(CombinedTimestepEmbedding, Fp32IsItsMlpsAndRoundedAdds) {
  expect_combined_is_its_parts({DType::kF32, 2, 32, 24, 48, true, 5800});
}

TEST(CombinedTimestepEmbedding, RefusesGuidanceTensorsWithoutGuidanceFeatures) {
  CpuCase c(cases::combined_timestep_embedding_case({DType::kBF16, 2, 32, 24, 48, true, 5900}));
  CombinedTimestepEmbeddingParams p;
  p.in.timestep_features = c.view("timestep_features");
  p.in.pooled = c.view("pooled");
  p.in.timestep = {c.view("timestep_w1"), c.view("timestep_b1"), c.view("timestep_w2"), c.view("timestep_b2")};
  p.in.text = {c.view("text_w1"), c.view("text_b1"), c.view("text_w2"), c.view("text_b2")};
  p.in.guidance = {c.view("guidance_w1"), c.view("guidance_b1"), c.view("guidance_w2"), c.view("guidance_b2")};
  p.temb = c.view("temb");
  Status s = combined_timestep_embedding_forward(p);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_NE(s.message().find("guidance.w1 is given without guidance_features"), std::string::npos) << s.to_string();
  // A text embedder of another dtype than the timestep's.
  p.in.guidance = {};
  p.in.pooled.dtype = DType::kF32;
  p.in.pooled.shape[1] /= 2;
  p.in.pooled.strides[0] /= 2;
  s = combined_timestep_embedding_forward(p);
  EXPECT_EQ(s.kind(), ErrorKind::kType) << s.to_string();
  for (HostTensor* out : c.outputs()) EXPECT_TRUE(all_bytes_are(*out, kCanary)) << "written on error";
}

}  // namespace
}  // namespace testing
}  // namespace detdit
