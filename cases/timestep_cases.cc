// The cases of the timestep path: timestep_sinusoid ((T,) timesteps -> (T, C)
// FP32 features, and d_t) and timestep_mlp (FP32, W2 silu(W1 f + b1) + b2,
// every gradient).
//
// Suites: kTest sweeps many timesteps in every dtype (with the edges 0, 1,
// 0.5, 1e-3) at C = 256, 254, 2 in H3's convention, then the conventions of
// the other DiT families at small T (sigma * 1000 timesteps at C = 256, Qwen-
// Image's scale 1000, CogVideoX's C = 1920, odd C, [sin | cos] with shift 1,
// guidance * 1000), each checked against the FP64 oracle (cases/oracle.h)
// and, bitwise, against numerics 5.1 / 6.1 restated in scalar FP32; and the
// MLP at an awkward and the H3 shape; kBench the H3 MLP (256 -> 5376 -> 2688,
// the weights' tensors) and the H3 sinusoid at T = 1, 3, 4, 8, 16, 32;
// kVerify the sinusoid at the weights' C, T = 1, 3, 7, 64, 1000 (--quick: 1,
// 7), and the MLP on the weights' tensors at T = 4, each on the timesteps
// t_i = frac(0.25 + i * golden ratio), with its FP64 oracle.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cases/case_builders.h"
#include "cases/op_case.h"
#include "cases/oracle.h"
#include "common/scalar_math.h"
#include "detdit/timestep.h"

