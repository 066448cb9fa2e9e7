// The modulation forms' cases of rmsnorm and gate_residual: per sample, per
// frame, per token and none (detdit/modulation.h), modulation in fp32 or x's
// dtype, both recipes (upcast false / true), and for gate_residual the
// constant k and an absent gate.
//
// Suites: kTest crosses every form and view (chunk dimension dropped or kept)
// with {x's dtype, fp32} modulation and {upcast false, true} (gate_residual
// also {no k, k = 1}) at B = 2, S = 300 (a per-sample group of 300 positions
// is two reduction chunks, 256 + 44, counted from the sample's first
// position; per frame F = 3), small enough for the Python export, plus wider
// rows (H = 68, 1028) at B = 3, S = 513 in bf16, fp16 and fp32; kVerify the
// weights' H at verify's sizes in the two recipes of the families (Wan: per
// sample, fp32 modulation, upcast; per frame F = 21 in bf16, each op);
// kBench the families' shapes (bf16, H from the weights, B = 2, S = 4095 and
// 32760: per sample and per frame F = 21 with fp32 modulation and upcast, per
// token in bf16). Every 16-bit case carries an FP64 accuracy check
// (cases/oracle.h) that op_cases_test runs on the CPU and verify reports.
#include "cases/forms_cases.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "cases/oracle.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace cases {

std::vector<int64_t> FormGeometry::parent_shape() const {
  if (form == ModulationForm::kPerSample) return {batch, 6, hidden};
  if (form == ModulationForm::kIndexed) return {frames, 6, hidden};
  return {batch, frames, 6, hidden};
}

std::vector<int64_t> FormGeometry::view_shape() const {
  if (form == ModulationForm::kIndexed) return {frames, hidden};
  if (form == ModulationForm::kPerSample)
    return keep_chunk_dim ? std::vector<int64_t>{batch, 1, hidden} : std::vector<int64_t>{batch, hidden};
  return keep_chunk_dim ? std::vector<int64_t>{batch, frames, 1, hidden} : std::vector<int64_t>{batch, frames, hidden};
}

TensorView FormGeometry::chunk(const TensorView& parent, int c) const {
  char* base = static_cast<char*>(parent.data) + c * hidden * static_cast<int64_t>(dtype_size(parent.dtype));
  const int64_t group = 6 * hidden, sb = frames * group;
  if (form == ModulationForm::kIndexed)
    return TensorView::strided(base, parent.dtype, {frames, hidden}, {group, 1}, parent.device);
  if (form == ModulationForm::kPerSample)
    return keep_chunk_dim
               ? TensorView::strided(base, parent.dtype, {batch, 1, hidden}, {sb, hidden, 1}, parent.device)
               : TensorView::strided(base, parent.dtype, {batch, hidden}, {sb, 1}, parent.device);
  return keep_chunk_dim ? TensorView::strided(base, parent.dtype, {batch, frames, 1, hidden}, {sb, group, hidden, 1},
                                              parent.device)
                        : TensorView::strided(base, parent.dtype, {batch, frames, hidden}, {sb, group, 1}, parent.device);
}

std::vector<int64_t> FormGeometry::group_of() const {
  if (form == ModulationForm::kIndexed) return adaln_rows_of_positions(index);
  std::vector<int64_t> g(batch * seq_len);
  const int64_t frame_len = seq_len / frames;
  for (int64_t p = 0; p < batch * seq_len; ++p) g[p] = (p / seq_len) * frames + (p % seq_len) / frame_len;
  return g;
}

FormGeometry form_geometry(const FormShape& s) {
  int64_t frames = s.frames;
  IndexCase index;
  if (s.form == ModulationForm::kPerSample) frames = 1;
  if (s.form == ModulationForm::kPerToken) frames = s.seq_len;
  if (s.form == ModulationForm::kIndexed) {
    index = make_index_case(Packing::kInterleaved, s.seq_len, 3, s.batch);
    frames = index.num_rows();
  }
  return {s.batch, s.seq_len, s.hidden, frames, s.keep_chunk_dim, s.form, index};
}

