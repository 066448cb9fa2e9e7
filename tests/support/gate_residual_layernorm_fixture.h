// The test problems of the two gated-residual regions, gate_residual_layernorm
// and gate_residual_rmsnorm (GrlnProblem::norm), shared by the CPU and CUDA
// suites: one problem = a modulation form, a recipe (x and modulation dtypes,
// upcast), an affine variant (rmsnorm: weight only), which modulation tensors
// are present (gate, shift and scale), k, d_h. Its inputs are host tensors drawn from a seed; the
// modulation tensors are chunks 0 (shift), 1 (scale) and 2 (gate) of a
// (G, 6, H) parent, as the models' `.chunk(6, dim=-2)` views make them.
// run_fused runs the region on a device; run_composed runs the two separate
// ops (gate_residual, then layernorm or rmsnorm) on the CPU as autograd
// composes them (the d_h sum written out here).
// The forms sweep (kGrlnForms x kGrlnRecipes, for_each_grln_forms_problem)
// and the output comparisons are the suites' shared checks.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "detdit/gate_residual.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/layernorm.h"
#include "detdit/rmsnorm.h"
#include "cases/index_case.h"
#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {

enum class GrlnAffine { kNone, kWeight, kWeightBias };
// The form of every present modulation tensor: none (gate and norm plain),
// grouped (F frames: 1 per sample, S per token), indexed (a plan over (R, H)).
enum class GrlnKind { kNone, kGrouped, kIndexed };
// The region's norm: gate_residual_layernorm or gate_residual_rmsnorm.
enum class GrlnNorm { kLayernorm, kRmsnorm };

struct GrlnProblem {
  int64_t batch, seq, hidden;
  GrlnKind kind;
  int64_t frames;   // grouped only
  bool with_unit;   // grouped only: the (B, 1, H) / (B, F, 1, H) views
  DType x_dtype, mod_dtype;
  bool upcast;
  GrlnAffine affine;
  bool gate, norm_mod;  // gate present; shift and scale present (kind != kNone)
  bool has_k;
  bool d_h;
  GrlnNorm norm = GrlnNorm::kLayernorm;  // kRmsnorm: affine must be kWeight (RMSNorm's weight)

  bool has_gate() const { return kind != GrlnKind::kNone && gate; }
  bool modulated() const { return kind != GrlnKind::kNone && norm_mod; }
  // gate_residual's out: fp32 for an fp32 gate when each op rounds.
  DType h_dtype() const { return has_gate() && mod_dtype == DType::kF32 && !upcast ? DType::kF32 : x_dtype; }
  // layernorm's out of h.
  DType out_dtype() const {
    return !modulated() || upcast || mod_dtype == h_dtype() ? h_dtype() : DType::kF32;
  }
  int64_t positions() const { return batch * seq; }
  bool layernorm() const { return norm == GrlnNorm::kLayernorm; }
  std::string describe() const {
    const char* k = kind == GrlnKind::kNone ? "none" : kind == GrlnKind::kIndexed ? "indexed" : "grouped";
    const char* a = affine == GrlnAffine::kNone ? "no affine" : affine == GrlnAffine::kWeight ? "weight" : "weight+bias";
    return std::string(layernorm() ? "" : "rmsnorm ") + k + " F=" + std::to_string(frames) + (with_unit ? " (unit dim)" : "") +
           " B=" + std::to_string(batch) + " S=" + std::to_string(seq) + " H=" + std::to_string(hidden) + " x " +
           dtype_name(x_dtype) + " modulation " + dtype_name(mod_dtype) + (upcast ? " upcast" : " each-op") + " " + a +
           (has_gate() ? " gate" : " no gate") + (modulated() ? " shift+scale" : " plain norm") +
           (has_k ? " k" : "") + (d_h ? " d_h" : "");
  }
};

constexpr float kGrlnEps = 1e-6f;
constexpr float kGrlnK = 1.0f;

