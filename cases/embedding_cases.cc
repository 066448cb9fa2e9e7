// The cases of the families' timestep embeddings in the activation dtype:
// timestep_mlp in bf16 (registered with timestep_mlp's own cases,
// cases/timestep_cases.cc, through bf16_timestep_mlp_cases), among them the
// pooled-text embedder (PixArtAlphaTextProjection with the SiLU, which is
// timestep_mlp on the pooled text), and combined_timestep_embedding, with the
// FP64 oracle of cases/oracle.h (mlp_reference) measuring every stage of
// every MLP.
//
// Layouts (diffusers' CombinedTimestep[Guidance]TextProjEmbeddings): Flux
// (and HunyuanVideo) K = 256 sinusoid channels -> H = D = 3072 with a
// guidance embedder, pooled text 768; SD3 K = 256 -> 1536 (SD3-Medium), no
// guidance, pooled 2048. Suites: kTest both layouts scaled down (every shape a
// multiple of the bf16 vector width, 8), an fp32 one, and the Flux time MLP
// and both pooled-text MLPs at their real shapes (GPU only: too big for the
// CPU suites' size cap); kBench and kVerify the real Flux and SD3 shapes at
// B = 1 and 4 (--quick/--small: B = 1) for combined_timestep_embedding (verify
// does not list it yet: its default stays H3's); the bf16 timestep_mlp in
// kTest only.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "cases/case_builders.h"
#include "cases/op_case.h"
#include "cases/oracle.h"
#include "detdit/timestep.h"