DType form_out_dtype(const FormShape& s) {
  const bool modulated = s.form != ModulationForm::kNone;
  return modulated && !s.upcast && s.mod_dtype == DType::kF32 ? DType::kF32 : s.dtype;
}

std::string form_case_name(const FormShape& s) {
  const FormGeometry g = form_geometry(s);
  std::string name = std::string(modulation_form_name(s.form));
  if (s.form == ModulationForm::kPerFrame) name += " F=" + std::to_string(g.frames);
  if (s.form != ModulationForm::kNone) {
    // no commas: bench and verify take lists of case names separated by commas
    std::string dims;
    for (int64_t d : g.view_shape()) dims += (dims.empty() ? "" : "x") + std::to_string(d);
    name += " [" + dims + "] " + dtype_name(s.mod_dtype) + " modulation";
  }
  name += std::string(" ") + dtype_name(s.dtype) + " x H=" + std::to_string(s.hidden) + " B=" +
          std::to_string(s.batch) + " S=" + std::to_string(s.seq_len) + (s.upcast ? " upcast" : " each op");
  if (s.has_k) name += " k=" + argument_text(s.k);
  if (s.form != ModulationForm::kNone && s.grad_dtype != DType::kF32)
    name += std::string(" grads ") + dtype_name(s.grad_dtype);
  return name;
}

Fill form_values(bool verify_values, uint64_t seed, double mean, double std) {
  if (!verify_values) return uniform_values(seed, mean, std);
  return [seed, mean, std](HostTensor* t) { fill_stream_normal(t, seed, "verify", mean, std); };
}

namespace {

using Geometry = FormGeometry;

// u: the unit roundoff of a 16-bit dtype (one rounding errs by at most u relative).
double unit_roundoff(DType dtype) { return dtype == DType::kBF16 ? 0x1p-8 : 0x1p-11; }

// |got - exact| / (|product| + |exact|) (0/0 counts as 0, x/0 as infinite).
double scaled_error(double got, double exact, double product) {
  const double err = std::fabs(got - exact), scale = std::fabs(product) + std::fabs(exact);
  if (err == 0) return 0;
  return scale == 0 ? INFINITY : err / scale;
}

double worst_scaled_error(const HostTensor& out, const ModulatedExact& e, double u) {
  double worst = 0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double err = scaled_error(out.get(i), e.exact[i], e.product[i]);
    if (std::isnan(err)) return NAN;  // fails the check
    worst = std::max(worst, err);
  }
  return worst / u;
}

// The FP64 accuracy of the forward (x 16-bit), in units of u(T) of |product| +
// |exact| (oracle.h). Each rounding to T errs by u of the value it rounds,
// first order u|product| for n, 1 + scale, the product and k + gate, u|out|
// for the sum; roundings to fp32 (2^-24) and the FP32 statistics (~1e-6
// relative) add under 0.01 u. So: rmsnorm each op with x's-dtype modulation
// (n, 1 + scale, the product, the sum) 3 u plus margin: 3.1; with fp32
// modulation only n rounds to T: 1.01; upcast (one rounding at the end): 1.01.
// gate_residual each op in T: product and sum 1.01, with k also k + gate: 2.01;
// fp32 gate (fp32 throughout) and upcast (one rounding): 1.01.
AccuracyCheck rmsnorm_form_accuracy(const FormShape& s, const Geometry& g) {
  AccuracyCheck a;
  a.name = "accuracy vs fp64";
  const bool same = !s.upcast && s.mod_dtype == s.dtype && s.form != ModulationForm::kNone;
  a.bound = same ? 3.1 : 1.01;
  a.unit = std::string("u=") + (s.dtype == DType::kBF16 ? "2^-8" : "2^-11") + " of |n(1+s)|+|out|";
  const double u = unit_roundoff(s.dtype);
  const bool modulated = s.form != ModulationForm::kNone;
  a.error = [g, u, modulated](const std::map<std::string, HostTensor>& t) {
    const HostTensor* parent = modulated ? &t.at("modulation") : nullptr;
    const ModulationRows shift = parent ? g.rows(*parent, 0) : ModulationRows{};
    const ModulationRows scale = parent ? g.rows(*parent, 1) : ModulationRows{};
    const ModulatedExact e = rmsnorm_exact64(t.at("x"), t.at("weight"), shift, scale, g.group_of(),
                                             RmsnormInputs{}.eps);
    return worst_scaled_error(t.at("out"), e, u);
  };
  return a;
}