// A problem's inputs on the host.
struct GrlnInputs {
  GrlnProblem p;
  IndexCase index;
  IndexPlan plan;
  int64_t mod_rows;
  HostTensor parent, residual, y, w, b, d_out, d_h;
  GrlnInputs(const GrlnProblem& problem, uint64_t seed)
      : p(problem),
        index(make_index_case(Packing::kInterleaved, problem.seq, 3, problem.batch)),
        plan(problem.kind == GrlnKind::kIndexed ? adaln_plan(index) : IndexPlan()),
        mod_rows(problem.kind == GrlnKind::kIndexed ? index.num_rows()
                                                     : problem.batch * std::max<int64_t>(problem.frames, 1)),
        parent(random_tensor(problem.mod_dtype, {mod_rows, 6, problem.hidden}, seed + 1, 0.0, 0.5)),
        residual(random_tensor(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}, seed, 0.5, 1.0)),
        y(random_tensor(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}, seed + 2)),
        w(random_tensor(problem.h_dtype(), {problem.hidden}, seed + 3, 1.0, 0.1)),
        b(random_tensor(problem.h_dtype(), {problem.hidden}, seed + 4, 0.0, 0.1)),
        d_out(random_tensor(problem.out_dtype(), {problem.batch, problem.seq, problem.hidden}, seed + 5)),
        d_h(random_tensor(problem.h_dtype(), {problem.batch, problem.seq, problem.hidden}, seed + 6)) {}

  std::vector<int64_t> act_shape() const { return {p.batch, p.seq, p.hidden}; }
  // A modulation gradient: the modulation tensor's shape.
  std::vector<int64_t> mod_shape() const {
    if (p.kind == GrlnKind::kIndexed) return {mod_rows, p.hidden};
    if (p.frames == 1) return p.with_unit ? std::vector<int64_t>{p.batch, 1, p.hidden} : std::vector<int64_t>{p.batch, p.hidden};
    return p.with_unit ? std::vector<int64_t>{p.batch, p.frames, 1, p.hidden}
                       : std::vector<int64_t>{p.batch, p.frames, p.hidden};
  }
  // Chunk c of a parent holding `parent`'s bytes at `base` on `device`.
  TensorView chunk(const void* base, int64_t c, const Device& device) const {
    char* at = static_cast<char*>(const_cast<void*>(base)) + c * p.hidden * static_cast<int64_t>(dtype_size(p.mod_dtype));
    const int64_t h = p.hidden, sf = 6 * h, sb = p.kind == GrlnKind::kIndexed ? sf : p.frames * sf;
    const DType d = p.mod_dtype;
    if (p.kind == GrlnKind::kIndexed) return TensorView::strided(at, d, {mod_rows, h}, {sf, 1}, device);
    if (p.frames == 1)
      return p.with_unit ? TensorView::strided(at, d, {p.batch, 1, h}, {sb, sf, 1}, device)
                         : TensorView::strided(at, d, {p.batch, h}, {sb, 1}, device);
    return p.with_unit ? TensorView::strided(at, d, {p.batch, p.frames, 1, h}, {sb, sf, h, 1}, device)
                       : TensorView::strided(at, d, {p.batch, p.frames, h}, {sb, sf, 1}, device);
  }
};

// The outputs of one run, by name (absent ones are not in the map).
using GrlnOutputs = std::map<std::string, HostTensor>;

// The names, dtypes and shapes of a problem's outputs (forward, then backward).
struct GrlnOutputSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};
inline std::vector<GrlnOutputSpec> grln_output_specs(const GrlnInputs& in) {
  const GrlnProblem& p = in.p;
  std::vector<GrlnOutputSpec> s = {{"h", p.h_dtype(), in.act_shape()},
                                   {"out", p.out_dtype(), in.act_shape()},
                                   {"rstd", DType::kF32, {p.positions()}},
                                   {"d_residual", p.x_dtype, in.act_shape()},
                                   {"d_y", p.x_dtype, in.act_shape()}};
  if (p.layernorm()) s.push_back({"mean", DType::kF32, {p.positions()}});
  if (p.has_gate()) s.push_back({"d_gate", DType::kF32, in.mod_shape()});
  if (p.affine != GrlnAffine::kNone) s.push_back({"d_weight", DType::kF32, {p.hidden}});
  if (p.affine == GrlnAffine::kWeightBias) s.push_back({"d_bias", p.h_dtype(), {p.hidden}});
  if (p.modulated()) {
    s.push_back({"d_shift", DType::kF32, in.mod_shape()});
    s.push_back({"d_scale", p.mod_dtype, in.mod_shape()});
  }
  return s;
}

// Which gradients the fused backward is asked for.
enum class GrlnGrads {
  kAll,           // every one (g in d_residual where it has h's dtype)
  kNoResidual,    // all but d_residual (g in scratch)
  kNormOnly,      // d_weight, d_bias, d_shift, d_scale only (the gate half skipped)
};

