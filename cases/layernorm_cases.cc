// The cases of layernorm: the plain F.layer_norm (no affine, weight, weight
// and bias) and the modulated norm in every form of cases/forms_cases.h.
// Plain suites: kTest sweeps the affine variants, every dtype, H from one
// vector (4) to widths where the 128 threads hold unequal shares (2432) and
// M around a reduction chunk (255, 256, 257, 600), rows with a large mean,
// and grad / dx views off the vector boundary; kBench the DiT widths
// (bf16, no affine: H = 1536, 3072, 5120) at B*S = 8192 and 65536 (--quick /
// CPU: 8192); kVerify the weights' H (no affine, bf16, verify's positions)
// with its FP64 accuracy check.
// Form cases (layernorm_form_case): kTest crosses every form (per sample and
// per frame F = 3 with the chunk dimension dropped and kept, per frame
// F = 21, per token, indexed) with {x's dtype, fp32} modulation, {each op,
// upcast} and the three affine variants in bf16, plus the plain norm of a
// (B, S, H) x in both recipes, fp16 and fp32 rows, modulation-dtype
// gradients, H = 4 and H = 1032; kVerify Wan's norm (per sample, fp32,
// upcast) and per frame F = 21 (bf16, each op) at the weights' H; kBench the
// DiT families' shapes (family_bench_forms). Each form case's equivalent
// route is docs/numerics.md 9 written out step by step (cases/oracle.h), so
// verify and the CPU tests compare the op with the contract, bitwise.
#include "cases/layernorm_cases.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <map>
#include <string>
#include <iterator>
#include <vector>

#include "cases/oracle.h"
#include "detdit/layernorm.h"