AccuracyCheck gate_residual_form_accuracy(const FormShape& s, const Geometry& g) {
  AccuracyCheck a;
  a.name = "accuracy vs fp64";
  const bool gated = s.form != ModulationForm::kNone;
  a.bound = gated && s.has_k && !s.upcast && s.mod_dtype == s.dtype ? 2.01 : 1.01;
  a.unit = std::string("u=") + (s.dtype == DType::kBF16 ? "2^-8" : "2^-11") + " of |(k+g) y|+|out|";
  const double u = unit_roundoff(s.dtype), k = s.has_k ? s.k : 0.0;
  a.error = [g, u, gated, k](const std::map<std::string, HostTensor>& t) {
    const ModulationRows gate = gated ? g.rows(t.at("modulation"), 2) : ModulationRows{};
    const ModulatedExact e = gate_residual_exact64(t.at("residual"), t.at("y"), gate, g.group_of(), k);
    return worst_scaled_error(t.at("out"), e, u);
  };
  return a;
}

}  // namespace

OpCase rmsnorm_form_case(const FormShape& s, uint64_t seed, bool verify_values) {
  const Geometry g = form_geometry(s);
  const bool modulated = s.form != ModulationForm::kNone, upcast = s.upcast;
  const int64_t B = s.batch, S = s.seq_len, H = s.hidden;
  const DType od = form_out_dtype(s);
  OpCase c;
  c.op = "rmsnorm";
  c.name = form_case_name(s);
  c.positions = B * S;
  c.input("x", Phase::kForward, s.dtype, {B, S, H}, form_values(verify_values, seed + 1, 0.0, 3.0));
  c.input("weight", Phase::kForward, s.dtype, {H}, form_values(verify_values, seed + 2, 1.0, 0.5));
  if (modulated) c.input("modulation", Phase::kForward, s.mod_dtype, g.parent_shape(), form_values(verify_values, seed + 3, 0.0, 0.5));
  c.output("out", Phase::kForward, od, {B, S, H});
  c.output("rstd", Phase::kForward, DType::kF32, {B * S});
  c.input("grad", Phase::kBackward, od, {B, S, H}, form_values(verify_values, seed + 5, 0.0, 1.0));
  c.output("dx", Phase::kBackward, s.dtype, {B, S, H});
  c.output("d_weight", Phase::kBackward, DType::kF32, {H});
  if (modulated) {
    c.output("d_shift", Phase::kBackward, s.grad_dtype, g.view_shape());
    c.output("d_scale", Phase::kBackward, s.grad_dtype, g.view_shape());
  }
  c.takes_profile = true;  // rsqrt
  c.arguments["eps"] = argument_text(RmsnormInputs{}.eps);
  c.arguments["upcast"] = upcast ? "true" : "false";
  auto inputs = [g, modulated, upcast](const Instance& t) {
    RmsnormInputs in;
    in.x = t["x"];
    in.weight = t["weight"];
    in.numerics = t.numerics;
    in.upcast = upcast;
    if (modulated) {
      in.shift = g.chunk(t["modulation"], 0);
      in.scale = g.chunk(t["modulation"], 1);
    }
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return rmsnorm_forward({inputs(t), t["out"], t["rstd"]}, stream);
  };
  c.backward = [inputs, modulated](const Instance& t, Stream stream) {
    const TensorView none;
    return rmsnorm_backward({inputs(t), t["rstd"], t["grad"], t["dx"], t["d_weight"],
                             modulated ? t["d_shift"] : none, modulated ? t["d_scale"] : none},
                            stream);
  };
  const double rows = modulated ? 2.0 * g.elements() * dtype_size(s.mod_dtype) : 0.0;
  const double grads = modulated ? 2.0 * g.elements() * dtype_size(s.grad_dtype) : 0.0;
  c.set_bytes(Phase::kForward, {"x", "weight", "out", "rstd"}, rows, "shift/scale rows");
  c.set_bytes(Phase::kBackward, {"x", "grad", "rstd", "weight", "dx", "d_weight"}, rows / 2 + grads,
              "scale rows + d_shift + d_scale");
  if (s.dtype != DType::kF32) c.accuracy.push_back(rmsnorm_form_accuracy(s, g));
  return c;
}