// The forward's outputs and the gradients asked for, from the device to the map.
inline Status copy_outputs(const GrlnInputs& in, GrlnGrads grads, std::map<std::string, DeviceTensor>* dev,
                           GrlnOutputs* outputs) {
  for (const GrlnOutputSpec& s : grln_output_specs(in)) {
    if (s.name == "d_residual" && grads != GrlnGrads::kAll) continue;
    if ((s.name == "d_y" || s.name == "d_gate") && grads == GrlnGrads::kNormOnly) continue;
    DETDIT_RETURN_IF_ERROR((*dev)[s.name].to_host(&(*outputs)[s.name]));
  }
  return Status();
}

// gate_residual_rmsnorm's forward and backward of the region's arguments `a`
// (bias unused), the outputs in `view`.
template <typename View>
Status run_fused_rmsnorm(const GrlnProblem& p, const GateResidualLayernormInputs& a, GrlnGrads grads, View&& view) {
  GateResidualRmsnormInputs args{a.residual, a.y, a.gate, a.weight, a.shift, a.scale, a.plan};
  args.has_k = a.has_k;
  args.k = a.k;
  args.eps = a.eps;
  args.upcast = a.upcast;
  DETDIT_RETURN_IF_ERROR(gate_residual_rmsnorm_forward({args, view("h"), view("out"), view("rstd")}));
  GateResidualRmsnormBackwardParams b;
  b.in = args;
  b.h = view("h");
  b.rstd = view("rstd");
  b.d_out = view("d_out");
  if (p.d_h) b.d_h = view("d_h");
  const bool gate_half = grads != GrlnGrads::kNormOnly;
  if (grads == GrlnGrads::kAll) b.d_residual = view("d_residual");
  if (gate_half) {
    b.d_y = view("d_y");
    b.d_gate = view("d_gate");
  }
  b.d_weight = view("d_weight");
  b.d_shift = view("d_shift");
  b.d_scale = view("d_scale");
  return gate_residual_rmsnorm_backward(b);
}

// The fused op on `device`: the forward, then the backward for `grads`; the
// map holds the forward's outputs and the gradients asked for.
inline Status run_fused(const GrlnInputs& in, const Device& device, GrlnGrads grads, GrlnOutputs* outputs) {
  const GrlnProblem& p = in.p;
  std::map<std::string, DeviceTensor> dev;
  for (const auto& [name, host] : std::map<std::string, const HostTensor*>{
           {"parent", &in.parent}, {"residual", &in.residual}, {"y", &in.y}, {"w", &in.w}, {"b", &in.b},
           {"d_out", &in.d_out}, {"d_h", &in.d_h}})
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(*host, device, &dev[name]));
  for (const GrlnOutputSpec& s : grln_output_specs(in))
    DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(s.dtype, s.shape, device, &dev[s.name]));
  GateResidualLayernormInputs args;
  args.residual = dev["residual"].view();
  args.y = dev["y"].view();
  if (p.has_gate()) args.gate = in.chunk(dev["parent"].view().data, 2, device);
  if (p.affine != GrlnAffine::kNone) args.weight = dev["w"].view();
  if (p.affine == GrlnAffine::kWeightBias) args.bias = dev["b"].view();
  if (p.modulated()) {
    args.shift = in.chunk(dev["parent"].view().data, 0, device);
    args.scale = in.chunk(dev["parent"].view().data, 1, device);
  }
  args.plan = in.plan;
  if (p.kind == GrlnKind::kIndexed && device.is_cuda())
    DETDIT_RETURN_IF_ERROR(cases::adaln_plan(in.index, device, &args.plan));
  args.has_k = p.has_k;
  args.k = kGrlnK;
  args.eps = kGrlnEps;
  args.upcast = p.upcast;
  auto view = [&](const char* name) { return dev.count(name) ? dev[name].view() : TensorView(); };
  if (!p.layernorm()) {
    DETDIT_RETURN_IF_ERROR(run_fused_rmsnorm(p, args, grads, view));
    return copy_outputs(in, grads, &dev, outputs);
  }
  DETDIT_RETURN_IF_ERROR(
      gate_residual_layernorm_forward({args, view("h"), view("out"), view("mean"), view("rstd")}));
  GateResidualLayernormBackwardParams b{args, view("h"), view("mean"), view("rstd"), view("d_out")};
  if (p.d_h) b.d_h = view("d_h");
  const bool gate_half = grads != GrlnGrads::kNormOnly;
  if (grads == GrlnGrads::kAll) b.d_residual = view("d_residual");
  if (gate_half) {
    b.d_y = view("d_y");
    b.d_gate = view("d_gate");
  }
  b.d_weight = view("d_weight");
  b.d_bias = view("d_bias");
  b.d_shift = view("d_shift");
  b.d_scale = view("d_scale");
  DETDIT_RETURN_IF_ERROR(gate_residual_layernorm_backward(b));
  return copy_outputs(in, grads, &dev, outputs);
}

