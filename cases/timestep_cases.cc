// The cases of the timestep path: timestep_sinusoid ((T,) timesteps in [0, 1]
// -> (T, C) FP32 features, and d_t) and timestep_mlp (FP32, W2 silu(W1 f + b1)
// + b2, every gradient).
//
// Suites: kTest sweeps many timesteps in every dtype (with the edges 0, 1,
// 0.5, 1e-3) at C = 256, 254, 2, and the MLP at an awkward and the H3 shape;
// kBench the H3 MLP (256 -> 5376 -> 2688, the weights' tensors) and the H3
// sinusoid at T = 1, 3, 4, 8, 16, 32; kVerify the sinusoid at the weights' C,
// T = 1, 3, 7, 64, 1000 (--quick: 1, 7), and the MLP on the weights' tensors
// at T = 4, each on the timesteps t_i = frac(0.25 + i * golden ratio), with
// its FP64 oracle (cases/oracle.h).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cases/case_builders.h"
#include "cases/op_case.h"
#include "cases/oracle.h"
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

// Uniform timesteps in [0, 1] led by the edges 0, 1, 0.5, 1e-3.
Fill timesteps_with_edges(uint64_t seed) {
  return [seed](HostTensor* t) {
    fill_uniform(t, seed, 0.0, 1.0);
    const double edges[4] = {0.0, 1.0, 0.5, 1e-3};
    for (int64_t i = 0; i < 4 && i < t->numel(); ++i) t->set(i, edges[i]);
  };
}

OpCase timestep_sinusoid_case(DType dtype, int64_t count, int64_t channels, uint64_t seed, Fill timesteps = {}) {
  OpCase c;
  c.op = "timestep_sinusoid";
  c.name = std::string(dtype_name(dtype)) + " T=" + std::to_string(count) + " C=" + std::to_string(channels);
  c.input("timesteps", Phase::kForward, dtype, {count}, timesteps ? timesteps : timesteps_with_edges(seed), 0);
  c.output("features", Phase::kForward, DType::kF32, {count, channels}, 0);
  c.input("grad_features", Phase::kBackward, DType::kF32, {count, channels}, uniform_values(seed + 1, 0.0, 1.0), 0);
  c.output("d_timesteps", Phase::kBackward, dtype, {count}, 0);
  c.takes_profile = true;  // exp, sin, cos
  c.arguments["max_period"] = argument_text(TimestepSinusoidInputs{}.max_period);
  auto inputs = [](const Instance& t) {
    TimestepSinusoidInputs in{t["timesteps"]};
    in.numerics = t.numerics;
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
  c.alone = [dtype, channels, seed](int64_t) { return timestep_sinusoid_case(dtype, 1, channels, seed); };
  return c;
}

// verify's oracle of the forward: the features' largest absolute error
// against diffusers' Timesteps(C, flip_sin_to_cos=True) in FP64.
AccuracyCheck sinusoid_forward_accuracy() {
  AccuracyCheck a;
  a.name = "accuracy vs fp64";
  a.bound = 0x1p-23;  // the FP32 argument t*f_k is rounded once: |error| <= 2^-24 + the result's rounding
  a.unit = "abs";
  a.error = [](const std::map<std::string, HostTensor>& t) {
    const HostTensor& features = t.at("features");
    return max_abs_error(features, sinusoid64(to_doubles(t.at("timesteps")), features.shape()[1], 10000.0));
  };
  return a;
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