OpCase gate_residual_form_case(const FormShape& s, uint64_t seed, bool verify_values) {
  const Geometry g = form_geometry(s);
  const bool gated = s.form != ModulationForm::kNone, upcast = s.upcast, has_k = s.has_k;
  const float k = s.k;
  const int64_t B = s.batch, S = s.seq_len, H = s.hidden;
  const DType od = form_out_dtype(s);
  OpCase c;
  c.op = "gate_residual";
  c.name = form_case_name(s);
  c.positions = B * S;
  c.input("residual", Phase::kForward, s.dtype, {B, S, H}, form_values(verify_values, seed + 11, 0.0, 1.0));
  c.input("y", Phase::kForward, s.dtype, {B, S, H}, form_values(verify_values, seed + 12, 0.0, 3.0));
  if (gated) c.input("modulation", Phase::kForward, s.mod_dtype, g.parent_shape(), form_values(verify_values, seed + 13, 0.0, 0.5));
  c.output("out", Phase::kForward, od, {B, S, H});
  c.input("grad", Phase::kBackward, od, {B, S, H}, form_values(verify_values, seed + 14, 0.0, 1.0));
  c.output("d_residual", Phase::kBackward, s.dtype, {B, S, H});
  c.output("d_y", Phase::kBackward, s.dtype, {B, S, H});
  if (gated) c.output("d_gate", Phase::kBackward, s.grad_dtype, g.view_shape());
  c.arguments["upcast"] = upcast ? "true" : "false";
  if (has_k) c.arguments["k"] = argument_text(k);
  auto inputs = [g, gated, upcast, has_k, k](const Instance& t) {
    GateResidualInputs in;
    in.residual = t["residual"];
    in.y = t["y"];
    if (gated) in.gate = g.chunk(t["modulation"], 2);
    in.has_k = has_k;
    in.k = k;
    in.upcast = upcast;
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return gate_residual_forward({inputs(t), t["out"]}, stream);
  };
  c.backward = [inputs, gated](const Instance& t, Stream stream) {
    return gate_residual_backward({inputs(t), t["grad"], t["d_residual"], t["d_y"], gated ? t["d_gate"] : TensorView()},
                                  stream);
  };
  const double rows = gated ? g.elements() * dtype_size(s.mod_dtype) : 0.0;
  const double grads = gated ? g.elements() * dtype_size(s.grad_dtype) : 0.0;
  c.set_bytes(Phase::kForward, {"residual", "y", "out"}, rows, "gate rows");
  c.set_bytes(Phase::kBackward, {"grad", "y", "d_residual", "d_y"}, rows + grads, "gate rows + d_gate");
  if (s.dtype != DType::kF32) c.accuracy.push_back(gate_residual_form_accuracy(s, g));
  return c;
}