namespace detdit {
namespace cases {

MlpCaseNames mlp_case_names(const std::string& x, const std::string& out, const std::string& prefix) {
  MlpCaseNames n;
  n.x = x;
  n.out = out;
  n.w1 = prefix + "w1";
  n.b1 = prefix + "b1";
  n.w2 = prefix + "w2";
  n.b2 = prefix + "b2";
  n.pre = prefix + "pre";
  n.hidden = prefix + "hidden";
  n.grad = "grad_" + out;
  n.d_x = "d_" + x;
  n.d_w1 = "d_" + n.w1;
  n.d_b1 = "d_" + n.b1;
  n.d_w2 = "d_" + n.w2;
  n.d_b2 = "d_" + n.b2;
  return n;
}

MlpReference mlp_case_reference(const std::map<std::string, HostTensor>& t, const MlpCaseNames& n, bool backward) {
  return mlp_reference(t.at(n.x), t.at(n.w1), t.at(n.b1), t.at(n.w2), t.at(n.b2), t.at(n.pre), t.at(n.hidden),
                       backward ? &t.at(n.grad) : nullptr);
}

namespace {

// The unit roundoff of a stored value: 2^-8 for bf16, 2^-24 for fp32.
double unit_roundoff(DType dtype) { return dtype == DType::kF32 ? 0x1p-24 : 0x1p-8; }

// max over i of |got_i - exact_i| / (u |exact_i| + chain magnitude_i): <= 1
// when every element is within one final rounding plus the first-order error
// of an FP32 chain of `terms` (numerics 5.2 rounds each of them at most once).
double scaled_error(const HostTensor& got, const std::vector<double>& exact, const std::vector<double>& magnitude,
                    int64_t terms) {
  const double u = unit_roundoff(got.dtype()), chain = static_cast<double>(terms) * 0x1p-24;
  double worst = 0;
  for (std::size_t i = 0; i < exact.size(); ++i) {
    const double err = std::fabs(got.get(static_cast<int64_t>(i)) - exact[i]);
    if (!(err == err)) return err;  // NaN fails
    const double allowed = u * std::fabs(exact[i]) + chain * (magnitude.empty() ? 0.0 : magnitude[i]);
    worst = std::max(worst, err == 0 ? 0.0 : err / allowed);
  }
  return worst;
}

}  // namespace

std::vector<AccuracyCheck> mlp_forward_stage_accuracy(const MlpCaseNames& n, bool check_out) {
  std::vector<AccuracyCheck> checks;
  AccuracyCheck pre;
  pre.name = n.pre + " within the fp32-accumulation bound";
  pre.bound = 1.0;
  pre.unit = "of the rounding bound";
  pre.error = [n](const std::map<std::string, HostTensor>& t) {
    const MlpReference r = mlp_case_reference(t, n, false);
    return scaled_error(t.at(n.pre), r.pre_exact, r.pre_magnitude, t.at(n.x).shape()[1] + 1);
  };
  checks.push_back(pre);
  // SiLU in FP32 (a few FP32 ulps, 2^-20 relative covers them), then one rounding.
  AccuracyCheck hidden;
  hidden.name = n.hidden + " = R(silu(" + n.pre + "))";
  hidden.bound = 1.0;
  hidden.unit = "of the rounding bound";
  hidden.error = [n](const std::map<std::string, HostTensor>& t) {
    const MlpReference r = mlp_case_reference(t, n, false);
    std::vector<double> magnitude(r.hidden_of_run_pre.size());
    for (std::size_t i = 0; i < magnitude.size(); ++i) magnitude[i] = std::fabs(r.hidden_of_run_pre[i]);
    return scaled_error(t.at(n.hidden), r.hidden_of_run_pre, magnitude, 16);  // 16 * 2^-24 = 2^-20
  };
  checks.push_back(hidden);
  if (!check_out) return checks;
  AccuracyCheck out;
  out.name = n.out + " within the fp32-accumulation bound";
  out.bound = 1.0;
  out.unit = "of the rounding bound";
  out.error = [n](const std::map<std::string, HostTensor>& t) {
    const MlpReference r = mlp_case_reference(t, n, false);
    return scaled_error(t.at(n.out), r.out_of_run_hidden, r.out_magnitude, t.at(n.w1).shape()[0] + 1);
  };
  checks.push_back(out);
  AccuracyCheck chain;
  chain.name = n.out + " vs the fp64 chain from " + n.x;
  chain.bound = 1e-2;  // bf16: a hidden element one ulp off where pre sat at a rounding boundary
  chain.unit = "max|err|/max|ref|";
  chain.error = [n](const std::map<std::string, HostTensor>& t) {
    return relative_max_error(t.at(n.out), mlp_case_reference(t, n, false).out);
  };
  checks.push_back(chain);
  return checks;
}

namespace {

// The weights of one MLP, counter-uniform: w1 spread 0.05, w2 0.02, biases around 0.
void add_mlp_tensors(OpCase* c, const MlpCaseNames& n, DType dtype, int64_t rows, int64_t in_features,
                     int64_t hidden, int64_t dim, uint64_t seed) {
  c->input(n.x, Phase::kForward, dtype, {rows, in_features}, uniform_values(seed, 0.0, 1.0), 0);
  c->input(n.w1, Phase::kForward, dtype, {hidden, in_features}, uniform_values(seed + 1, 0.0, 0.05));
  c->input(n.b1, Phase::kForward, dtype, {hidden}, uniform_values(seed + 2, 0.0, 1.0));
  c->input(n.w2, Phase::kForward, dtype, {dim, hidden}, uniform_values(seed + 3, 0.0, 0.02));
  c->input(n.b2, Phase::kForward, dtype, {dim}, uniform_values(seed + 4, 0.0, 1.0));
  c->output(n.pre, Phase::kForward, dtype, {rows, hidden}, 0);
  c->output(n.hidden, Phase::kForward, dtype, {rows, hidden}, 0);
  c->output(n.d_x, Phase::kBackward, dtype, {rows, in_features}, 0);
  c->output(n.d_w1, Phase::kBackward, dtype, {hidden, in_features});
  c->output(n.d_b1, Phase::kBackward, dtype, {hidden});
  c->output(n.d_w2, Phase::kBackward, dtype, {dim, hidden});
  c->output(n.d_b2, Phase::kBackward, dtype, {dim});
}

std::vector<std::string> forward_names(const MlpCaseNames& n) { return {n.x, n.w1, n.b1, n.w2, n.b2, n.pre, n.hidden}; }
std::vector<std::string> backward_names(const MlpCaseNames& n) {
  return {n.x, n.w1, n.w2, n.pre, n.hidden, n.d_x, n.d_w1, n.d_b1, n.d_w2, n.d_b2};
}

MlpWeights weights_of(const Instance& t, const MlpCaseNames& n) { return {t[n.w1], t[n.b1], t[n.w2], t[n.b2]}; }
MlpSaved saved_of(const Instance& t, const MlpCaseNames& n) { return {t[n.pre], t[n.hidden]}; }
MlpGrads grads_of(const Instance& t, const MlpCaseNames& n) {
  return {t[n.d_x], t[n.d_w1], t[n.d_b1], t[n.d_w2], t[n.d_b2]};
}

}  // namespace

// ---- combined_timestep_embedding ----------------------------------------------------

namespace {

const MlpCaseNames& timestep_names() {
  static const MlpCaseNames n = mlp_case_names("timestep_features", "temb", "timestep_");
  return n;
}
const MlpCaseNames& guidance_names() {
  static const MlpCaseNames n = mlp_case_names("guidance_features", "temb", "guidance_");
  return n;
}
const MlpCaseNames& text_names() {
  static const MlpCaseNames n = mlp_case_names("pooled", "temb", "text_");
  return n;
}

// temb against (t_emb + g_emb) + text_emb in FP64 from each MLP's own hidden:
// each MLP's output and each add rounded once to T, the FP32 chains to first
// order.
AccuracyCheck combined_sum_accuracy(bool guided) {
  AccuracyCheck a;
  a.name = "temb within the sum's rounding bound";
  a.bound = 1.0;
  a.unit = "of the rounding bound";
  a.error = [guided](const std::map<std::string, HostTensor>& t) {
    std::vector<MlpReference> refs{mlp_case_reference(t, timestep_names(), false),
                                   mlp_case_reference(t, text_names(), false)};
    std::vector<int64_t> terms{t.at("timestep_w1").shape()[0] + 1, t.at("text_w1").shape()[0] + 1};
    if (guided) {
      refs.push_back(mlp_case_reference(t, guidance_names(), false));
      terms.push_back(t.at("guidance_w1").shape()[0] + 1);
    }
    const HostTensor& temb = t.at("temb");
    const double u = unit_roundoff(temb.dtype());
    double worst = 0;
    for (int64_t i = 0; i < temb.numel(); ++i) {
      double exact = 0, allowed = 0;
      for (std::size_t m = 0; m < refs.size(); ++m) {
        const double v = refs[m].out_of_run_hidden[i];
        exact += v;
        // its own rounding, and at most the two adds' (each <= u of a partial sum of these terms)
        allowed += 3 * u * std::fabs(v) + static_cast<double>(terms[m]) * 0x1p-24 * refs[m].out_magnitude[i];
      }
      const double err = std::fabs(temb.get(i) - exact);
      if (!(err == err)) return err;
      worst = std::max(worst, err == 0 ? 0.0 : err / allowed);
    }
    return worst;
  };
  return a;
}

}  // namespace

OpCase combined_timestep_embedding_case(const EmbeddingShape& s) {
  OpCase c;
  c.op = "combined_timestep_embedding";
  c.name = std::string(dtype_name(s.dtype)) + (s.guided ? " guided" : "") + " B=" + std::to_string(s.rows) +
           " K=" + std::to_string(s.channels) + " P=" + std::to_string(s.pooled) + " H=" + std::to_string(s.hidden);
  const int64_t B = s.rows, H = s.hidden;
  add_mlp_tensors(&c, timestep_names(), s.dtype, B, s.channels, H, H, s.seed);
  if (s.guided) add_mlp_tensors(&c, guidance_names(), s.dtype, B, s.channels, H, H, s.seed + 10);
  add_mlp_tensors(&c, text_names(), s.dtype, B, s.pooled, H, H, s.seed + 20);
  c.output("temb", Phase::kForward, s.dtype, {B, H}, 0);
  c.input("grad_temb", Phase::kBackward, s.dtype, {B, H}, uniform_values(s.seed + 30, 0.0, 1.0), 0);
  c.takes_profile = true;  // the SiLUs' exp
  const bool guided = s.guided;
  auto inputs = [guided](const Instance& t) {
    CombinedTimestepEmbeddingInputs in;
    in.timestep_features = t["timestep_features"];
    in.pooled = t["pooled"];
    in.timestep = weights_of(t, timestep_names());
    in.text = weights_of(t, text_names());
    if (guided) {
      in.guidance_features = t["guidance_features"];
      in.guidance = weights_of(t, guidance_names());
    }
    in.numerics = t.numerics;
    return in;
  };
  c.forward = [inputs, guided](const Instance& t, Stream stream) {
    CombinedTimestepEmbeddingParams p;
    p.in = inputs(t);
    p.temb = t["temb"];
    p.timestep_saved = saved_of(t, timestep_names());
    p.text_saved = saved_of(t, text_names());
    if (guided) p.guidance_saved = saved_of(t, guidance_names());
    return combined_timestep_embedding_forward(p, stream);
  };
  c.backward = [inputs, guided](const Instance& t, Stream stream) {
    CombinedTimestepEmbeddingBackwardParams p;
    p.in = inputs(t);
    p.grad_temb = t["grad_temb"];
    p.timestep_saved = saved_of(t, timestep_names());
    p.text_saved = saved_of(t, text_names());
    p.timestep_grads = grads_of(t, timestep_names());
    p.text_grads = grads_of(t, text_names());
    if (guided) {
      p.guidance_saved = saved_of(t, guidance_names());
      p.guidance_grads = grads_of(t, guidance_names());
    }
    return combined_timestep_embedding_backward(p, stream);
  };
  std::vector<std::string> fwd{"temb"}, bwd{"grad_temb"};
  for (const MlpCaseNames* n : {&timestep_names(), &guidance_names(), &text_names()}) {
    if (n == &guidance_names() && !guided) continue;
    for (const std::string& name : forward_names(*n)) fwd.push_back(name);
    for (const std::string& name : backward_names(*n)) bwd.push_back(name);
    for (const AccuracyCheck& a : mlp_forward_stage_accuracy(*n, false)) c.accuracy.push_back(a);
  }
  c.set_bytes(Phase::kForward, fwd);
  c.set_bytes(Phase::kBackward, bwd);
  c.accuracy.push_back(combined_sum_accuracy(guided));
  c.positions = B;
  c.alone = [s](int64_t) {
    EmbeddingShape one = s;
    one.rows = 1;
    return combined_timestep_embedding_case(one);
  };
  return c;
}

// ---- the suites -------------------------------------------------------------------------

namespace {

// Flux (guided, pooled 768) and SD3 (pooled 2048) at the real widths, K = 256.
EmbeddingShape flux_shape(int64_t rows, uint64_t seed) { return {DType::kBF16, rows, 256, 768, 3072, true, seed}; }
EmbeddingShape sd3_shape(int64_t rows, uint64_t seed) { return {DType::kBF16, rows, 256, 2048, 1536, false, seed}; }

std::vector<int64_t> real_rows(const CaseContext& ctx) {
  return ctx.quick || ctx.small ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 4};
}

std::vector<OpCase> combined_timestep_embedding_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    cases.push_back(combined_timestep_embedding_case({DType::kBF16, 3, 32, 24, 48, true, 3200}));   // Flux-dev
    cases.push_back(combined_timestep_embedding_case({DType::kBF16, 2, 32, 64, 40, false, 3210}));  // SD3
    cases.push_back(combined_timestep_embedding_case({DType::kF32, 3, 32, 24, 48, true, 3220}));
    return cases;
  }
  for (int64_t rows : real_rows(ctx)) {
    cases.push_back(combined_timestep_embedding_case(flux_shape(rows, ctx.seed + 3230)));
    cases.push_back(combined_timestep_embedding_case(sd3_shape(rows, ctx.seed + 3240)));
  }
  return cases;
}

