// The cases of gate_residual_layernorm (the fused LayerNorm region: h =
// gate_residual(residual, y, gate), out = layernorm(h, shift, scale)), in
// every modulation form of cases/forms_cases.h, each present or absent: the
// gate (chunk 2 of the form's parent), shift and scale (chunks 0 and 1).
//
// Suites: kTest crosses the forms (per sample with the chunk dimension
// dropped and kept, per frame F = 3 kept and F = 21, per token, indexed) with
// {x's dtype, fp32} modulation x {each op, upcast} in bf16 and four variants:
// gate + shift/scale (no k, no d_h), gate + shift/scale with k = 1 and d_h,
// the gate alone (a plain norm) with k, shift/scale without a gate with d_h;
// the affine variant rotates over the cases. Plus no modulation at all in
// both recipes with and without d_h, fp16 and fp32 rows and modulation-dtype
// gradients. kVerify Wan's two sites at the weights' H: the gate per sample
// in fp32 with upcast into the plain affine norm (norm2), and per frame
// F = 21 in bf16, each op, gate and shift/scale with d_h; kBench the
// families' shapes (family_bench_forms) with the gate, shift, scale and d_h.
// Every case's equivalent route is the two separate ops composed on the CPU
// as autograd composes them (docs/numerics.md 9.7), compared bitwise.
#include <map>
#include <string>
#include <vector>

#include "cases/forms_cases.h"
#include "cases/layernorm_cases.h"
#include "cases/op_case.h"
#include "common/backends.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/layernorm.h"