OpCase gate_residual_rmsnorm_form_case(const FormShape& s, uint64_t seed, bool verify_values) {
  const Geometry g = form_geometry(s);
  const bool gated = s.form != ModulationForm::kNone, upcast = s.upcast, has_k = s.has_k;
  const float k = s.k;
  const int64_t B = s.batch, S = s.seq_len, H = s.hidden;
  // h: gate_residual's out; out: rmsnorm's of h. Both fp32 for fp32
  // modulation with upcast = false, else x's dtype (5.12).
  const DType hd = form_out_dtype(s), od = form_out_dtype(s);
  OpCase c;
  c.op = "gate_residual_rmsnorm";
  c.name = form_case_name(s);
  c.positions = B * S;
  c.input("residual", Phase::kForward, s.dtype, {B, S, H}, form_values(verify_values, seed + 31, 0.0, 1.0));
  c.input("y", Phase::kForward, s.dtype, {B, S, H}, form_values(verify_values, seed + 32, 0.0, 3.0));
  if (gated) c.input("modulation", Phase::kForward, s.mod_dtype, g.parent_shape(), form_values(verify_values, seed + 33, 0.0, 0.5));
  c.input("weight", Phase::kForward, hd, {H}, form_values(verify_values, seed + 34, 1.0, 0.5));
  c.output("h", Phase::kForward, hd, {B, S, H});
  c.output("out", Phase::kForward, od, {B, S, H});
  c.output("rstd", Phase::kForward, DType::kF32, {B * S});
  c.input("d_out", Phase::kBackward, od, {B, S, H}, form_values(verify_values, seed + 35, 0.0, 1.0));
  c.input("d_h", Phase::kBackward, hd, {B, S, H}, form_values(verify_values, seed + 36, 0.0, 1.0));
  c.output("d_residual", Phase::kBackward, s.dtype, {B, S, H});
  c.output("d_y", Phase::kBackward, s.dtype, {B, S, H});
  c.output("d_weight", Phase::kBackward, DType::kF32, {H});
  if (gated) {
    c.output("d_gate", Phase::kBackward, s.grad_dtype, g.view_shape());
    c.output("d_shift", Phase::kBackward, s.grad_dtype, g.view_shape());
    c.output("d_scale", Phase::kBackward, s.grad_dtype, g.view_shape());
  }
  c.takes_profile = true;  // the norm's rsqrt
  c.arguments["eps"] = argument_text(GateResidualRmsnormInputs{}.eps);
  c.arguments["upcast"] = upcast ? "true" : "false";
  if (has_k) c.arguments["k"] = argument_text(k);
  auto inputs = [g, gated, upcast, has_k, k](const Instance& t) {
    GateResidualRmsnormInputs in;
    in.residual = t["residual"];
    in.y = t["y"];
    in.weight = t["weight"];
    if (gated) {
      in.gate = g.chunk(t["modulation"], 2);
      in.shift = g.chunk(t["modulation"], 3);
      in.scale = g.chunk(t["modulation"], 4);
    }
    in.numerics = t.numerics;
    in.has_k = has_k;
    in.k = k;
    in.upcast = upcast;
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return gate_residual_rmsnorm_forward({inputs(t), t["h"], t["out"], t["rstd"]}, stream);
  };
  c.backward = [inputs, gated](const Instance& t, Stream stream) {
    const TensorView none;
    return gate_residual_rmsnorm_backward({inputs(t), t["h"], t["rstd"], t["d_out"], t["d_h"], t["d_residual"],
                                           t["d_y"], gated ? t["d_gate"] : none, t["d_weight"],
                                           gated ? t["d_shift"] : none, gated ? t["d_scale"] : none},
                                          stream);
  };
  const double rows = gated ? g.elements() * dtype_size(s.mod_dtype) : 0.0;
  const double grads = gated ? g.elements() * dtype_size(s.grad_dtype) : 0.0;
  c.set_bytes(Phase::kForward, {"residual", "y", "weight", "h", "out", "rstd"}, 3 * rows, "gate/shift/scale rows");
  c.set_bytes(Phase::kBackward, {"d_out", "d_h", "h", "y", "rstd", "weight", "d_residual", "d_y", "d_weight"},
              2 * rows + 3 * grads, "gate/scale rows + d_gate + d_shift + d_scale");
  // The separate ops' CPU results composed as autograd composes them
  // (numerics 6.10): gate_residual forward into h, rmsnorm forward of h;
  // rmsnorm backward of d_out with dx into g, g = R(rn(g + d_h)) in h's dtype
  // (written out here), gate_residual backward of g.
  c.equivalent.name = "= gate_residual then rmsnorm";
  c.equivalent.compute = [g, gated, upcast, has_k, k, hd](const std::map<std::string, HostTensor>& got,
                                                          std::map<std::string, HostTensor>* expected) {
    std::map<std::string, HostTensor>& e = *expected;
    for (const char* name : {"h", "out", "rstd", "d_residual", "d_y", "d_weight", "d_gate", "d_shift", "d_scale"})
      if (got.count(name)) e[name] = HostTensor(got.at(name).dtype(), got.at(name).shape());
    auto view = [&e](const char* name) { return e.count(name) ? e[name].view() : TensorView(); };
    const TensorView parent = gated ? got.at("modulation").view() : TensorView();
    GateResidualInputs gate_in;
    gate_in.residual = got.at("residual").view();
    gate_in.y = got.at("y").view();
    if (gated) gate_in.gate = g.chunk(parent, 2);
    gate_in.has_k = has_k;
    gate_in.k = k;
    gate_in.upcast = upcast;
    DETDIT_RETURN_IF_ERROR(gate_residual_forward({gate_in, view("h")}));
    RmsnormInputs norm_in;
    norm_in.x = view("h");
    norm_in.weight = got.at("weight").view();
    if (gated) {
      norm_in.shift = g.chunk(parent, 3);
      norm_in.scale = g.chunk(parent, 4);
    }
    norm_in.upcast = upcast;
    DETDIT_RETURN_IF_ERROR(rmsnorm_forward({norm_in, view("out"), view("rstd")}));
    HostTensor grad_h(hd, got.at("h").shape());
    DETDIT_RETURN_IF_ERROR(rmsnorm_backward({norm_in, view("rstd"), got.at("d_out").view(), grad_h.view(),
                                             view("d_weight"), view("d_shift"), view("d_scale")}));
    const HostTensor& d_h = got.at("d_h");
    for (int64_t i = 0; i < grad_h.numel(); ++i)
      grad_h.set(i, static_cast<float>(static_cast<float>(grad_h.get(i)) + static_cast<float>(d_h.get(i))));
    return gate_residual_backward({gate_in, grad_h.view(), view("d_residual"), view("d_y"), view("d_gate")});
  };
  return c;
}