// run_composed's layernorm: its forward of h, its backward of d_out with dx into *g.
inline Status run_composed_layernorm(const GrlnInputs& in, GrlnOutputs* outputs, HostTensor* g) {
  const GrlnProblem& p = in.p;
  GrlnOutputs& o = *outputs;
  auto view = [&](const char* name) { return o.count(name) ? o[name].view() : TensorView(); };
  const Device cpu = Device::cpu();
  LayernormInputs norm;
  norm.x = view("h");
  if (p.affine != GrlnAffine::kNone) norm.weight = in.w.view();
  if (p.affine == GrlnAffine::kWeightBias) norm.bias = in.b.view();
  if (p.modulated()) {
    norm.shift = in.chunk(in.parent.data(), 0, cpu);
    norm.scale = in.chunk(in.parent.data(), 1, cpu);
  }
  norm.plan = in.plan;
  norm.eps = kGrlnEps;
  norm.upcast = p.upcast;
  DETDIT_RETURN_IF_ERROR(layernorm_forward({norm, view("out"), view("mean"), view("rstd")}));
  LayernormBackwardParams nb{norm, view("mean"), view("rstd"), in.d_out.view(), g->view(), view("d_weight"),
                             view("d_bias"), view("d_shift"), view("d_scale")};
  return layernorm_backward(nb);
}

// The two ops composed on the CPU as autograd composes them: gate_residual
// forward into h, the norm's (layernorm or rmsnorm) forward of h; its
// backward of d_out (dx), g = R(rn(dx + d_h)) in h's dtype (written out here),
// gate_residual backward of g.
inline Status run_composed(const GrlnInputs& in, GrlnOutputs* outputs) {
  const GrlnProblem& p = in.p;
  GrlnOutputs& o = *outputs;
  for (const GrlnOutputSpec& s : grln_output_specs(in)) {
    o[s.name] = HostTensor(s.dtype, s.shape);
    o[s.name].fill_bytes(kCanary);
  }
  auto view = [&](const char* name) { return o.count(name) ? o[name].view() : TensorView(); };
  const Device cpu = Device::cpu();
  GateResidualInputs gate{in.residual.view(), in.y.view(), TensorView(), in.plan, p.has_k, kGrlnK, p.upcast};
  if (p.has_gate()) gate.gate = in.chunk(in.parent.data(), 2, cpu);
  DETDIT_RETURN_IF_ERROR(gate_residual_forward({gate, view("h")}));
  HostTensor g(p.h_dtype(), in.act_shape());
  if (p.layernorm()) {
    DETDIT_RETURN_IF_ERROR(run_composed_layernorm(in, &o, &g));
  } else {
    RmsnormInputs norm;
    norm.x = view("h");
    norm.weight = in.w.view();
    if (p.modulated()) {
      norm.shift = in.chunk(in.parent.data(), 0, cpu);
      norm.scale = in.chunk(in.parent.data(), 1, cpu);
    }
    norm.plan = in.plan;
    norm.eps = kGrlnEps;
    norm.upcast = p.upcast;
    DETDIT_RETURN_IF_ERROR(rmsnorm_forward({norm, view("out"), view("rstd")}));
    DETDIT_RETURN_IF_ERROR(rmsnorm_backward({norm, view("rstd"), in.d_out.view(), g.view(), view("d_weight"),
                                             view("d_shift"), view("d_scale")}));
  }
  if (p.d_h)
    for (int64_t i = 0; i < g.numel(); ++i)
      g.set(i, static_cast<float>(static_cast<float>(g.get(i)) + static_cast<float>(in.d_h.get(i))));
  return gate_residual_backward({gate, g.view(), view("d_residual"), view("d_y"), view("d_gate")});
}