namespace detdit {
namespace cases {

namespace {

constexpr float kEps = 1e-6f;

// The dtypes of the region (numerics 9.7): h is gate_residual's out (fp32 for
// an fp32 gate with each op), out layernorm's of x = h.
DType h_dtype_of(const GateLayernormShape& s, bool gated) {
  return gated && s.form.mod_dtype == DType::kF32 && !s.form.upcast ? DType::kF32 : s.form.dtype;
}
DType out_dtype_of(const GateLayernormShape& s, bool gated, bool modulated) {
  const DType h = h_dtype_of(s, gated);
  return !modulated || s.form.upcast || s.form.mod_dtype == h ? h : DType::kF32;
}

}  // namespace

OpCase gate_residual_layernorm_case(const GateLayernormShape& s, uint64_t seed, bool verify_values) {
  const FormShape& f = s.form;
  const FormGeometry g = form_geometry(f);
  const bool any = f.form != ModulationForm::kNone, indexed = f.form == ModulationForm::kIndexed;
  const bool gated = any && s.gate, modulated = any && s.norm_modulation, has_mod = gated || modulated;
  const bool weight = s.affine != LayernormAffine::kNone, bias = s.affine == LayernormAffine::kWeightBias;
  const bool upcast = f.upcast, has_k = gated && f.has_k, d_h = s.d_h;
  const float k = f.k;
  const int64_t B = f.batch, S = f.seq_len, H = f.hidden;
  const DType hd = h_dtype_of(s, gated), od = out_dtype_of(s, gated, modulated);
  OpCase c;
  c.op = "gate_residual_layernorm";
  FormShape named = f;
  named.has_k = has_k;
  if (!has_mod) named.form = ModulationForm::kNone;
  c.name = std::string(affine_name(s.affine)) + " " + form_case_name(named) +
           (!has_mod ? "" : gated && modulated ? " gate+shift+scale" : gated ? " gate" : " shift+scale") +
           (d_h ? " d_h" : "");
  c.positions = B * S;
  if (indexed && has_mod) c.plans.push_back({"plan", g.index, PlanSpec::Rows::kAdaln});
  c.input("residual", Phase::kForward, f.dtype, {B, S, H}, form_values(verify_values, seed + 1, 0.0, 1.0));
  c.input("y", Phase::kForward, f.dtype, {B, S, H}, form_values(verify_values, seed + 2, 0.0, 3.0));
  if (has_mod)
    c.input("modulation", Phase::kForward, f.mod_dtype, g.parent_shape(), form_values(verify_values, seed + 3, 0.0, 0.5));
  if (weight) c.input("weight", Phase::kForward, hd, {H}, form_values(verify_values, seed + 4, 1.0, 0.5));
  if (bias) c.input("bias", Phase::kForward, hd, {H}, form_values(verify_values, seed + 5, 0.0, 0.5));
  c.output("h", Phase::kForward, hd, {B, S, H});
  c.output("out", Phase::kForward, od, {B, S, H});
  c.output("mean", Phase::kForward, DType::kF32, {B * S});
  c.output("rstd", Phase::kForward, DType::kF32, {B * S});
  c.input("d_out", Phase::kBackward, od, {B, S, H}, form_values(verify_values, seed + 6, 0.0, 1.0));
  if (d_h) c.input("d_h", Phase::kBackward, hd, {B, S, H}, form_values(verify_values, seed + 7, 0.0, 1.0));
  c.output("d_residual", Phase::kBackward, f.dtype, {B, S, H});
  c.output("d_y", Phase::kBackward, f.dtype, {B, S, H});
  if (gated) c.output("d_gate", Phase::kBackward, f.grad_dtype, g.view_shape());
  if (weight) c.output("d_weight", Phase::kBackward, DType::kF32, {H});
  if (bias) c.output("d_bias", Phase::kBackward, DType::kF32, {H});
  if (modulated) {
    c.output("d_shift", Phase::kBackward, f.grad_dtype, g.view_shape());
    c.output("d_scale", Phase::kBackward, f.grad_dtype, g.view_shape());
  }
  c.takes_profile = true;  // the norm's rsqrt
  c.arguments["eps"] = argument_text(kEps);
  c.arguments["upcast"] = upcast ? "true" : "false";
  if (has_k) c.arguments["k"] = argument_text(k);
  // The tensors of one call, from named host or device views (the op's run
  // functions and the equivalent route share them).
  struct Views {
    TensorView gate, shift, scale, weight, bias;
  };
  auto views = [g, gated, modulated, weight, bias](const std::function<TensorView(const char*)>& at) {
    Views v;
    if (gated) v.gate = g.chunk(at("modulation"), 2);
    if (modulated) {
      v.shift = g.chunk(at("modulation"), 0);
      v.scale = g.chunk(at("modulation"), 1);
    }
    if (weight) v.weight = at("weight");
    if (bias) v.bias = at("bias");
    return v;
  };
  const bool planned = indexed && has_mod;
  auto inputs = [views, planned, has_k, k, upcast](const Instance& t) {
    const Views v = views([&t](const char* name) { return t[name]; });
    GateResidualLayernormInputs in;
    in.residual = t["residual"];
    in.y = t["y"];
    in.gate = v.gate;
    in.weight = v.weight;
    in.bias = v.bias;
    in.shift = v.shift;
    in.scale = v.scale;
    if (planned) in.plan = t.plan("plan");
    in.has_k = has_k;
    in.k = k;
    in.eps = kEps;
    in.numerics = t.numerics;
    in.upcast = upcast;
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return gate_residual_layernorm_forward({inputs(t), t["h"], t["out"], t["mean"], t["rstd"]}, stream);
  };
  c.backward = [inputs, gated, modulated, weight, bias, d_h](const Instance& t, Stream stream) {
    const TensorView none;
    GateResidualLayernormBackwardParams b{inputs(t), t["h"], t["mean"], t["rstd"], t["d_out"]};
    if (d_h) b.d_h = t["d_h"];
    b.d_residual = t["d_residual"];
    b.d_y = t["d_y"];
    if (gated) b.d_gate = t["d_gate"];
    if (weight) b.d_weight = t["d_weight"];
    if (bias) b.d_bias = t["d_bias"];
    if (modulated) {
      b.d_shift = t["d_shift"];
      b.d_scale = t["d_scale"];
    }
    return gate_residual_layernorm_backward(b, stream);
  };
  const double mod_rows = g.elements() * dtype_size(f.mod_dtype), grad_rows = g.elements() * dtype_size(f.grad_dtype);
  std::vector<std::string> fwd = {"residual", "y", "h", "out", "mean", "rstd"};
  std::vector<std::string> bwd = {"d_out", "h", "y", "mean", "rstd", "d_residual", "d_y"};
  if (d_h) bwd.push_back("d_h");
  add_affine_bytes(weight, bias, &fwd, &bwd);
  const int read_rows = (gated ? 1 : 0) + (modulated ? 2 : 0), grads = (gated ? 1 : 0) + (modulated ? 2 : 0);
  c.set_bytes(Phase::kForward, fwd, read_rows * mod_rows, "gate/shift/scale rows");
  c.set_bytes(Phase::kBackward, bwd, ((gated ? 1 : 0) + (modulated ? 1 : 0)) * mod_rows + grads * grad_rows,
              "gate/scale rows + d_gate + d_shift + d_scale");
  // The separate ops composed as autograd composes them (numerics 9.7):
  // gate_residual forward into h, layernorm forward of h; layernorm backward
  // of d_out (dx), plus d_h rounded once to h's dtype (add, 5.10), then
  // gate_residual backward of that sum.
  const IndexCase index = g.index;
  c.equivalent.name = "= gate_residual then layernorm";
  c.equivalent.compute = [views, planned, index, has_k, k, upcast, d_h, hd](
                             const std::map<std::string, HostTensor>& got, std::map<std::string, HostTensor>* expected) {
    IndexPlan plan;
    if (planned) DETDIT_RETURN_IF_ERROR(adaln_plan(index, Device::cpu(), &plan));
    std::map<std::string, HostTensor>& e = *expected;
    for (const char* name : {"h", "out", "mean", "rstd", "d_residual", "d_y", "d_gate", "d_weight", "d_bias", "d_shift",
                             "d_scale"})
      if (got.count(name)) {
        e[name] = HostTensor(got.at(name).dtype(), got.at(name).shape());
        e[name].fill_bytes(kCanary);  // an output the route never writes stays the canary
      }
    auto out = [&e](const char* name) { return e.count(name) ? e[name].view() : TensorView(); };
    const Views v = views([&got](const char* name) { return got.at(name).view(); });
    const GateResidualInputs gate_in{got.at("residual").view(), got.at("y").view(), v.gate, plan, has_k, k, upcast};
    DETDIT_RETURN_IF_ERROR(gate_residual_forward({gate_in, out("h")}));
    LayernormInputs norm_in;
    norm_in.x = out("h");
    norm_in.weight = v.weight;
    norm_in.bias = v.bias;
    norm_in.shift = v.shift;
    norm_in.scale = v.scale;
    norm_in.plan = plan;
    norm_in.eps = kEps;
    norm_in.upcast = upcast;
    DETDIT_RETURN_IF_ERROR(layernorm_forward({norm_in, out("out"), out("mean"), out("rstd")}));
    HostTensor g(hd, e["h"].shape());  // the gradient reaching h
    DETDIT_RETURN_IF_ERROR(layernorm_backward({norm_in, out("mean"), out("rstd"), got.at("d_out").view(), g.view(),
                                               out("d_weight"), out("d_bias"), out("d_shift"), out("d_scale")}));
    if (d_h) DETDIT_RETURN_IF_ERROR(cpu::add(g.view(), got.at("d_h").view(), g.view(), nullptr));
    return gate_residual_backward({gate_in, g.view(), out("d_residual"), out("d_y"), out("d_gate")});
  };
  return c;
}

namespace {

std::vector<OpCase> gate_residual_layernorm_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const uint64_t seed = 2800;
    struct Variant {
      bool gate, norm_modulation, k, d_h;
    };
    const Variant variants[] = {{true, true, false, false}, {true, true, true, true}, {true, false, true, false},
                                {false, true, false, true}};
    int n = 0;
    for (const FormShape& form : layernorm_test_forms({{ModulationForm::kPerSample, 1, false},
                                                       {ModulationForm::kPerSample, 1, true},
                                                       {ModulationForm::kPerFrame, 3, true},
                                                       {ModulationForm::kPerFrame, 21, false},
                                                       {ModulationForm::kPerToken, 1, false},
                                                       {ModulationForm::kIndexed, 1, false}}))
      for (const TestRecipe& r : kLayernormTestRecipes)
        for (const Variant& v : variants) {
          GateLayernormShape s;
          s.form = form;
          s.form.mod_dtype = r.mod;
          s.form.upcast = r.upcast;
          s.form.has_k = v.k;
          s.form.k = v.k ? 1.0f : 0.0f;
          s.gate = v.gate;
          s.norm_modulation = v.norm_modulation;
          s.d_h = v.d_h;
          s.affine = static_cast<LayernormAffine>(n++ % 3);
          cases.push_back(gate_residual_layernorm_case(s, seed));
        }
    // No modulation: the plain add, then the plain norm, in both recipes.
    for (bool upcast : {false, true})
      for (bool d_h : {false, true}) {
        GateLayernormShape s;
        s.form = FormShape{DType::kBF16, DType::kBF16, 16, 2, 294, ModulationForm::kNone};
        s.form.upcast = upcast;
        s.affine = LayernormAffine::kWeightBias;
        s.d_h = d_h;
        cases.push_back(gate_residual_layernorm_case(s, seed));
      }
    // fp16 with fp32 modulation and wide rows; fp32; modulation-dtype gradients.
    GateLayernormShape f16;
    f16.form = FormShape{DType::kF16, DType::kF32, 1032, 2, 120, ModulationForm::kPerFrame, 3};
    f16.form.has_k = true;
    f16.form.k = 0.5f;
    f16.affine = LayernormAffine::kWeightBias;
    f16.d_h = true;
    cases.push_back(gate_residual_layernorm_case(f16, seed + 10));
    GateLayernormShape f32;
    f32.form = FormShape{DType::kF32, DType::kF32, 68, 3, 513, ModulationForm::kPerSample};
    for (bool upcast : {false, true}) {
      f32.form.upcast = upcast;
      cases.push_back(gate_residual_layernorm_case(f32, seed + 20));
    }
    GateLayernormShape grads;
    grads.form = FormShape{DType::kBF16, DType::kBF16, 16, 2, 294, ModulationForm::kPerFrame, 21};
    grads.form.grad_dtype = DType::kBF16;
    grads.d_h = true;
    cases.push_back(gate_residual_layernorm_case(grads, seed + 30));
    return cases;
  }
  if (suite == Suite::kBench) {
    for (const FormShape& f : family_bench_forms(ctx)) {
      GateLayernormShape s;
      s.form = f;
      s.d_h = true;  // the residual stream's gradient
      cases.push_back(gate_residual_layernorm_case(s, ctx.seed + 2800));
    }
    return cases;
  }
  // kVerify (B = 2, S = 4095; --quick B = 1, S = 252): Wan's gate_msa into
  // norm2 (per sample, fp32 gate, upcast, affine norm without modulation) and
  // per frame F = 21 in bf16, each op, with shift, scale and d_h.
  GateLayernormShape wan;
  wan.form = layernorm_verify_form(ctx, ModulationForm::kPerSample, DType::kF32, true);
  wan.norm_modulation = false;
  wan.affine = LayernormAffine::kWeightBias;
  cases.push_back(gate_residual_layernorm_case(wan, ctx.seed + 280, true));
  GateLayernormShape frames;
  frames.form = layernorm_verify_form(ctx, ModulationForm::kPerFrame, DType::kBF16, false);
  frames.d_h = true;
  cases.push_back(gate_residual_layernorm_case(frames, ctx.seed + 290, true));
  return cases;
}

DETDIT_OP_CASES("gate_residual_layernorm", gate_residual_layernorm_cases);

}  // namespace
}  // namespace cases
}  // namespace detdit