namespace detdit {
namespace cases {

const char* affine_name(LayernormAffine affine) {
  switch (affine) {
    case LayernormAffine::kWeight: return "weight";
    case LayernormAffine::kWeightBias: return "weight+bias";
    default: return "no affine";
  }
}

namespace {

constexpr float kFormEps = 1e-6f;          // the form cases' eps (the DiTs' AdaLN norms)
constexpr double kBf16Roundoff = 0x1p-8;  // u: one bf16 rounding errs by at most u relative

// verify's oracle of the forward: out against the FP64 layer norm (no affine,
// bf16), in units of u = 2^-8 of max(|out|, 2^-4): one rounding to bf16 (at
// most u relative), plus the FP32 statistics (~1e-6 of the row's scale; the
// floor 2^-4 keeps values near zero, whose error is the statistics' absolute
// one, measurable).
AccuracyCheck layernorm_forward_accuracy() {
  AccuracyCheck a;
  a.name = "accuracy vs fp64";
  a.bound = 1.01;
  a.unit = "u=2^-8 of max(|out|, 2^-4)";
  a.error = [](const std::map<std::string, HostTensor>& t) {
    const HostTensor& x = t.at("x");
    const HostTensor& grad = t.at("grad");
    const LayernormReference ref = layernorm_reference(x, nullptr, nullptr, grad, 1e-6, DType::kBF16);
    const HostTensor& out = t.at("out");
    double worst = 0;
    for (int64_t i = 0; i < out.numel(); ++i) {
      const double exact = ref.exact_out[i], err = std::fabs(out.get(i) - exact);
      if (std::isnan(err)) return static_cast<double>(NAN);  // fails the check
      worst = std::max(worst, err / std::max(std::fabs(exact), 0x1p-4));
    }
    return worst / kBf16Roundoff;
  };
  return a;
}

}  // namespace

OpCase layernorm_case(const LayernormShape& s, uint64_t seed) {
  OpCase c;
  c.op = "layernorm";
  c.name = std::string(affine_name(s.affine)) + " " + dtype_name(s.dtype) + " H=" + std::to_string(s.hidden) +
           " M=" + std::to_string(s.rows) + (s.x_mean != 0 ? " mean " + std::to_string(static_cast<int>(s.x_mean)) : "") +
           (s.offset_grad ? " offset grad" : "") +
           (s.grad_dtype != DType::kF32 ? std::string(" grads ") + dtype_name(s.grad_dtype) : "");
  const int64_t M = s.rows, H = s.hidden;
  const bool weight = s.affine != LayernormAffine::kNone, bias = s.affine == LayernormAffine::kWeightBias;
  const bool offset = s.offset_grad;
  c.positions = M;
  c.input("x", Phase::kForward, s.dtype, {M, H}, uniform_values(seed + 1, s.x_mean, 3.0), 0);
  if (weight) c.input("weight", Phase::kForward, s.dtype, {H}, uniform_values(seed + 2, 1.0, 0.5));
  if (bias) c.input("bias", Phase::kForward, s.dtype, {H}, uniform_values(seed + 3, 0.0, 0.5));
  c.output("out", Phase::kForward, s.dtype, {M, H}, 0);
  c.output("mean", Phase::kForward, DType::kF32, {M}, 0);
  c.output("rstd", Phase::kForward, DType::kF32, {M}, 0);
  // offset: grad and dx are flat (M*H + 1,) storage whose rows start one
  // element past the start, so every row is off its vector boundary.
  const int64_t grad_elems = M * H + (offset ? 1 : 0);
  c.input("grad", Phase::kBackward, s.dtype, offset ? std::vector<int64_t>{grad_elems} : std::vector<int64_t>{M, H},
          uniform_values(seed + 4, 0.0, 1.0), offset ? -1 : 0);
  c.output("dx", Phase::kBackward, s.dtype, offset ? std::vector<int64_t>{grad_elems} : std::vector<int64_t>{M, H},
           offset ? -1 : 0);
  if (weight) c.output("d_weight", Phase::kBackward, s.grad_dtype, {H});
  if (bias) c.output("d_bias", Phase::kBackward, s.grad_dtype, {H});
  c.takes_profile = true;  // rsqrt
  c.arguments["eps"] = argument_text(1e-6f);
  auto inputs = [weight, bias](const Instance& t) {
    LayernormInputs in;
    in.x = t["x"];
    if (weight) in.weight = t["weight"];
    if (bias) in.bias = t["bias"];
    in.eps = 1e-6f;
    in.numerics = t.numerics;
    return in;
  };
  // The (M, H) rows of grad / dx (offset: starting at element 1 of the flat storage).
  auto rows_of = [offset, M, H](const TensorView& t) {
    if (!offset) return t;
    return TensorView::contiguous(static_cast<char*>(t.data) + dtype_size(t.dtype), t.dtype, {M, H}, t.device);
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return layernorm_forward({inputs(t), t["out"], t["mean"], t["rstd"]}, stream);
  };
  c.backward = [inputs, rows_of, weight, bias](const Instance& t, Stream stream) {
    const TensorView none;
    return layernorm_backward({inputs(t), t["mean"], t["rstd"], rows_of(t["grad"]), rows_of(t["dx"]),
                               weight ? t["d_weight"] : none, bias ? t["d_bias"] : none},
                              stream);
  };
  std::vector<std::string> fwd = {"x", "out", "mean", "rstd"}, bwd = {"x", "mean", "rstd", "grad", "dx"};
  if (weight) {
    fwd.push_back("weight");
    bwd.insert(bwd.end(), {"weight", "d_weight"});
  }
  if (bias) {
    fwd.push_back("bias");
    bwd.push_back("d_bias");
  }
  c.set_bytes(Phase::kForward, fwd);
  c.set_bytes(Phase::kBackward, bwd);
  if (!offset)
    c.alone = [s, seed](int64_t) {
      LayernormShape alone = s;
      alone.rows = 1;
      return layernorm_case(alone, seed);
    };
  return c;
}

std::vector<FormShape> family_bench_forms(const CaseContext& ctx) {
  struct Row {
    int64_t hidden, batch, seq_len;
    ModulationForm form;
    bool wan;  // fp32 modulation, upcast (else x's dtype, each op)
  };
  // Rule: each family's (H, S) at a batch it runs, the Wan-like rows in both
  // of Wan's forms, with B*S*H at most 2^29 (the CPU reference of a case,
  // which bench compares every case with, stays in seconds): Wan 2.1 1.3B
  // (H = 1536, 480p: S = 32760) and 14B (H = 5120, 720p: S = 75600) per
  // sample and per frame F = 21 at B = 1; SD3 Medium (H = 1536, S = 4096)
  // per sample at B = 8; Flux (H = 3072, S = 4096) per sample at B = 2; per
  // token (LTX-Video, Z-Image) at H = 3072, S = 4096, B = 2 and at H3's
  // H = 5376, S = 32760, B = 1. The small set (CPU, --quick): H = 1536,
  // B = 1, one row per form (per frame at S = 4095, F = 21 dividing it).
  static const Row kSmall[] = {{1536, 1, 4096, ModulationForm::kPerSample, false},
                               {1536, 1, 4095, ModulationForm::kPerFrame, true},
                               {1536, 1, 4096, ModulationForm::kPerToken, false}};
  static const Row kFull[] = {
      {1536, 1, 32760, ModulationForm::kPerSample, true}, {1536, 1, 32760, ModulationForm::kPerFrame, true},
      {5120, 1, 75600, ModulationForm::kPerSample, true}, {5120, 1, 75600, ModulationForm::kPerFrame, true},
      {1536, 8, 4096, ModulationForm::kPerSample, false}, {3072, 2, 4096, ModulationForm::kPerSample, false},
      {3072, 2, 4096, ModulationForm::kPerToken, false},  {5376, 1, 32760, ModulationForm::kPerToken, false}};
  const std::vector<Row> rows = ctx.small ? std::vector<Row>(std::begin(kSmall), std::end(kSmall))
                                          : std::vector<Row>(std::begin(kFull), std::end(kFull));
  std::vector<FormShape> forms;
  for (const Row& r : rows) {
    FormShape s;
    s.dtype = DType::kBF16;
    s.mod_dtype = r.wan ? DType::kF32 : DType::kBF16;
    s.upcast = r.wan;
    s.hidden = r.hidden;
    s.batch = r.batch;
    s.seq_len = r.seq_len;
    s.form = r.form;
    s.frames = 21;
    forms.push_back(s);
  }
  return forms;
}

OpCase layernorm_form_case(const FormShape& s, LayernormAffine affine, uint64_t seed, bool verify_values) {
  const FormGeometry g = form_geometry(s);
  const bool modulated = s.form != ModulationForm::kNone, indexed = s.form == ModulationForm::kIndexed;
  const bool upcast = s.upcast, weight = affine != LayernormAffine::kNone, bias = affine == LayernormAffine::kWeightBias;
  const int64_t B = s.batch, S = s.seq_len, H = s.hidden;
  const DType od = form_out_dtype(s);
  OpCase c;
  c.op = "layernorm";
  c.name = std::string(affine_name(affine)) + " " + form_case_name(s);
  c.positions = B * S;
  if (indexed) c.plans.push_back({"plan", g.index, PlanSpec::Rows::kAdaln});
  c.input("x", Phase::kForward, s.dtype, {B, S, H}, form_values(verify_values, seed + 1, 0.0, 3.0));
  if (weight) c.input("weight", Phase::kForward, s.dtype, {H}, form_values(verify_values, seed + 2, 1.0, 0.5));
  if (bias) c.input("bias", Phase::kForward, s.dtype, {H}, form_values(verify_values, seed + 3, 0.0, 0.5));
  if (modulated)
    c.input("modulation", Phase::kForward, s.mod_dtype, g.parent_shape(), form_values(verify_values, seed + 4, 0.0, 0.5));
  c.output("out", Phase::kForward, od, {B, S, H});
  c.output("mean", Phase::kForward, DType::kF32, {B * S});
  c.output("rstd", Phase::kForward, DType::kF32, {B * S});
  c.input("grad", Phase::kBackward, od, {B, S, H}, form_values(verify_values, seed + 5, 0.0, 1.0));
  c.output("dx", Phase::kBackward, s.dtype, {B, S, H});
  if (weight) c.output("d_weight", Phase::kBackward, DType::kF32, {H});
  if (bias) c.output("d_bias", Phase::kBackward, DType::kF32, {H});
  if (modulated) {
    c.output("d_shift", Phase::kBackward, s.grad_dtype, g.view_shape());
    c.output("d_scale", Phase::kBackward, s.grad_dtype, g.view_shape());
  }
  c.takes_profile = true;  // rsqrt
  c.arguments["eps"] = argument_text(kFormEps);
  c.arguments["upcast"] = upcast ? "true" : "false";
  auto inputs = [g, modulated, indexed, weight, bias, upcast](const Instance& t) {
    LayernormInputs in;
    in.x = t["x"];
    if (weight) in.weight = t["weight"];
    if (bias) in.bias = t["bias"];
    if (modulated) {
      in.shift = g.chunk(t["modulation"], 0);
      in.scale = g.chunk(t["modulation"], 1);
    }
    if (indexed) in.plan = t.plan("plan");
    in.eps = kFormEps;
    in.numerics = t.numerics;
    in.upcast = upcast;
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return layernorm_forward({inputs(t), t["out"], t["mean"], t["rstd"]}, stream);
  };
  c.backward = [inputs, modulated, weight, bias](const Instance& t, Stream stream) {
    const TensorView none;
    return layernorm_backward({inputs(t), t["mean"], t["rstd"], t["grad"], t["dx"], weight ? t["d_weight"] : none,
                               bias ? t["d_bias"] : none, modulated ? t["d_shift"] : none,
                               modulated ? t["d_scale"] : none},
                              stream);
  };
  std::vector<std::string> fwd = {"x", "out", "mean", "rstd"}, bwd = {"x", "mean", "rstd", "grad", "dx"};
  add_affine_bytes(weight, bias, &fwd, &bwd);
  const double rows = modulated ? 2.0 * g.elements() * dtype_size(s.mod_dtype) : 0.0;
  const double grads = modulated ? 2.0 * g.elements() * dtype_size(s.grad_dtype) : 0.0;
  c.set_bytes(Phase::kForward, fwd, rows, "shift/scale rows");
  c.set_bytes(Phase::kBackward, bwd, rows / 2 + grads, "scale rows + d_shift + d_scale");
  // docs/numerics.md 9 step by step (oracle.h), nothing shared with the op's
  // CPU reference: every output of both phases.
  const DType mod_dtype = s.mod_dtype;
  c.equivalent.name = "= numerics 9 step by step";
  c.equivalent.compute = [g, modulated, weight, bias, upcast, mod_dtype, S](
                             const std::map<std::string, HostTensor>& got, std::map<std::string, HostTensor>* expected) {
    std::map<std::string, HostTensor>& e = *expected;
    for (const char* name : {"out", "mean", "rstd", "dx", "d_weight", "d_bias", "d_shift", "d_scale"})
      if (got.count(name)) {
        e[name] = HostTensor(got.at(name).dtype(), got.at(name).shape());
        e[name].fill_bytes(kCanary);  // an output the route never writes stays the canary
      }
    LayernormNumericsInputs in;
    in.x = &got.at("x");
    in.weight = weight ? &got.at("weight") : nullptr;
    in.bias = bias ? &got.at("bias") : nullptr;
    in.grad = &got.at("grad");
    if (modulated) {
      in.shift = g.rows(got.at("modulation"), 0);
      in.scale = g.rows(got.at("modulation"), 1);
      in.group_of = g.group_of();
      in.group_len = g.form == ModulationForm::kIndexed ? 0 : S / (g.form == ModulationForm::kPerSample ? 1 : g.frames);
      in.num_rows = g.form == ModulationForm::kIndexed ? g.frames : g.batch * g.frames;
    }
    in.mod_dtype = mod_dtype;
    in.upcast = upcast;
    in.eps = kFormEps;
    auto at = [&e](const char* name) { return e.count(name) ? &e[name] : nullptr; };
    layernorm_numerics9(in, {at("out"), at("mean"), at("rstd"), at("dx"), at("d_weight"), at("d_bias"), at("d_shift"),
                             at("d_scale")});
    return Status::ok_status();
  };
  return c;
}

std::vector<FormShape> layernorm_test_forms(std::initializer_list<TestForm> forms) {
  std::vector<FormShape> shapes;
  for (const TestForm& f : forms) {
    FormShape s;
    s.hidden = f.form == ModulationForm::kPerToken ? 12 : 16;
    s.seq_len = f.form == ModulationForm::kPerToken ? 37 : 294;
    s.form = f.form;
    s.frames = f.frames;
    s.keep_chunk_dim = f.keep;
    shapes.push_back(s);
  }
  return shapes;
}

void add_affine_bytes(bool weight, bool bias, std::vector<std::string>* fwd, std::vector<std::string>* bwd) {
  if (weight) {
    fwd->push_back("weight");
    bwd->insert(bwd->end(), {"weight", "d_weight"});
  }
  if (bias) {
    fwd->push_back("bias");
    bwd->insert(bwd->end(), {"bias", "d_bias"});
  }
}

FormShape layernorm_verify_form(const CaseContext& ctx, ModulationForm form, DType mod_dtype, bool upcast) {
  FormShape s;
  s.mod_dtype = mod_dtype;
  s.hidden = ctx.hidden;
  s.batch = ctx.quick ? 1 : 2;
  s.seq_len = ctx.quick ? 252 : 4095;
  s.form = form;
  s.frames = 21;
  s.upcast = upcast;
  return s;
}

namespace {

std::vector<OpCase> layernorm_form_cases(Suite suite, const CaseContext& ctx) {
  const LayernormAffine affines[] = {LayernormAffine::kNone, LayernormAffine::kWeight, LayernormAffine::kWeightBias};
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const uint64_t seed = 2600;
    // Every form x recipe x affine variant in bf16.
    for (const FormShape& form : layernorm_test_forms({{ModulationForm::kPerSample, 1, false},
                                                       {ModulationForm::kPerSample, 1, true},
                                                       {ModulationForm::kPerFrame, 3, false},
                                                       {ModulationForm::kPerFrame, 3, true},
                                                       {ModulationForm::kPerFrame, 21, false},
                                                       {ModulationForm::kPerToken, 1, false},
                                                       {ModulationForm::kIndexed, 1, false}}))
      for (const TestRecipe& r : kLayernormTestRecipes)
        for (LayernormAffine affine : affines) {
          FormShape s = form;
          s.mod_dtype = r.mod;
          s.upcast = r.upcast;
          cases.push_back(layernorm_form_case(s, affine, seed));
        }
    // The plain norm of a (B, S, H) x in both recipes (9.2's bytes).
    for (bool upcast : {false, true})
      for (LayernormAffine affine : affines) {
        FormShape s{DType::kBF16, DType::kBF16, 16, 2, 294, ModulationForm::kNone};
        s.upcast = upcast;
        cases.push_back(layernorm_form_case(s, affine, seed));
      }
    // Other dtypes, modulation-dtype gradients, wide rows (H = 1032: 258
    // vectors, threads 0 and 1 hold three) and one vector (H = 4: empty
    // partners in every combine).
    FormShape f16{DType::kF16, DType::kF32, 1032, 2, 120, ModulationForm::kPerFrame, 3};
    cases.push_back(layernorm_form_case(f16, LayernormAffine::kWeightBias, seed + 10));
    FormShape f16_up{DType::kF16, DType::kF16, 68, 2, 40, ModulationForm::kPerToken};
    f16_up.upcast = true;
    f16_up.grad_dtype = DType::kF16;
    cases.push_back(layernorm_form_case(f16_up, LayernormAffine::kWeight, seed + 20));
    FormShape bf16_grads{DType::kBF16, DType::kBF16, 16, 2, 294, ModulationForm::kPerFrame, 21};
    bf16_grads.grad_dtype = DType::kBF16;
    cases.push_back(layernorm_form_case(bf16_grads, LayernormAffine::kNone, seed + 30));
    FormShape f32{DType::kF32, DType::kF32, 68, 3, 513, ModulationForm::kPerSample};
    for (bool upcast : {false, true}) {
      f32.upcast = upcast;
      cases.push_back(layernorm_form_case(f32, LayernormAffine::kWeightBias, seed + 40));
    }
    // Wider rows in every form and recipe, fp16 and fp32 too: H = 64 (threads
    // 0..15 hold one vector each) and H = 1032 at B = 2, S = 300 (per token
    // S = 300: its (B, S, 6, H) parent is large, for the GPU); the affine
    // variant rotates.
    struct WideRecipe {
      DType x, mod;
      bool upcast;
    };
    const WideRecipe wide[] = {{DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false},
                               {DType::kBF16, DType::kF32, true},   {DType::kF16, DType::kF16, true},
                               {DType::kF16, DType::kF32, false},   {DType::kF32, DType::kF32, false}};
    int n = 0;
    for (int64_t hidden : {64, 1032})
      for (ModulationForm form : {ModulationForm::kNone, ModulationForm::kPerSample, ModulationForm::kPerFrame,
                                  ModulationForm::kPerToken, ModulationForm::kIndexed})
        for (const WideRecipe& r : wide) {
          FormShape s{r.x, r.mod, hidden, 2, 300, form, 3};
          s.upcast = r.upcast;
          if (form == ModulationForm::kNone) {
            // Without modulation its dtype has no role: bf16 each op is the first recipe's case.
            if (r.x == DType::kBF16 && r.mod != r.x && !r.upcast) continue;
            s.mod_dtype = r.x;
          }
          cases.push_back(layernorm_form_case(s, affines[n++ % 3], seed + 60));
        }
    FormShape narrow{DType::kBF16, DType::kF32, 4, 2, 294, ModulationForm::kIndexed};
    narrow.upcast = true;
    cases.push_back(layernorm_form_case(narrow, LayernormAffine::kWeightBias, seed + 50));
    return cases;
  }
  if (suite == Suite::kBench) {
    for (const FormShape& s : family_bench_forms(ctx)) cases.push_back(layernorm_form_case(s, LayernormAffine::kNone, ctx.seed + 2600));
    return cases;
  }
  // kVerify: Wan's norm (per sample, fp32 modulation, upcast) and the per
  // frame form (F = 21) in bf16, each op, at the weights' H; no affine (the
  // DiTs' modulated norm sites).
  cases.push_back(layernorm_form_case(layernorm_verify_form(ctx, ModulationForm::kPerSample, DType::kF32, true),
                                      LayernormAffine::kNone, ctx.seed + 260, true));
  cases.push_back(layernorm_form_case(layernorm_verify_form(ctx, ModulationForm::kPerFrame, DType::kBF16, false),
                                      LayernormAffine::kWeightBias, ctx.seed + 270, true));
  return cases;
}

std::vector<OpCase> layernorm_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  const LayernormAffine affines[] = {LayernormAffine::kNone, LayernormAffine::kWeight, LayernormAffine::kWeightBias};
  if (suite == Suite::kTest) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      for (LayernormAffine affine : affines) {
        for (int64_t hidden : {4, 12, 68, 2432})
          cases.push_back(layernorm_case({dtype, hidden, 3, affine}, 500));
        for (int64_t rows : {255, 256, 257})
          cases.push_back(layernorm_case({dtype, 20, rows, affine}, 510));
      }
    cases.push_back(layernorm_case({DType::kBF16, 3072, 600, LayernormAffine::kWeightBias, DType::kBF16}, 520));
    cases.push_back(layernorm_case({DType::kF32, 5120, 9, LayernormAffine::kNone, DType::kF32, 100.0}, 530));
    cases.push_back(layernorm_case({DType::kBF16, 1536, 5, LayernormAffine::kWeight, DType::kF32, 1000.0}, 540));
    cases.push_back(
        layernorm_case({DType::kF16, 516, 300, LayernormAffine::kWeightBias, DType::kF16, 0.0, true}, 550));
    cases.push_back(layernorm_case({DType::kBF16, 68, 257, LayernormAffine::kNone, DType::kF32, 0.0, true}, 560));
    return cases;
  }
  if (suite == Suite::kBench) {
    for (int64_t hidden : {1536, 3072, 5120})
      for (int64_t rows : ctx.small ? std::vector<int64_t>{8192} : std::vector<int64_t>{8192, 65536})
        cases.push_back(layernorm_case({DType::kBF16, hidden, rows, LayernormAffine::kNone}, ctx.seed + 900));
    return cases;
  }
  // kVerify: the weights' width, no affine (the DiT norm sites), bf16.
  OpCase c = layernorm_case({DType::kBF16, ctx.hidden, ctx.quick ? 257 : 4097, LayernormAffine::kNone}, ctx.seed + 90);
  c.accuracy.push_back(layernorm_forward_accuracy());
  cases.push_back(std::move(c));
  return cases;
}

std::vector<OpCase> layernorm_and_form_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases = layernorm_cases(suite, ctx);
  for (OpCase& c : layernorm_form_cases(suite, ctx)) cases.push_back(std::move(c));
  return cases;
}

DETDIT_OP_CASES("layernorm", layernorm_and_form_cases);

}  // namespace
}  // namespace cases
}  // namespace detdit