// The forms sweep the region suites share (CPU and CUDA, both norms): a
// modulation form with its name, and a recipe (x and modulation dtypes,
// upcast).
struct GrlnForm {
  const char* name;
  GrlnKind kind;
  int64_t frames;
  bool with_unit;
};
struct GrlnRecipe {
  DType x, mod;
  bool upcast;
};
constexpr int64_t kGrlnS = 300;  // per sample: 2 chunks of 256 from the group's start
inline constexpr GrlnForm kGrlnForms[] = {{"none", GrlnKind::kNone, 0, false},
                                          {"per_sample (B, H)", GrlnKind::kGrouped, 1, false},
                                          {"per_sample (B, 1, H)", GrlnKind::kGrouped, 1, true},
                                          {"per_frame (B, F, H)", GrlnKind::kGrouped, 3, false},
                                          {"per_frame (B, F, 1, H)", GrlnKind::kGrouped, 3, true},
                                          {"per_token", GrlnKind::kGrouped, kGrlnS, false},
                                          {"indexed", GrlnKind::kIndexed, 0, false}};
inline constexpr GrlnRecipe kGrlnRecipes[] = {
    {DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false}, {DType::kBF16, DType::kF32, true},
    {DType::kF16, DType::kF16, true},    {DType::kF16, DType::kF32, false},  {DType::kF32, DType::kF32, false}};

// Every problem of the sweep, in order: form x recipe x presence x k x d_h
// (B = 2, S = kGrlnS, H = 72), calling fn(form, problem, index) with index
// 0, 1, ... (the suites draw each problem's seed from it); returns how many.
// Presence 0: gate, shift and scale; 1: gate and a plain norm; 2: shift and
// scale without a gate (the none form: presence 0 only). k needs a gate. The
// affine variant: layernorm's cycles with (index + presence) % 3 so that
// every variant meets every form; rmsnorm has its weight only.
template <typename Forms, typename Recipes, typename Fn>
int for_each_grln_forms_problem(const Forms& forms, const Recipes& recipes, GrlnNorm norm, Fn&& fn) {
  int index = 0;
  for (const GrlnForm& f : forms)
    for (const GrlnRecipe& r : recipes)
      for (int presence = 0; presence < (f.kind == GrlnKind::kNone ? 1 : 3); ++presence)
        for (int variant = 0; variant < 4; ++variant) {
          const bool k = variant & 1, d_h = variant & 2;
          if (k && (f.kind == GrlnKind::kNone || presence == 2)) continue;
          const GrlnAffine affine = norm == GrlnNorm::kRmsnorm ? GrlnAffine::kWeight
                                                               : static_cast<GrlnAffine>((index + presence) % 3);
          const GrlnProblem p{2,     kGrlnS,   72,     f.kind,        f.frames,      f.with_unit, r.x,
                              r.mod, r.upcast, affine, presence != 2, presence != 1, k,           d_h,
                              norm};
          fn(f, p, index);
          ++index;
        }
  return index;
}

// Any byte of t is not the canary: the run wrote it.
inline ::testing::AssertionResult grln_written(const HostTensor& t) {
  const auto* bytes = static_cast<const unsigned char*>(t.data());
  for (std::size_t i = 0; i < t.nbytes(); ++i)
    if (bytes[i] != kCanary) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "every byte is still the canary";
}

// Every output of expected is in got, was written, and has got's bytes.
inline void expect_grln_outputs_equal(const GrlnOutputs& expected, const GrlnOutputs& got) {
  for (const auto& [name, e] : expected) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(got.count(name)) << "missing";
    EXPECT_TRUE(grln_written(e));
    EXPECT_BITWISE_EQ(e, got.at(name));
  }
}

// The region on CUDA device 0 byte-equal to the CPU reference, with every
// gradient, with g in scratch, and with the norm's gradients alone.
inline void expect_grln_cuda_equals_cpu(const GrlnInputs& in) {
  for (GrlnGrads grads : {GrlnGrads::kAll, GrlnGrads::kNoResidual, GrlnGrads::kNormOnly}) {
    SCOPED_TRACE(grads == GrlnGrads::kAll ? "every gradient"
                 : grads == GrlnGrads::kNoResidual ? "g in scratch"
                                                   : "the norm's gradients");
    GrlnOutputs cpu, gpu;
    DETDIT_ASSERT_OK(run_fused(in, Device::cpu(), grads, &cpu));
    DETDIT_ASSERT_OK(run_fused(in, Device::cuda(0), grads, &gpu));
    for (const auto& [name, expected] : cpu) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(gpu.count(name));
      EXPECT_BITWISE_EQ(expected, gpu.at(name));
    }
  }
}