namespace {

// Every grouped form and view at B x S (per frame: F = 3), H (per token:
// H_token, S_token: its (B, S, 6, H) parent grows with S).
std::vector<FormShape> grouped_forms(DType dtype, int64_t hidden, int64_t batch, int64_t seq_len) {
  std::vector<FormShape> forms;
  for (ModulationForm form : {ModulationForm::kPerSample, ModulationForm::kPerFrame, ModulationForm::kPerToken})
    for (bool keep : {false, true}) {
      FormShape s;
      s.dtype = dtype;
      s.hidden = hidden;
      s.batch = batch;
      s.seq_len = seq_len;
      s.form = form;
      s.frames = 3;
      s.keep_chunk_dim = keep;
      forms.push_back(s);
    }
  return forms;
}

// The test suite's forms: B = 2, S = 300, H = 4 (per token S = 37, H = 12).
std::vector<FormShape> small_forms() {
  std::vector<FormShape> forms;
  for (FormShape s : grouped_forms(DType::kBF16, 4, 2, 300)) {
    if (s.form == ModulationForm::kPerToken) {
      s.seq_len = 37;
      s.hidden = 12;
    }
    forms.push_back(s);
  }
  return forms;
}

// verify's S (divisible by F = 21): 4095 (--quick: 252), B = 2 (--quick: 1).
FormShape verify_form(const CaseContext& ctx, ModulationForm form, DType mod_dtype, bool upcast) {
  FormShape s;
  s.dtype = DType::kBF16;
  s.mod_dtype = mod_dtype;
  s.hidden = ctx.hidden;
  s.batch = ctx.quick ? 1 : 2;
  s.seq_len = ctx.quick ? 252 : 4095;
  s.form = form;
  s.frames = 21;
  s.upcast = upcast;
  return s;
}

// The families' bench shapes: bf16, the weights' H, B = 2, S = 4095 and 32760
// (small: 4095), per sample and per frame (F = 21) with fp32 modulation and
// upcast (Wan), per token in bf16, each op (LTX-Video, Z-Image).
std::vector<FormShape> bench_forms(const CaseContext& ctx) {
  std::vector<FormShape> forms;
  for (int64_t seq_len : ctx.small ? std::vector<int64_t>{4095} : std::vector<int64_t>{4095, 32760})
    for (ModulationForm form : {ModulationForm::kPerSample, ModulationForm::kPerFrame, ModulationForm::kPerToken}) {
      FormShape s;
      s.dtype = DType::kBF16;
      s.hidden = ctx.hidden;
      s.batch = 2;
      s.seq_len = seq_len;
      s.form = form;
      s.frames = 21;
      const bool token = form == ModulationForm::kPerToken;
      s.mod_dtype = token ? DType::kBF16 : DType::kF32;
      s.upcast = !token;
      forms.push_back(s);
    }
  return forms;
}

}  // namespace