DETDIT_OP_CASES("combined_timestep_embedding", combined_timestep_embedding_cases);

}  // namespace

// The bench times the bf16 MLP at the real shapes inside
// combined_timestep_embedding (scripts/torch_compare.py's timestep_mlp is H3's
// FP32 module), and verify's default stays H3's: test cases only.
std::vector<OpCase> bf16_timestep_mlp_cases(Suite suite, const CaseContext&) {
  std::vector<OpCase> cases;
  if (suite != Suite::kTest) return cases;
  auto mlp = [](DType dtype, int64_t rows, int64_t k, int64_t h, uint64_t seed) {
    MlpShape s{rows, k, h, h, seed};
    s.dtype = dtype;
    OpCase c = timestep_mlp_case(s);
    c.accuracy = mlp_forward_stage_accuracy(mlp_case_names("features", "temb", ""), true);
    return c;
  };
  cases.push_back(mlp(DType::kBF16, 3, 32, 48, 1430));  // Flux's layout scaled down
  cases.push_back(mlp(DType::kBF16, 2, 32, 40, 1431));  // SD3's
  cases.push_back(mlp(DType::kBF16, 4, 256, 3072, 1432));  // Flux's time MLP at its real shape (CUDA: over the CPU cap)
  // The pooled-text embedder: timestep_mlp with the pooled text (B, P) as features.
  cases.push_back(mlp(DType::kBF16, 3, 24, 48, 3100));  // Flux's layout scaled down
  cases.push_back(mlp(DType::kBF16, 2, 64, 40, 3110));  // SD3's
  cases.push_back(mlp(DType::kF32, 3, 24, 48, 3120));
  cases.push_back(mlp(DType::kBF16, 4, 768, 3072, 3130));   // Flux's at its real shape (CUDA tests)
  cases.push_back(mlp(DType::kBF16, 4, 2048, 1536, 3140));  // SD3's at its real shape (CUDA tests)
  return cases;
}

}  // namespace cases
}  // namespace detdit