// The region on the CPU equal to the two ops composed (run_composed): every
// output and gradient, then with g in scratch (no d_residual), then the
// norm's gradients alone (no g at all).
inline void expect_grln_fused_equals_composed(const GrlnInputs& in) {
  GrlnOutputs composed, fused, fused_scratch, fused_norm_only;
  DETDIT_ASSERT_OK(run_composed(in, &composed));
  DETDIT_ASSERT_OK(run_fused(in, Device::cpu(), GrlnGrads::kAll, &fused));
  expect_grln_outputs_equal(composed, fused);
  DETDIT_ASSERT_OK(run_fused(in, Device::cpu(), GrlnGrads::kNoResidual, &fused_scratch));
  composed.erase("d_residual");
  expect_grln_outputs_equal(composed, fused_scratch);
  DETDIT_ASSERT_OK(run_fused(in, Device::cpu(), GrlnGrads::kNormOnly, &fused_norm_only));
  composed.erase("d_y");
  composed.erase("d_gate");
  expect_grln_outputs_equal(composed, fused_norm_only);
}

// Sample 1 of a batch of 3 (a grouped form, S = kGrlnS, H = 72, seed 7) and
// the same sample alone on the CPU: the same bytes in every row-local output,
// its per-sample / per-frame gradients and its statistics (layernorm: mean
// and rstd; rmsnorm: rstd).
inline void expect_grln_sample_alone_as_in_batch(const GrlnForm& f, const GrlnRecipe& r, GrlnAffine affine,
                                                 GrlnNorm norm) {
  const GrlnProblem batch_p{3,      kGrlnS, 72,   f.kind, f.frames, f.with_unit, r.x, r.mod, r.upcast,
                            affine, true,   true, false,  true,     norm};
  GrlnProblem alone_p = batch_p;
  alone_p.batch = 1;
  SCOPED_TRACE(std::string(f.name) + ": " + batch_p.describe());
  const GrlnInputs batch(batch_p, 7);
  GrlnInputs alone(alone_p, 7);
  for (auto [from, to] : std::vector<std::pair<const HostTensor*, HostTensor*>>{
           {&batch.residual, &alone.residual}, {&batch.y, &alone.y}, {&batch.d_out, &alone.d_out},
           {&batch.d_h, &alone.d_h}})
    copy_row(*from, 1, to, 0);
  // The parent (B*F, 6, H): sample 1's F rows.
  const std::size_t group_rows = static_cast<std::size_t>(f.frames) * 6 * 72 * dtype_size(r.mod);
  std::memcpy(alone.parent.data(), static_cast<const char*>(batch.parent.data()) + group_rows, group_rows);
  GrlnOutputs in_batch, on_its_own;
  DETDIT_ASSERT_OK(run_fused(batch, Device::cpu(), GrlnGrads::kAll, &in_batch));
  DETDIT_ASSERT_OK(run_fused(alone, Device::cpu(), GrlnGrads::kAll, &on_its_own));
  for (const char* name : {"h", "out", "d_residual", "d_y", "d_gate", "d_shift", "d_scale"}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(rows_bitwise_equal(in_batch.at(name), 1, on_its_own.at(name), 0));
  }
  std::vector<const char*> stats = {"rstd"};
  if (norm == GrlnNorm::kLayernorm) stats.insert(stats.begin(), "mean");
  for (const char* name : stats) {
    EXPECT_TRUE(bitwise_equal_bytes(static_cast<const float*>(in_batch.at(name).data()) + kGrlnS,
                                    on_its_own.at(name).data(), kGrlnS, DType::kF32))
        << name;
  }
}

// ---- the regions' bad-input tests

// A problem's outputs on the host, fresh (grln_output_specs).
inline GrlnOutputs grln_host_outputs(const GrlnInputs& in) {
  GrlnOutputs o;
  for (const GrlnOutputSpec& s : grln_output_specs(in)) o[s.name] = HostTensor(s.dtype, s.shape);
  return o;
}