std::vector<OpCase> rmsnorm_form_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const uint64_t seed = 2000;
    for (FormShape s : small_forms())
      for (DType mod : {DType::kBF16, DType::kF32})
        for (bool upcast : {false, true}) {
          s.mod_dtype = mod;
          s.upcast = upcast;
          cases.push_back(rmsnorm_form_case(s, seed));
        }
    // The plain norm of a (B, S, H) x in both recipes (5.6's bytes).
    for (bool upcast : {false, true}) {
      FormShape s{DType::kBF16, DType::kBF16, 4, 2, 300, ModulationForm::kNone};
      s.upcast = upcast;
      cases.push_back(rmsnorm_form_case(s, seed));
    }
    // Wider rows, three samples of 513 positions (three chunks each), other
    // dtypes and modulation-dtype gradients.
    for (FormShape s : grouped_forms(DType::kBF16, 68, 3, 513)) {
      if (s.keep_chunk_dim) continue;
      s.seq_len = s.form == ModulationForm::kPerToken ? 57 : 513;
      s.mod_dtype = DType::kF32;
      s.upcast = s.form != ModulationForm::kPerFrame;
      cases.push_back(rmsnorm_form_case(s, seed + 10));
    }
    FormShape f16{DType::kF16, DType::kF32, 1028, 3, 513, ModulationForm::kPerFrame, 3};
    cases.push_back(rmsnorm_form_case(f16, seed + 20));
    FormShape f16_each{DType::kF16, DType::kF16, 1028, 2, 300, ModulationForm::kPerSample};
    f16_each.grad_dtype = DType::kF16;
    cases.push_back(rmsnorm_form_case(f16_each, seed + 30));
    FormShape f32{DType::kF32, DType::kF32, 68, 3, 513, ModulationForm::kPerSample};
    for (bool upcast : {false, true}) {
      f32.upcast = upcast;
      cases.push_back(rmsnorm_form_case(f32, seed + 40));
    }
    return cases;
  }
  if (suite == Suite::kBench) {
    for (const FormShape& s : bench_forms(ctx)) cases.push_back(rmsnorm_form_case(s, ctx.seed + 2300));
    return cases;
  }
  cases.push_back(rmsnorm_form_case(verify_form(ctx, ModulationForm::kPerSample, DType::kF32, true), ctx.seed + 230, true));
  cases.push_back(rmsnorm_form_case(verify_form(ctx, ModulationForm::kPerFrame, DType::kBF16, false), ctx.seed + 240, true));
  return cases;
}