namespace detdit {
namespace cases {
namespace {

// verify's timesteps: t_i = frac(0.25 + i * golden ratio) in [0, 1), a spread that does not repeat.
void fill_golden_timesteps(HostTensor* t) {
  for (int64_t i = 0; i < t->numel(); ++i) {
    const double v = 0.25 + 0.6180339887498949 * static_cast<double>(i);
    t->set(i, v - std::floor(v));
  }
}


// ---- timestep_sinusoid --------------------------------------------------------


// Uniform timesteps in [0, t_max] led by the edges 0, t_max, t_max / 2, 1e-3
// (integer conventions: integers in [0, t_max - 1] led by 0, t_max - 1, 1).
Fill timesteps_with_edges(uint64_t seed, const SinusoidConvention& conv = {}) {
  return [seed, conv](HostTensor* t) {
    const double top = conv.t_max;
    fill_uniform(t, seed, 0.0, top);
    if (conv.integer_timesteps) {
      for (int64_t i = 0; i < t->numel(); ++i) t->set(i, std::min(std::floor(t->get(i)), top - 1.0));
      const double edges[3] = {0.0, top - 1.0, 1.0};
      for (int64_t i = 0; i < 3 && i < t->numel(); ++i) t->set(i, edges[i]);
      return;
    }
    const double edges[4] = {0.0, top, 0.5 * top, 1e-3};
    for (int64_t i = 0; i < 4 && i < t->numel(); ++i) t->set(i, edges[i]);
  };
}

// numerics 5.1 and 6.1 restated in scalar FP32 from the document, apart from
// the op's code: C++ float operations (one rounding each, no contraction in
// this build), the reciprocal as the FP32 division PyTorch performs, and the
// portable functions of numerics 4.1. Fills features and d_timesteps.
void sinusoid_fp32_statement(const std::map<std::string, HostTensor>& got, const TimestepSinusoidInputs& in,
                             std::map<std::string, HostTensor>* expected) {
  const HostTensor &t = got.at("timesteps"), &g = got.at("grad_features");
  const int64_t rows = g.shape()[0], channels = g.shape()[1], half = channels / 2;
  HostTensor features(DType::kF32, {rows, channels}), d_t(t.dtype(), {rows});
  const float c = static_cast<float>(-std::log(static_cast<double>(in.max_period)));
  const float inv = 1.0f / static_cast<float>(static_cast<double>(half) - static_cast<double>(in.downscale_freq_shift));
  for (int64_t r = 0; r < rows; ++r) {
    const float time = static_cast<float>(t.get(r));
    float acc = 0.0f;
    for (int64_t k = 0; k < half; ++k) {
      const float exponent = (c * static_cast<float>(k)) * inv;
      const float freq = num::portable_exp(exponent);
      const float arg = in.scale * (time * freq);
      const float cos_v = num::portable_cos(arg), sin_v = num::portable_sin(arg);
      const int64_t cos_at = r * channels + (in.flip_sin_to_cos ? k : half + k);
      const int64_t sin_at = r * channels + (in.flip_sin_to_cos ? half + k : k);
      features.set(cos_at, cos_v);
      features.set(sin_at, sin_v);
      const float a = (static_cast<float>(g.get(cos_at)) * sin_v) * freq;
      const float b = (static_cast<float>(g.get(sin_at)) * cos_v) * freq;
      acc = acc + (b - a);
    }
    if (channels % 2 != 0) features.set(r * channels + channels - 1, 0.0);
    d_t.set(r, in.scale * acc);
  }
  (*expected)["features"] = std::move(features);
  (*expected)["d_timesteps"] = std::move(d_t);
}

// The FP64 oracle's bound on the features (numerics 5.1): the exponent, freq,
// t * freq and the scale each carry a few 2^-24 relative errors, which move
// arg by at most |arg| 2^-21 (freq |exponent| <= 1/e bounds the exponent's
// share), and sin_P / cos_P add one ulp of a result below 1.
double sinusoid_bound(const SinusoidConvention& conv) {
  return 0x1p-23 + std::fabs(static_cast<double>(conv.scale) * conv.t_max) * 0x1p-21;
}

OpCase timestep_sinusoid_case(DType dtype, int64_t count, int64_t channels, uint64_t seed, Fill timesteps = {},
                              const SinusoidConvention& conv = {}) {
  OpCase c;
  c.op = "timestep_sinusoid";
  c.name = (conv.name.empty() ? "" : conv.name + " ") + dtype_name(dtype) + " T=" + std::to_string(count) +
           " C=" + std::to_string(channels);
  c.input("timesteps", Phase::kForward, dtype, {count}, timesteps ? timesteps : timesteps_with_edges(seed, conv), 0);
  c.output("features", Phase::kForward, DType::kF32, {count, channels}, 0);
  c.input("grad_features", Phase::kBackward, DType::kF32, {count, channels}, uniform_values(seed + 1, 0.0, 1.0), 0);
  c.output("d_timesteps", Phase::kBackward, dtype, {count}, 0);
  c.takes_profile = true;  // exp, sin, cos
  c.arguments["max_period"] = argument_text(TimestepSinusoidInputs{}.max_period);
  c.arguments["flip_sin_to_cos"] = conv.flip_sin_to_cos ? "true" : "false";
  c.arguments["downscale_freq_shift"] = argument_text(conv.downscale_freq_shift);
  c.arguments["scale"] = argument_text(conv.scale);
  c.arguments["t_max"] = argument_text(conv.t_max);
  auto inputs = [conv](const Instance& t) {
    TimestepSinusoidInputs in{t["timesteps"]};
    in.numerics = t.numerics;
    in.flip_sin_to_cos = conv.flip_sin_to_cos;
    in.downscale_freq_shift = conv.downscale_freq_shift;
    in.scale = conv.scale;
    in.t_max = conv.t_max;
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return timestep_sinusoid_forward({inputs(t), t["features"]}, stream);
  };
  c.backward = [inputs](const Instance& t, Stream stream) {
    return timestep_sinusoid_backward({inputs(t), t["grad_features"], t["d_timesteps"]}, stream);
  };
  c.set_bytes(Phase::kForward, {"timesteps", "features"});
  c.set_bytes(Phase::kBackward, {"timesteps", "grad_features", "d_timesteps"});
  c.positions = count;
  c.alone = [dtype, channels, seed, conv](int64_t) {
    return timestep_sinusoid_case(dtype, 1, channels, seed, {}, conv);
  };
  return c;
}

// verify's oracle of the forward: the features' largest absolute error
// against diffusers' Timesteps in FP64, in the case's convention.
AccuracyCheck sinusoid_forward_accuracy(const SinusoidConvention& conv = {}) {
  AccuracyCheck a;
  a.name = "accuracy vs fp64";
  // H3 (t <= 1): the FP32 argument t*f_k is rounded once: |error| <= 2^-24 + the result's rounding
  a.bound = conv.name.empty() ? 0x1p-23 : sinusoid_bound(conv);
  a.unit = "abs";
  a.error = [conv](const std::map<std::string, HostTensor>& t) {
    const HostTensor& features = t.at("features");
    SinusoidOracle64 o;
    o.flip_sin_to_cos = conv.flip_sin_to_cos;
    o.downscale_freq_shift = conv.downscale_freq_shift;
    o.scale = conv.scale;
    return max_abs_error(features, sinusoid64(to_doubles(t.at("timesteps")), features.shape()[1], o));
  };
  return a;
}

}  // namespace

// A family's test case: the FP64 oracle of its features and, bitwise, the
// scalar FP32 statement of both phases.
OpCase family_sinusoid_case(const SinusoidConvention& conv, DType dtype, int64_t count, int64_t channels,
                            uint64_t seed) {
  OpCase c = timestep_sinusoid_case(dtype, count, channels, seed, {}, conv);
  c.accuracy.push_back(sinusoid_forward_accuracy(conv));
  c.equivalent.name = "= numerics 5.1 and 6.1 in scalar FP32";
  c.equivalent.compute = [conv](const std::map<std::string, HostTensor>& got,
                                std::map<std::string, HostTensor>* expected) {
    TimestepSinusoidInputs in;
    in.flip_sin_to_cos = conv.flip_sin_to_cos;
    in.downscale_freq_shift = conv.downscale_freq_shift;
    in.scale = conv.scale;
    in.t_max = conv.t_max;
    sinusoid_fp32_statement(got, in, expected);
    return Status();
  };
  return c;
}

namespace {

// The conventions of the DiT families (docs/models.md) and the corners of the op's arguments.
std::vector<OpCase> family_sinusoid_cases() {
  SinusoidConvention sigma1000{"sigma*1000"};  // SD3, Flux, HunyuanVideo, LTX-Video: t = sigma * 1000 in [0, 1000]
  sigma1000.t_max = 1000.0f;
  SinusoidConvention wan = sigma1000;  // Wan: integer timesteps in [0, 999]
  wan.name = "integer t";
  wan.integer_timesteps = true;
  SinusoidConvention qwen{"scale=1000"};  // Qwen-Image: t in [0, 1], Timesteps(scale=1000)
  qwen.scale = 1000.0f;
  SinusoidConvention guidance{"guidance*1000"};  // Flux's guidance embedding: guidance * 1000
  guidance.t_max = 20000.0f;
  SinusoidConvention sin_first{"sin|cos shift=1"};  // get_timestep_embedding's own defaults
  sin_first.flip_sin_to_cos = false;
  sin_first.downscale_freq_shift = 1.0f;
  sin_first.t_max = 1000.0f;
  std::vector<OpCase> cases;
  for (DType dtype : {DType::kF32, DType::kBF16}) cases.push_back(family_sinusoid_case(sigma1000, dtype, 64, 256, 1330));
  cases.push_back(family_sinusoid_case(wan, DType::kF32, 64, 256, 1331));
  cases.push_back(family_sinusoid_case(wan, DType::kF32, 16, 1920, 1332));  // CogVideoX: C = H, half = 960
  for (DType dtype : {DType::kF32, DType::kBF16}) cases.push_back(family_sinusoid_case(qwen, dtype, 64, 256, 1333));
  cases.push_back(family_sinusoid_case(guidance, DType::kF32, 64, 256, 1334));
  for (int64_t channels : {255, 7, 1}) cases.push_back(family_sinusoid_case(sigma1000, DType::kF32, 16, channels, 1335));
  for (int64_t channels : {256, 33}) cases.push_back(family_sinusoid_case(sin_first, DType::kF16, 16, channels, 1336));
  return cases;
}

// ---- timestep_mlp -----------------------------------------------------------------

}  // namespace

OpCase timestep_mlp_case(const MlpShape& s) {
  OpCase c;
  c.op = "timestep_mlp";
  c.name = std::string(s.dtype == DType::kF32 ? "" : "bfloat16 ") + "T=" + std::to_string(s.rows) +
           " K=" + std::to_string(s.in_features) + " H=" + std::to_string(s.hidden) + " D=" + std::to_string(s.dim);
  const int64_t T = s.rows, K = s.in_features, H = s.hidden, D = s.dim;
  const DType dtype = s.dtype;
  c.input("features", Phase::kForward, dtype, {T, K}, s.features ? s.features : uniform_values(s.seed, 0.0, 1.0), 0);
  c.input("w1", Phase::kForward, dtype, {H, K}, s.w1 ? s.w1 : uniform_values(s.seed + 1, 0.0, 0.05));
  c.input("b1", Phase::kForward, dtype, {H}, s.b1 ? s.b1 : uniform_values(s.seed + 2, 0.0, 1.0));
  c.input("w2", Phase::kForward, dtype, {D, H}, s.w2 ? s.w2 : uniform_values(s.seed + 3, 0.0, 0.02));
  c.input("b2", Phase::kForward, dtype, {D}, s.b2 ? s.b2 : uniform_values(s.seed + 4, 0.0, 1.0));
  c.output("temb", Phase::kForward, dtype, {T, D}, 0);
  c.output("pre", Phase::kForward, dtype, {T, H}, 0);
  c.output("hidden", Phase::kForward, dtype, {T, H}, 0);
  c.input("grad_temb", Phase::kBackward, dtype, {T, D}, uniform_values(s.seed + 5, 0.0, 1.0), 0);
  c.output("d_features", Phase::kBackward, dtype, {T, K}, 0);
  c.output("d_w1", Phase::kBackward, dtype, {H, K});
  c.output("d_b1", Phase::kBackward, dtype, {H});
  c.output("d_w2", Phase::kBackward, dtype, {D, H});
  c.output("d_b2", Phase::kBackward, dtype, {D});
  c.takes_profile = true;  // the SiLU's exp
  auto inputs = [](const Instance& t) {
    return TimestepMlpInputs{t["features"], t["w1"], t["b1"], t["w2"], t["b2"], t.numerics};
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return timestep_mlp_forward({inputs(t), t["temb"], t["pre"], t["hidden"]}, stream);
  };
  c.backward = [inputs](const Instance& t, Stream stream) {
    return timestep_mlp_backward({inputs(t), t["pre"], t["hidden"], t["grad_temb"], t["d_features"], t["d_w1"],
                                  t["d_b1"], t["d_w2"], t["d_b2"]},
                                 stream);
  };
  c.set_bytes(Phase::kForward, {"features", "w1", "b1", "w2", "b2", "temb", "pre", "hidden"});
  c.set_bytes(Phase::kBackward,
              {"features", "w1", "w2", "pre", "hidden", "grad_temb", "d_features", "d_w1", "d_b1", "d_w2", "d_b2"});
  c.positions = T;
  c.alone = [s](int64_t) {
    MlpShape one = s;
    one.rows = 1;
    return timestep_mlp_case(one);
  };
  return c;
}

namespace {

// The features of the model's timesteps: timestep_sinusoid's forward on the CPU.
Fill sinusoid_features(Fill timesteps) {
  return [timesteps](HostTensor* features) {
    HostTensor t(DType::kF32, {features->shape()[0]});
    timesteps(&t);
    TimestepSinusoidParams p;
    p.in.timesteps = t.view();
    p.features = features->view();
    const Status s = timestep_sinusoid_forward(p);
    if (!s.ok()) {  // the case's own shapes are valid: a case bug
      std::fprintf(stderr, "detdit cases: timestep_sinusoid features: %s\n", s.to_string().c_str());
      std::abort();
    }
  };
}

// verify's oracle of the forward: temb's largest error relative to its
// largest value, against W2 silu(W1 f + b1) + b2 in FP64.
AccuracyCheck mlp_forward_accuracy(int64_t rows) {
  AccuracyCheck a;
  a.name = "accuracy vs fp64 T=" + std::to_string(rows);
  a.bound = 1e-4;  // FP32 chains of 256 and 5376 terms
  a.unit = "max|err|/max|ref|";
  a.error = [](const std::map<std::string, HostTensor>& t) {
    const HostTensor &w1 = t.at("w1"), &w2 = t.at("w2");
    const int64_t rows = t.at("features").shape()[0], K = w1.shape()[1], H = w1.shape()[0], D = w2.shape()[0];
    std::vector<double> hidden = linear64(to_doubles(t.at("features")), w1, to_doubles(t.at("b1")), rows, K, H);
    for (double& h : hidden) h = silu64(h);
    return relative_max_error(t.at("temb"), linear64(hidden, w2, to_doubles(t.at("b2")), rows, H, D));
  };
  return a;
}

// ---- the suites -----------------------------------------------------------------------

std::vector<OpCase> timestep_sinusoid_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      for (int64_t channels : {256, 254, 2}) cases.push_back(timestep_sinusoid_case(dtype, 8192, channels, 1300));
    for (OpCase& c : family_sinusoid_cases()) cases.push_back(std::move(c));
    return cases;
  }
  if (suite == Suite::kBench) {
    for (int64_t rows : ctx.small ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{1, 3, 4, 8, 16, 32})
      cases.push_back(timestep_sinusoid_case(DType::kF32, rows, ctx.freq_dim, ctx.seed + 1310));
    return cases;
  }
  for (int64_t rows : ctx.quick ? std::vector<int64_t>{1, 7} : std::vector<int64_t>{1, 3, 7, 64, 1000}) {
    OpCase c = timestep_sinusoid_case(DType::kF32, rows, ctx.freq_dim, ctx.seed + 1320, fill_golden_timesteps);
    c.name = "T=" + std::to_string(rows);
    c.accuracy.push_back(sinusoid_forward_accuracy());
    c.alone_probes = rows;  // every timestep alone: a row costs microseconds
    cases.push_back(std::move(c));
  }
  return cases;
}

std::vector<OpCase> h3_timestep_mlp_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    cases.push_back(timestep_mlp_case({3, 24, 72, 64, 1400}));
    cases.push_back(timestep_mlp_case({8, 256, 5376, 2688, 1401}));
    return cases;
  }
  // The weights' MLP: kBench at its sizes, kVerify at T = 4 on the features of verify's timesteps.
  auto weights_shape = [&ctx](int64_t rows, uint64_t seed) {
    MlpShape s{rows, ctx.freq_dim, ctx.time_embed_hidden, ctx.time_embed_dim, seed};
    s.w1 = weight_or(ctx, "time_embedder.linear_1.weight", uniform_values(seed + 1, 0.0, 0.05));
    s.b1 = weight_or(ctx, "time_embedder.linear_1.bias", uniform_values(seed + 2, 0.0, 1.0));
    s.w2 = weight_or(ctx, "time_embedder.linear_2.weight", uniform_values(seed + 3, 0.0, 0.02));
    s.b2 = weight_or(ctx, "time_embedder.linear_2.bias", uniform_values(seed + 4, 0.0, 1.0));
    return s;
  };
  if (suite == Suite::kBench) {
    for (int64_t rows : ctx.small ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{1, 3, 4, 8, 16, 32})
      cases.push_back(timestep_mlp_case(weights_shape(rows, ctx.seed + 1410)));
    return cases;
  }
  MlpShape s = weights_shape(4, ctx.seed + 1420);
  s.features = sinusoid_features(fill_golden_timesteps);
  OpCase c = timestep_mlp_case(s);
  c.name = "weights T=4";
  c.accuracy.push_back(mlp_forward_accuracy(s.rows));
  cases.push_back(std::move(c));
  return cases;
}

std::vector<OpCase> timestep_mlp_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases = h3_timestep_mlp_cases(suite, ctx);
  // The activation-dtype (bf16) MLP of the diffusers families: cases/embedding_cases.cc.
  for (OpCase& c : bf16_timestep_mlp_cases(suite, ctx)) cases.push_back(std::move(c));
  return cases;
}

DETDIT_OP_CASES("timestep_sinusoid", timestep_sinusoid_cases);
DETDIT_OP_CASES("timestep_mlp", timestep_mlp_cases);

}  // namespace
}  // namespace cases
}  // namespace detdit