// A grouped problem's arguments on the CPU (Inputs: GateResidualLayernormInputs
// or GateResidualRmsnormInputs): residual, y, weight, and the gate, shift and
// scale as chunks 2, 0 and 1 of the parent (layernorm's bias is its test's).
template <typename Inputs>
Inputs grln_cpu_args(const GrlnInputs& in) {
  const Device cpu = Device::cpu();
  Inputs args;
  args.residual = in.residual.view();
  args.y = in.y.view();
  args.gate = in.chunk(in.parent.data(), 2, cpu);
  args.weight = in.w.view();
  args.shift = in.chunk(in.parent.data(), 0, cpu);
  args.scale = in.chunk(in.parent.data(), 1, cpu);
  return args;
}

// An argument broken: what, the refusal expected (its kind and a part of its
// message) and the change to the forward's and the backward's Params.
template <typename Params, typename BackwardParams>
struct GrlnBad {
  const char* what;
  ErrorKind kind;
  const char* message;
  std::function<void(Params*, BackwardParams*)> mutate;
};

// The bad arguments both regions refuse alike, on the B = 2, S = 12, H = 8
// per-sample problem of grln_cpu_args (bf16 modulation): a per-token gate
// (chunk 2 of token_parent, a (2, 12, 6, 8) bf16 tensor), F = 5 frames
// (refused with `frames_message`), shift without scale, no h, out over y,
// rstd's shape.
template <typename Params, typename BackwardParams>
std::vector<GrlnBad<Params, BackwardParams>> grln_common_bad_inputs(HostTensor* token_parent,
                                                                    const char* frames_message) {
  return {
      {"gate per token, shift and scale per sample", ErrorKind::kValue, "one modulation form",
       [token_parent](auto* f, auto* b) {
         f->in.gate = b->in.gate = TensorView::strided(static_cast<char*>(token_parent->data()) + 2 * 8 * 2,
                                                       DType::kBF16, {2, 12, 8}, {12 * 48, 48, 1});
         b->d_gate = TensorView();  // else refused first as a per-sample d_gate of a per-token gate
       }},
      {"S not a multiple of F", ErrorKind::kValue, frames_message,
       [](auto* f, auto* b) {
         // (B, 5, H): 12 positions in 5 frames.
         for (TensorView* m : {&f->in.gate, &f->in.shift, &f->in.scale, &b->in.gate, &b->in.shift, &b->in.scale})
           *m = TensorView::strided(m->data, m->dtype, {2, 5, 8}, {48, 48, 1});
       }},
      {"no h", ErrorKind::kValue, "h is required", [](auto* f, auto* b) { f->h = b->h = TensorView(); }},
      {"shift without scale", ErrorKind::kValue, "shift without scale",
       [](auto* f, auto* b) { f->in.scale = b->in.scale = TensorView(); }},
      {"out over y / d_y over y", ErrorKind::kValue, "overlap",
       [](auto* f, auto* b) {
         f->out = f->in.y;
         b->d_y = b->in.y;
       }},
      {"rstd shape", ErrorKind::kValue, "rstd must be (M,)",
       [](auto* f, auto* b) { f->rstd.shape[0] = b->rstd.shape[0] = 5; }},
  };
}

// Each bad argument: the outputs `o` and `more` filled with the canary, the
// Params made (make(&f, &b) on o's views), broken, then refused by forward(f)
// and backward(b) with the kind and message, and nothing written.
template <typename Params, typename BackwardParams, typename Make, typename Forward, typename Backward>
void expect_grln_bad_inputs_refused(const std::vector<GrlnBad<Params, BackwardParams>>& cases, GrlnOutputs* o,
                                    const std::vector<HostTensor*>& more, const Make& make, const Forward& forward,
                                    const Backward& backward) {
  for (const GrlnBad<Params, BackwardParams>& bad : cases) {
    SCOPED_TRACE(bad.what);
    std::vector<HostTensor*> outputs = more;
    for (auto& [name, t] : *o) outputs.push_back(&t);
    for (HostTensor* t : outputs) t->fill_bytes(kCanary);
    Params f;
    BackwardParams b;
    make(&f, &b);
    bad.mutate(&f, &b);
    EXPECT_TRUE(refused(forward(f), bad.kind, bad.message)) << "forward";
    EXPECT_TRUE(refused(backward(b), bad.kind, bad.message)) << "backward";
    EXPECT_TRUE(still_canary(outputs));
  }
}

}  // namespace testing
}  // namespace detdit