std::vector<OpCase> gate_residual_form_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const uint64_t seed = 2100;
    for (FormShape s : small_forms())
      for (DType mod : {DType::kBF16, DType::kF32})
        for (bool upcast : {false, true})
          for (bool has_k : {false, true}) {
            s.mod_dtype = mod;
            s.upcast = upcast;
            s.has_k = has_k;
            s.k = has_k ? 1.0f : 0.0f;
            cases.push_back(gate_residual_form_case(s, seed));
          }
    // No gate: the plain residual add, in both recipes.
    for (bool upcast : {false, true}) {
      FormShape s{DType::kBF16, DType::kBF16, 4, 2, 300, ModulationForm::kNone};
      s.upcast = upcast;
      cases.push_back(gate_residual_form_case(s, seed));
    }
    for (FormShape s : grouped_forms(DType::kBF16, 68, 3, 513)) {
      if (!s.keep_chunk_dim) continue;
      s.seq_len = s.form == ModulationForm::kPerToken ? 57 : 513;
      s.mod_dtype = DType::kF32;
      s.upcast = s.form != ModulationForm::kPerFrame;
      s.has_k = true;
      s.k = 1.0f;
      cases.push_back(gate_residual_form_case(s, seed + 10));
    }
    FormShape f16{DType::kF16, DType::kF16, 1028, 3, 513, ModulationForm::kPerFrame, 3};
    f16.has_k = true;
    f16.k = 0.5f;
    f16.grad_dtype = DType::kF16;
    cases.push_back(gate_residual_form_case(f16, seed + 20));
    FormShape f32{DType::kF32, DType::kF32, 7, 3, 513, ModulationForm::kPerSample};
    for (bool upcast : {false, true}) {
      f32.upcast = upcast;
      cases.push_back(gate_residual_form_case(f32, seed + 30));
    }
    return cases;
  }
  if (suite == Suite::kBench) {
    for (const FormShape& s : bench_forms(ctx)) cases.push_back(gate_residual_form_case(s, ctx.seed + 2400));
    return cases;
  }
  cases.push_back(
      gate_residual_form_case(verify_form(ctx, ModulationForm::kPerSample, DType::kF32, true), ctx.seed + 250, true));
  FormShape k = verify_form(ctx, ModulationForm::kPerFrame, DType::kBF16, false);
  k.has_k = true;
  k.k = 1.0f;
  cases.push_back(gate_residual_form_case(k, ctx.seed + 260, true));
  return cases;
}

std::vector<OpCase> gate_residual_rmsnorm_form_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const uint64_t seed = 2200;
    for (FormShape s : small_forms())
      for (DType mod : {DType::kBF16, DType::kF32})
        for (bool upcast : {false, true}) {
          s.mod_dtype = mod;
          s.upcast = upcast;
          // k with the modulation in x's dtype (its own rounding, 5.12), none with fp32.
          s.has_k = mod == DType::kBF16;
          s.k = s.has_k ? 1.0f : 0.0f;
          cases.push_back(gate_residual_rmsnorm_form_case(s, seed));
        }
    // No gate and a plain norm: the residual add, then RMSNorm, in both recipes.
    for (bool upcast : {false, true}) {
      FormShape s{DType::kBF16, DType::kBF16, 4, 2, 300, ModulationForm::kNone};
      s.upcast = upcast;
      cases.push_back(gate_residual_rmsnorm_form_case(s, seed));
    }
    // Wider rows, three samples of 513 positions (three chunks each), other
    // dtypes and modulation-dtype gradients.
    for (FormShape s : grouped_forms(DType::kBF16, 68, 3, 513)) {
      if (s.keep_chunk_dim) continue;
      s.seq_len = s.form == ModulationForm::kPerToken ? 57 : 513;
      s.mod_dtype = DType::kF32;
      s.upcast = s.form != ModulationForm::kPerFrame;
      cases.push_back(gate_residual_rmsnorm_form_case(s, seed + 10));
    }
    FormShape f16{DType::kF16, DType::kF16, 1028, 3, 513, ModulationForm::kPerFrame, 3};
    f16.has_k = true;
    f16.k = 0.5f;
    f16.grad_dtype = DType::kF16;
    cases.push_back(gate_residual_rmsnorm_form_case(f16, seed + 20));
    FormShape f32{DType::kF32, DType::kF32, 68, 3, 513, ModulationForm::kPerSample};
    for (bool upcast : {false, true}) {
      f32.upcast = upcast;
      cases.push_back(gate_residual_rmsnorm_form_case(f32, seed + 30));
    }
    return cases;
  }
  if (suite == Suite::kBench) {
    for (const FormShape& s : bench_forms(ctx)) cases.push_back(gate_residual_rmsnorm_form_case(s, ctx.seed + 2500));
    return cases;
  }
  cases.push_back(gate_residual_rmsnorm_form_case(verify_form(ctx, ModulationForm::kPerSample, DType::kF32, true),
                                                  ctx.seed + 270, true));
  FormShape k = verify_form(ctx, ModulationForm::kPerFrame, DType::kBF16, false);
  k.has_k = true;
  k.k = 1.0f;
  cases.push_back(gate_residual_rmsnorm_form_case(k, ctx.seed + 280, true));
  return cases;
}

}  // namespace cases
}  // namespace detdit
