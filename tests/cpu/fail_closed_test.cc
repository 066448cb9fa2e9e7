// Fail closed, argument by argument: every public entry point of the table
// below is called with the valid arguments of each small test case of its op
// (cases/, Suite::kTest), one tensor argument broken at a time by each
// mutation of the list below (and each output pointed at every other
// argument's memory). Every such call must be refused with the kind
// docs/ops.md states and a message naming that argument (for a size that
// contradicts another argument, naming either: the one checked second reports
// it), and leave every tensor of the case byte for byte as it was (outputs the
// canary; an output pointed at an input must not have written it either). The
// valid call then runs, so a case whose arguments were wrong anyway fails.
//
// The parallel ops (tp_adaln_projection, sp_*) are in it at world 1, rank 0
// of an in-process group, on the WS1 ops' cases (their collective refusals at
// larger worlds: tests/parallel). Public entry points that take tensors and
// are not in it: the chain (chain_forward_backward, chain_stand_ins: the
// op-case library has no test-suite case of it; chain_fail_closed_test.cc),
// adaln_table_chunk (it makes a view and touches no memory;
// adaln_projection_test.cc) and the IndexPlan builders (index tensors, not an
// op's Params; plan_test.cc).
#include <gtest/gtest.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "cases/op_case.h"
#include "detdit/adaln.h"
#include "detdit/comm.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/linear.h"
#include "detdit/parallel.h"
#include "detdit/rmsnorm.h"
#include "detdit/timestep.h"
#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {
namespace {

// Argument views by the name the entry point's errors use.
using Args = std::map<std::string, TensorView>;

// The view named `name`, absent when the case has none (a bias-less linear, a
// plain norm's shift).
const TensorView& arg(const Args& a, const std::string& name) {
  static const TensorView absent;
  const auto it = a.find(name);
  return it == a.end() ? absent : it->second;
}

struct Entry {
  const char* name;  // the entry point
  const char* op;    // the op whose test cases give the arguments
  // Every tensor argument it reads or writes (a case may lack some: those are
  // skipped), the outputs among them, those its header lets be absent, and
  // those whose base address its contract constrains (docs/ops.md).
  std::vector<std::string> arguments, outputs, optional, aligned;
  std::function<Status(const Args&, const IndexPlan& plan)> call;
  std::function<void(Args*)> derive = nullptr;         // views made from the case's (e.g. table chunks)
  std::function<bool(const OpCase&)> fits = nullptr;  // the cases it takes (every one when empty)
  // Dimensions (argument, dim) no other argument pins: another size there is
  // another legal problem (the fold's chunk count, the sinusoid's channels).
  std::vector<std::pair<std::string, int>> free = {};

  bool pinned(const std::string& argument, int dim) const {
    for (const auto& [a, d] : free)
      if (a == argument && d == dim) return false;
    return true;
  }
};

// The sinusoid cases in the default (H3) convention: the entries call the op
// with TimestepSinusoidInputs' defaults.
bool sinusoid_default_convention(const OpCase& c) {
  const TimestepSinusoidInputs defaults;
  return c.arguments.at("flip_sin_to_cos") == "true" &&
         c.arguments.at("downscale_freq_shift") == argument_text(defaults.downscale_freq_shift) &&
         c.arguments.at("scale") == argument_text(defaults.scale) &&
         c.arguments.at("t_max") == argument_text(defaults.t_max);
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  for (const std::string& n : names)
    if (n == name) return true;
  return false;
}

bool has_tensor(const OpCase& c, const std::string& name) {
  for (const TensorSpec& t : c.tensors)
    if (t.name == name) return true;
  return false;
}

// `message` names `argument`: it occurs as a whole word (not inside d_x or
// "max").
bool names(const std::string& message, const std::string& argument) {
  auto word = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  for (std::size_t at = message.find(argument); at != std::string::npos; at = message.find(argument, at + 1)) {
    const std::size_t end = at + argument.size();
    if ((at == 0 || !word(message[at - 1])) && (end == message.size() || !word(message[end]))) return true;
  }
  return false;
}

// ---- the mutations -----------------------------------------------------------------

// A contiguous view of `shape` over t's memory, t's dtype and device (strided
// views keep their strides: they are table chunks whose rows stay in memory).
TensorView reshaped(const TensorView& t, const std::vector<int64_t>& shape) {
  TensorView v = t;
  v.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.strides[d] = t.is_contiguous() || v.rank != t.rank ? stride : t.strides[d];
    stride *= shape[d];
  }
  for (int d = v.rank; d < kMaxRank; ++d) v.shape[d] = v.strides[d] = 0;
  return v;
}

std::vector<int64_t> shape_of(const TensorView& t) { return std::vector<int64_t>(t.shape, t.shape + t.rank); }

struct Mutation {
  const char* name;
  ErrorKind kind;
  // A size that contradicts another argument: the message may name either
  // (the one checked second reports it: "out must be (T, N) = (2, 64), got
  // (1, 64)" when x's T was changed).
  bool contradicts;
  // Whether it applies to `argument` (the view t) of `entry`, and the broken view.
  std::function<bool(const Entry& entry, const std::string& argument, const TensorView& t)> applies;
  std::function<TensorView(const TensorView& t)> mutate;
};

const std::vector<Mutation>& mutations() {
  auto any = [](const Entry&, const std::string&, const TensorView&) { return true; };
  auto first_pinned = [](const Entry& e, const std::string& a, const TensorView&) { return e.pinned(a, 0); };
  auto last_pinned = [](const Entry& e, const std::string& a, const TensorView& t) { return e.pinned(a, t.rank - 1); };
  static const std::vector<Mutation> list = {
      {"null data", ErrorKind::kValue, false, any,
       [](TensorView t) {
         t.data = nullptr;
         return t;
       }},
      // One element past an aligned base: off every vector width, on the element grid.
      {"misaligned", ErrorKind::kValue, false,
       [](const Entry& e, const std::string& a, const TensorView&) { return contains(e.aligned, a); },
       [](TensorView t) {
         t.data = static_cast<char*>(t.data) + dtype_size(t.dtype);
         return t;
       }},
      // No op takes an integer tensor among its Params (index tensors build plans).
      {"wrong dtype", ErrorKind::kType, false, any,
       [](TensorView t) {
         t.dtype = t.dtype == DType::kI32 ? DType::kF32 : DType::kI32;
         return t;
       }},
      // All elements as one dimension, or a 1-D tensor as (1, n).
      {"wrong rank", ErrorKind::kValue, false, any,
       [](const TensorView& t) {
         return t.rank == 1 ? reshaped(t, {1, t.shape[0]}) : reshaped(t, {t.numel()});
       }},
      // Each dimension doubled in turn: the first and the last here.
      {"first dimension doubled", ErrorKind::kValue, true, first_pinned,
       [](const TensorView& t) {
         std::vector<int64_t> s = shape_of(t);
         s[0] *= 2;
         return reshaped(t, s);
       }},
      {"last dimension doubled", ErrorKind::kValue, true, last_pinned,
       [](const TensorView& t) {
         std::vector<int64_t> s = shape_of(t);
         s.back() *= 2;
         return reshaped(t, s);
       }},
      {"negative dimension", ErrorKind::kValue, false, any,
       [](TensorView t) {
         t.shape[0] = -1;
         return t;
       }},
      // Only the other arguments contradict it: no scratch may be sized from it first.
      {"dimension of 2^40", ErrorKind::kValue, true, first_pinned,
       [](const TensorView& t) {
         std::vector<int64_t> s = shape_of(t);
         s[0] = int64_t{1} << 40;
         return reshaped(t, s);
       }},
      // A CPU case handed a view that claims a GPU: refused, never dereferenced.
      {"wrong device", ErrorKind::kValue, false, any,
       [](TensorView t) {
         t.device = Device::cuda(0);
         return t;
       }},
      {"absent", ErrorKind::kValue, false,
       [](const Entry& e, const std::string& a, const TensorView&) { return !contains(e.optional, a); },
       [](const TensorView&) { return TensorView(); }},
  };
  return list;
}

// ---- the driver ----------------------------------------------------------------------

// Every tensor of a CPU instance, byte for byte.
using Snapshot = std::map<std::string, std::vector<char>>;

Snapshot snapshot(const OpCase& c, const Instance& t) {
  Snapshot s;
  for (const TensorSpec& spec : c.tensors) {
    const TensorView& v = t[spec.name];
    const char* bytes = static_cast<const char*>(v.data);
    s[spec.name].assign(bytes, bytes + v.nbytes());
  }
  return s;
}

// Names the first tensor that differs from `before`; restores every one, so
// that the next call starts from the same bytes.
::testing::AssertionResult unchanged(const Snapshot& before, const Instance& t) {
  std::string written;
  for (const auto& [name, bytes] : before) {
    if (std::memcmp(bytes.data(), t[name].data, bytes.size()) == 0) continue;
    if (written.empty()) written = name;
    std::memcpy(t[name].data, bytes.data(), bytes.size());
  }
  if (written.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << written << " was written";
}

// An error of `kind` whose message names one of `any_of`.
::testing::AssertionResult refused_naming(const Status& s, ErrorKind kind, const std::vector<std::string>& any_of) {
  if (s.kind() == kind)
    for (const std::string& argument : any_of)
      if (names(s.message(), argument)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected a " << error_kind_name(kind) << " naming " << any_of[0]
                                       << (any_of.size() > 1 ? " or another argument" : "") << ", got "
                                       << s.to_string();
}

// The entry's arguments among the case's tensors (given by `view`) and the
// views derived from them; empty when the case lacks a required one (a plain
// norm for a modulated entry, a linear without partials).
Args case_args(const Entry& entry, const OpCase& c, const std::function<TensorView(const TensorSpec&)>& view) {
  Args args;
  for (const TensorSpec& t : c.tensors) args[t.name] = view(t);
  if (entry.derive) entry.derive(&args);
  for (auto it = args.begin(); it != args.end();)
    it = contains(entry.arguments, it->first) ? std::next(it) : args.erase(it);
  for (const std::string& a : entry.arguments)
    if (!args.count(a) && !contains(entry.optional, a)) return Args();
  return args;
}

// A view of the spec's shape and dtype over memory that is never read (for
// case_args' choice of cases; the derived views only need shapes).
TensorView shape_only(const TensorSpec& t) {
  alignas(64) static char never_read[1];
  TensorView v;
  v.data = never_read;
  v.dtype = t.dtype;
  v.rank = static_cast<int>(t.shape.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = t.shape[d];
    v.strides[d] = stride;
    stride *= t.shape[d];
  }
  return v;
}

// The test cases of entry.op it takes, of at most kSmallCase elements each
// (every dtype and layout the suite has comes at such sizes; the large ones
// repeat them and would make this test minutes), or the smallest when none is
// that small.
constexpr int64_t kSmallCase = int64_t{1} << 14;

std::vector<OpCase> small_cases(const Entry& entry) {
  std::vector<OpCase> small;
  OpCase smallest;
  for (OpCase& c : op_cases(entry.op, Suite::kTest, CaseContext{})) {
    if ((entry.fits && !entry.fits(c)) || case_args(entry, c, shape_only).empty()) continue;
    if (smallest.op.empty() || case_elements(c) < case_elements(smallest)) smallest = c;
    if (case_elements(c) <= kSmallCase) small.push_back(std::move(c));
  }
  if (small.empty() && !smallest.op.empty()) small.push_back(smallest);
  return small;
}

// Every mutation of every argument of `entry` on its small test cases.
void expect_mutations_refused(const Entry& entry) {
  SCOPED_TRACE(entry.name);
  int cases_run = 0;
  for (const OpCase& c : small_cases(entry)) {
    SCOPED_TRACE(c.full_name());
    Instance instance;
    DETDIT_ASSERT_OK(instantiate(c, Device::cpu(), nullptr, &instance));
    const Args args = case_args(entry, c, [&instance](const TensorSpec& t) { return instance[t.name]; });
    IndexPlan plan;
    for (const PlanSpec& p : c.plans)
      if (p.name == "plan") plan = instance.plan("plan");
    const Snapshot before = snapshot(c, instance);

    // The call is refused with `kind`, its message naming one of each of `namings`, nothing written.
    auto expect_refused = [&](const Args& broken, ErrorKind kind,
                              const std::vector<std::vector<std::string>>& namings) {
      const Status s = entry.call(broken, plan);
      for (const std::vector<std::string>& any_of : namings) EXPECT_TRUE(refused_naming(s, kind, any_of));
      EXPECT_TRUE(unchanged(before, instance));
    };
    for (const auto& [argument, view] : args) {
      std::vector<std::string> others;
      for (const auto& [other, other_view] : args)
        if (other != argument) others.push_back(other);
      for (const Mutation& m : mutations()) {
        if (!m.applies(entry, argument, view)) continue;
        SCOPED_TRACE(std::string(m.name) + " " + argument);
        Args broken = args;
        broken[argument] = m.mutate(view);
        std::vector<std::string> named = {argument};
        if (m.contradicts) named.insert(named.end(), others.begin(), others.end());
        expect_refused(broken, m.kind, {named});
      }
      // An output on the memory of any other argument (the same extent as its
      // own), named with the other side or an argument sharing its memory
      // (table chunks interleave).
      if (!contains(entry.outputs, argument)) continue;
      for (const auto& [other, other_view] : args) {
        if (other == argument) continue;
        SCOPED_TRACE(argument + " overlapping " + other);
        Args broken = args;
        broken[argument].data = other_view.data;
        expect_refused(broken, ErrorKind::kValue, {{argument}, others});
      }
    }
    DETDIT_EXPECT_OK(entry.call(args, plan));
    ++cases_run;
  }
  EXPECT_GT(cases_run, 0) << "no " << entry.op << " test case fits " << entry.name;
}

// ---- the entry points ------------------------------------------------------------

// The (R, H) chunk c of a (R, 6H) table whose H is x's last dimension.
TensorView chunk(const Args& a, const char* table, const char* x, int c) {
  const TensorView& rows = a.at(x);
  TensorView view;
  const Status s = adaln_table_chunk(a.at(table), rows.shape[rows.rank - 1], c, &view);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return view;
}

// A table view of the case: column 1 on of its (R, H + 1) `storage`, else
// chunk c of its (R, 6H) `table`.
void table_view(Args* a, const char* name, const char* storage, const char* x, int c) {
  if (a->count(storage)) {
    (*a)[name] = a->at(storage).narrow(1, 1, a->at(x).shape[a->at(x).rank - 1]);
  } else {
    (*a)[name] = chunk(*a, "table", x, c);
  }
}

const std::vector<std::string> kLinearBackward = {"grad", "x", "weight", "partials", "d_x", "d_weight", "d_bias"};
LinearBackwardInputParams input_grad(const Args& a) {
  return {arg(a, "grad"), arg(a, "weight"), arg(a, "partials"), arg(a, "d_x")};
}
LinearBackwardWeightParams weight_grads(const Args& a) {
  return {arg(a, "grad"), arg(a, "x"), arg(a, "d_weight"), arg(a, "d_bias")};
}

AdalnModulationInputs modulation_inputs(const Args& a, const IndexPlan& plan) {
  return {arg(a, "temb"), arg(a, "weight"), arg(a, "bias"), plan};
}
FinalAdalnOutInputs final_inputs(const Args& a, const IndexPlan& plan) {
  return {arg(a, "x"), arg(a, "norm_weight"), arg(a, "temb"), arg(a, "weight"), arg(a, "bias"), plan};
}
RmsnormInputs norm_inputs(const Args& a, const IndexPlan& plan) {
  return {arg(a, "x"), arg(a, "weight"), arg(a, "shift"), arg(a, "scale"), plan};
}
GateResidualRmsnormInputs region_inputs(const Args& a, const IndexPlan& plan) {
  return {arg(a, "residual"), arg(a, "y"), arg(a, "gate"), arg(a, "weight"), arg(a, "shift"), arg(a, "scale"), plan};
}
TimestepMlpInputs mlp_inputs(const Args& a) {
  return {arg(a, "features"), arg(a, "w1"), arg(a, "b1"), arg(a, "w2"), arg(a, "b2")};
}

// shift and scale: chunks 0 and 1 (rmsnorm) of the case's table or its offset storages.
void norm_tables(Args* a) {
  if (!a->count("table") && !a->count("shift_storage")) return;  // a plain norm
  table_view(a, "shift", "shift_storage", "x", 0);
  table_view(a, "scale", "scale_storage", "x", 1);
}
// gate, shift, scale: chunks 2, 3, 4 of the region's table or its offset storages.
void region_tables(Args* a) {
  table_view(a, "gate", "gate_storage", "residual", 2);
  if (a->count("d_shift")) {  // a modulated region
    table_view(a, "shift", "shift_storage", "residual", 3);
    table_view(a, "scale", "scale_storage", "residual", 4);
  }
}

// The Params of the ops that also have a parallel form (parallel.h), from the arguments.
AdalnProjectionParams projection_params(const Args& a) {
  return {{arg(a, "temb"), arg(a, "weight"), arg(a, "bias")}, arg(a, "table"), arg(a, "act")};
}
AdalnProjectionBackwardParams projection_backward_params(const Args& a) {
  return {{arg(a, "temb"), arg(a, "weight"), {}},       arg(a, "act"),      arg(a, "grad_table"),
          arg(a, "d_temb"),                             arg(a, "d_weight"), arg(a, "d_bias")};
}
RmsnormParams norm_params(const Args& a, const IndexPlan& plan) {
  return {norm_inputs(a, plan), arg(a, "out"), arg(a, "rstd")};
}
RmsnormBackwardParams norm_backward_params(const Args& a, const IndexPlan& plan) {
  return {norm_inputs(a, plan), arg(a, "rstd"),     arg(a, "grad"),   arg(a, "dx"),
          arg(a, "d_weight"),   arg(a, "d_shift"), arg(a, "d_scale")};
}
GateResidualParams gate_params(const Args& a, const IndexPlan& plan) {
  return {{arg(a, "residual"), arg(a, "y"), arg(a, "gate"), plan}, arg(a, "out")};
}
// residual is not read by the backward (gate_residual.h).
GateResidualBackwardParams gate_backward_params(const Args& a, const IndexPlan& plan) {
  GateResidualBackwardParams p;
  p.in.y = arg(a, "y");
  p.in.gate = arg(a, "gate");
  p.in.plan = plan;
  p.grad = arg(a, "grad");
  p.d_residual = arg(a, "d_residual");
  p.d_y = arg(a, "d_y");
  p.d_gate = arg(a, "d_gate");
  return p;
}
GateResidualRmsnormParams region_params(const Args& a, const IndexPlan& plan) {
  return {region_inputs(a, plan), arg(a, "h"), arg(a, "out"), arg(a, "rstd")};
}
GateResidualRmsnormBackwardParams region_backward_params(const Args& a, const IndexPlan& plan) {
  GateResidualRmsnormInputs in = region_inputs(a, plan);
  in.residual = TensorView();  // not read by the backward (gate_residual_rmsnorm.h)
  return {in,
          arg(a, "h"),
          arg(a, "rstd"),
          arg(a, "d_out"),
          arg(a, "d_h"),
          arg(a, "d_residual"),
          arg(a, "d_y"),
          arg(a, "d_gate"),
          arg(a, "d_weight"),
          arg(a, "d_shift"),
          arg(a, "d_scale")};
}
Status region_forward(const Args& a, const IndexPlan& plan) {
  return gate_residual_rmsnorm_forward(region_params(a, plan));
}
Status region_backward(const Args& a, const IndexPlan& plan) {
  return gate_residual_rmsnorm_backward(region_backward_params(a, plan));
}

// The modulation forms' cases (cases/forms_cases.cc, the ones with an upcast
// argument) are left out: their views and refusals are modulation_forms_test's.
bool forms_case(const OpCase& c) { return c.arguments.count("upcast") > 0; }
bool indexed(const OpCase& c) { return !forms_case(c); }
bool modulated(const OpCase& c) { return has_tensor(c, "d_shift") && indexed(c); }
bool plain(const OpCase& c) { return !has_tensor(c, "d_shift") && indexed(c); }
bool has_fp32_out(const OpCase& c) { return has_tensor(c, "out") && c.spec("out").dtype == DType::kF32; }
// H3's projection cases (projection_params sets no chunk count); the families'
// (a "chunks" argument) have their own validation tests (adaln_table_add_test.cc).
bool h3_projection(const OpCase& c) { return c.arguments.count("chunks") == 0; }

// The gate: the case's (R, H) table, or chunk 2 of its (R, 6H) one.
void gate_table(Args* a) {
  const TensorView& t = a->at("table");
  (*a)["gate"] = t.shape[1] == a->at("y").shape[1] ? t : chunk(*a, "table", "y", 2);
}

const std::vector<Entry>& entries() {
  static const std::vector<Entry> table = {
      {"linear_forward", "linear", {"x", "weight", "bias", "out", "pre_activation"}, {"out", "pre_activation"},
       {"bias", "pre_activation"}, {"x", "weight"},
       [](const Args& a, const IndexPlan&) {
         return linear_forward({arg(a, "x"), arg(a, "weight"), arg(a, "bias"), arg(a, "out"),
                                arg(a, "pre_activation"), Activation::kSilu});
       },
       [](Args* a) { (*a)["pre_activation"] = a->at("pre"); }},
      {"linear_backward_input", "linear", {"grad", "weight", "partials", "d_x"}, {"partials", "d_x"}, {"partials"},
       {"weight", "partials"},
       [](const Args& a, const IndexPlan&) { return linear_backward_input(input_grad(a)); }},
      {"linear_backward_input_partials", "linear", {"grad", "weight", "partials"}, {"partials"}, {},
       {"weight", "partials"},
       [](const Args& a, const IndexPlan&) { return linear_backward_input_partials(input_grad(a)); }},
      {"linear_fold_partials", "linear", {"partials", "d_x"}, {"d_x"}, {}, {"partials"},
       [](const Args& a, const IndexPlan&) { return linear_fold_partials(input_grad(a)); }, nullptr, nullptr,
       {{"partials", 0}}},
      {"linear_backward_weight", "linear", {"grad", "x", "d_weight", "d_bias"}, {"d_weight", "d_bias"},
       {"d_weight", "d_bias"}, {},
       [](const Args& a, const IndexPlan&) { return linear_backward_weight(weight_grads(a)); }},
      {"linear_backward_weight_and_input", "linear", kLinearBackward, {"partials", "d_x", "d_weight", "d_bias"},
       {"d_weight", "d_bias"}, {"weight", "partials"},
       [](const Args& a, const IndexPlan&) {
         return linear_backward_weight_and_input(weight_grads(a), input_grad(a));
       }},
      // grad, pre and d_pre of one shape in fp32: the linear's backward grad, its saved pre, an fp32 out.
      {"silu_backward", "linear", {"grad", "pre", "d_pre"}, {"d_pre"}, {}, {},
       [](const Args& a, const IndexPlan&) { return silu_backward({arg(a, "grad"), arg(a, "pre"), arg(a, "d_pre")}); },
       [](Args* a) { (*a)["d_pre"] = a->at("out"); }, has_fp32_out},
      {"adaln_projection_forward", "adaln_projection", {"temb", "weight", "bias", "table", "act"}, {"table", "act"},
       {"act"}, {"weight", "act"},
       [](const Args& a, const IndexPlan&) { return adaln_projection_forward(projection_params(a)); }, nullptr,
       h3_projection},
      {"adaln_projection_backward", "adaln_projection",
       {"temb", "weight", "act", "grad_table", "d_temb", "d_weight", "d_bias"}, {"d_temb", "d_weight", "d_bias"},
       {"d_temb", "d_weight", "d_bias"}, {"weight"},
       [](const Args& a, const IndexPlan&) { return adaln_projection_backward(projection_backward_params(a)); }, nullptr,
       h3_projection},
      {"adaln_row_gather_forward", "adaln_row_gather", {"rows", "out"}, {"out"}, {}, {},
       [](const Args& a, const IndexPlan& plan) {
         return adaln_row_gather_forward({arg(a, "rows"), plan, arg(a, "out")});
       },
       [](Args* a) {
         // The case's (R, 6H) rows at their storage's row stride.
         const TensorView& s = a->at("rows_storage");
         const int64_t width = a->at("d_rows").shape[1];
         (*a)["rows"] = TensorView::strided(s.data, s.dtype, {s.shape[0], width}, {s.shape[1], 1}, s.device);
       }},
      {"adaln_row_gather_backward", "adaln_row_gather", {"grad", "d_rows"}, {"d_rows"}, {}, {},
       [](const Args& a, const IndexPlan& plan) {
         return adaln_row_gather_backward({arg(a, "grad"), plan, arg(a, "d_rows")});
       }},
      {"adaln_modulation_forward", "adaln_modulation", {"temb", "weight", "bias", "table", "act", "out"},
       {"table", "act", "out"}, {}, {"weight", "act"},
       [](const Args& a, const IndexPlan& plan) {
         return adaln_modulation_forward({modulation_inputs(a, plan), arg(a, "table"), arg(a, "act"), arg(a, "out")});
       }},
      {"adaln_modulation_backward", "adaln_modulation",
       {"temb", "weight", "act", "grad", "d_temb", "d_weight", "d_bias"}, {"d_temb", "d_weight", "d_bias"},
       {"d_temb", "d_weight", "d_bias"}, {"weight"},
       [](const Args& a, const IndexPlan& plan) {
         AdalnModulationInputs in = modulation_inputs(a, plan);
         in.bias = TensorView();  // forward only
         return adaln_modulation_backward(
             {in, arg(a, "act"), arg(a, "grad"), arg(a, "d_temb"), arg(a, "d_weight"), arg(a, "d_bias")});
       }},
      {"final_adaln_out_forward", "final_adaln_out",
       {"x", "norm_weight", "temb", "weight", "bias", "out", "table", "act", "rstd"}, {"out", "table", "act", "rstd"},
       {}, {"x", "norm_weight", "weight", "act", "out"},
       [](const Args& a, const IndexPlan& plan) {
         return final_adaln_out_forward(
             {final_inputs(a, plan), arg(a, "out"), arg(a, "table"), arg(a, "act"), arg(a, "rstd")});
       }},
      {"final_adaln_out_backward", "final_adaln_out",
       {"x", "norm_weight", "temb", "weight", "table", "act", "rstd", "grad", "dx", "d_norm_weight", "d_temb",
        "d_weight", "d_bias"},
       {"dx", "d_norm_weight", "d_temb", "d_weight", "d_bias"},
       {"dx", "d_norm_weight", "d_temb", "d_weight", "d_bias"}, {"x", "norm_weight", "weight"},
       [](const Args& a, const IndexPlan& plan) {
         FinalAdalnOutInputs in = final_inputs(a, plan);
         in.bias = TensorView();  // forward only
         return final_adaln_out_backward({in, arg(a, "table"), arg(a, "act"), arg(a, "rstd"), arg(a, "grad"),
                                          arg(a, "dx"), arg(a, "d_norm_weight"), arg(a, "d_temb"),
                                          arg(a, "d_weight"), arg(a, "d_bias")});
       }},
      {"rmsnorm_forward", "rmsnorm", {"x", "weight", "shift", "scale", "out", "rstd"}, {"out", "rstd"}, {"rstd"},
       {"x", "weight", "out"},
       [](const Args& a, const IndexPlan& plan) { return rmsnorm_forward(norm_params(a, plan)); }, norm_tables,
       modulated},
      {"rmsnorm_forward_plain", "rmsnorm", {"x", "weight", "out", "rstd"}, {"out", "rstd"}, {"rstd"},
       {"x", "weight", "out"},
       [](const Args& a, const IndexPlan&) {
         return rmsnorm_forward({norm_inputs(a, IndexPlan()), arg(a, "out"), arg(a, "rstd")});
       },
       nullptr, plain},
      {"rmsnorm_backward", "rmsnorm",
       {"x", "weight", "shift", "scale", "rstd", "grad", "dx", "d_weight", "d_shift", "d_scale"},
       {"dx", "d_weight", "d_shift", "d_scale"}, {"dx", "d_weight", "d_shift", "d_scale"}, {"x", "weight"},
       [](const Args& a, const IndexPlan& plan) { return rmsnorm_backward(norm_backward_params(a, plan)); },
       norm_tables, modulated},
      {"rmsnorm_backward_plain", "rmsnorm", {"x", "weight", "rstd", "grad", "dx", "d_weight"}, {"dx", "d_weight"},
       {"dx", "d_weight"}, {"x", "weight"},
       [](const Args& a, const IndexPlan&) {
         return rmsnorm_backward({norm_inputs(a, IndexPlan()), arg(a, "rstd"), arg(a, "grad"), arg(a, "dx"),
                                  arg(a, "d_weight"), {}, {}});
       },
       nullptr, plain},
      // gate is optional: absent, the op is the plain residual add (modulation.h).
      {"gate_residual_forward", "gate_residual", {"residual", "y", "gate", "out"}, {"out"}, {"gate"}, {},
       [](const Args& a, const IndexPlan& plan) { return gate_residual_forward(gate_params(a, plan)); },
       gate_table, indexed},
      // residual is not read by the backward (gate_residual.h).
      {"gate_residual_backward", "gate_residual", {"y", "gate", "grad", "d_residual", "d_y", "d_gate"},
       {"d_residual", "d_y", "d_gate"}, {"gate", "d_residual", "d_y", "d_gate"}, {},
       [](const Args& a, const IndexPlan& plan) { return gate_residual_backward(gate_backward_params(a, plan)); },
       gate_table, indexed},
      // gate is optional here too: absent, the plain residual add before the norm
      // (gate_residual_rmsnorm.h); the backward's d_gate still needs it.
      {"gate_residual_rmsnorm_forward", "gate_residual_rmsnorm",
       {"residual", "y", "gate", "weight", "shift", "scale", "h", "out", "rstd"}, {"h", "out", "rstd"}, {"gate"},
       {"weight", "h", "out"}, region_forward, region_tables, modulated},
      {"gate_residual_rmsnorm_forward_plain", "gate_residual_rmsnorm",
       {"residual", "y", "gate", "weight", "h", "out", "rstd"}, {"h", "out", "rstd"}, {"gate"},
       {"weight", "h", "out"}, region_forward, region_tables, plain},
      // residual is not read by the backward (gate_residual_rmsnorm.h).
      {"gate_residual_rmsnorm_backward", "gate_residual_rmsnorm",
       {"y", "gate", "weight", "shift", "scale", "h", "rstd", "d_out", "d_h", "d_residual", "d_y", "d_gate",
        "d_weight", "d_shift", "d_scale"},
       {"d_residual", "d_y", "d_gate", "d_weight", "d_shift", "d_scale"},
       {"d_h", "d_residual", "d_y", "d_gate", "d_weight", "d_shift", "d_scale"}, {"weight", "h"}, region_backward,
       region_tables, modulated},
      {"gate_residual_rmsnorm_backward_plain", "gate_residual_rmsnorm",
       {"y", "gate", "weight", "h", "rstd", "d_out", "d_h", "d_residual", "d_y", "d_gate", "d_weight"},
       {"d_residual", "d_y", "d_gate", "d_weight"}, {"d_h", "d_residual", "d_y", "d_gate", "d_weight"},
       {"weight", "h"}, region_backward, region_tables, plain},
      {"timestep_sinusoid_forward", "timestep_sinusoid", {"timesteps", "features"}, {"features"}, {}, {},
       [](const Args& a, const IndexPlan&) {
         return timestep_sinusoid_forward({{arg(a, "timesteps")}, arg(a, "features")});
       },
       nullptr, sinusoid_default_convention, {{"features", 1}}},
      {"timestep_sinusoid_backward", "timestep_sinusoid", {"timesteps", "grad_features", "d_timesteps"},
       {"d_timesteps"}, {}, {},
       [](const Args& a, const IndexPlan&) {
         return timestep_sinusoid_backward({{arg(a, "timesteps")}, arg(a, "grad_features"), arg(a, "d_timesteps")});
       },
       nullptr, sinusoid_default_convention, {{"grad_features", 1}}},
      {"timestep_mlp_forward", "timestep_mlp", {"features", "w1", "b1", "w2", "b2", "temb", "pre", "hidden"},
       {"temb", "pre", "hidden"}, {"pre", "hidden"}, {"features", "w1", "b1", "w2", "b2", "temb", "pre", "hidden"},
       [](const Args& a, const IndexPlan&) {
         return timestep_mlp_forward({mlp_inputs(a), arg(a, "temb"), arg(a, "pre"), arg(a, "hidden")});
       }},
      // b1 and b2 are not read by the backward (timestep.h).
      {"timestep_mlp_backward", "timestep_mlp",
       {"features", "w1", "w2", "pre", "hidden", "grad_temb", "d_features", "d_w1", "d_b1", "d_w2", "d_b2"},
       {"d_features", "d_w1", "d_b1", "d_w2", "d_b2"}, {"d_features", "d_w1", "d_b1", "d_w2", "d_b2"},
       {"features", "w1", "w2", "pre", "hidden", "grad_temb", "d_features", "d_w1", "d_b1", "d_w2", "d_b2"},
       [](const Args& a, const IndexPlan&) {
         TimestepMlpInputs in = mlp_inputs(a);
         in.b1 = in.b2 = TensorView();
         return timestep_mlp_backward({in, arg(a, "pre"), arg(a, "hidden"), arg(a, "grad_temb"),
                                       arg(a, "d_features"), arg(a, "d_w1"), arg(a, "d_b1"), arg(a, "d_w2"),
                                       arg(a, "d_b2")});
       }},
  };
  return table;
}

// ---- the parallel ops at world 1 ---------------------------------------------------

// Rank 0 of a one-rank in-process group: the parallel ops then take the WS1
// arguments (the whole table, every position) and run every check of the WS1
// op and their own.
Communicator& solo() {
  static std::shared_ptr<InProcessGroup> group;
  static std::unique_ptr<Communicator> comm;
  if (!comm) {
    DETDIT_EXPECT_OK(InProcessGroup::create(1, Device::cpu(), &group));
    DETDIT_EXPECT_OK(group->communicator(0, &comm));
  }
  return *comm;
}

SpPlan solo_plan(const IndexPlan& plan) {
  SpPlan sp;
  DETDIT_EXPECT_OK(SpPlan::create(plan, 1, 0, &sp));
  return sp;
}

Status region_sp_forward(const Args& a, const IndexPlan& plan) {
  return sp_gate_residual_rmsnorm_forward(solo_plan(plan), region_params(a, plan));
}
Status region_sp_backward(const Args& a, const IndexPlan& plan) {
  return sp_gate_residual_rmsnorm_backward(solo(), solo_plan(plan), region_backward_params(a, plan));
}

// Every entry: the table's, then each parallel op as the table's WS1 entry
// (its arguments and cases; the SpPlan needs the index plan, so the modulated
// norms and the regions).
const std::vector<Entry>& all_entries() {
  struct Parallel {
    const char* ws1;
    const char* name;
    std::function<Status(const Args&, const IndexPlan& plan)> call;
  };
  static const std::vector<Entry> all = [] {
    const Parallel parallel[] = {
        {"adaln_projection_forward", "tp_adaln_projection_forward",
         [](const Args& a, const IndexPlan&) {
           return tp_adaln_projection_forward(solo(), projection_params(a));
         }},
        {"adaln_projection_backward", "tp_adaln_projection_backward",
         [](const Args& a, const IndexPlan&) {
           return tp_adaln_projection_backward(solo(), projection_backward_params(a));
         }},
        {"rmsnorm_forward", "sp_rmsnorm_forward",
         [](const Args& a, const IndexPlan& plan) { return sp_rmsnorm_forward(solo_plan(plan), norm_params(a, plan)); }},
        {"rmsnorm_backward", "sp_rmsnorm_backward",
         [](const Args& a, const IndexPlan& plan) {
           return sp_rmsnorm_backward(solo(), solo_plan(plan), norm_backward_params(a, plan));
         }},
        {"gate_residual_forward", "sp_gate_residual_forward",
         [](const Args& a, const IndexPlan& plan) {
           return sp_gate_residual_forward(solo_plan(plan), gate_params(a, plan));
         }},
        {"gate_residual_backward", "sp_gate_residual_backward",
         [](const Args& a, const IndexPlan& plan) {
           return sp_gate_residual_backward(solo(), solo_plan(plan), gate_backward_params(a, plan));
         }},
        {"gate_residual_rmsnorm_forward", "sp_gate_residual_rmsnorm_forward", region_sp_forward},
        {"gate_residual_rmsnorm_forward_plain", "sp_gate_residual_rmsnorm_forward_plain", region_sp_forward},
        {"gate_residual_rmsnorm_backward", "sp_gate_residual_rmsnorm_backward", region_sp_backward},
        {"gate_residual_rmsnorm_backward_plain", "sp_gate_residual_rmsnorm_backward_plain", region_sp_backward},
    };
    std::vector<Entry> v = entries();
    for (const Parallel& p : parallel) {
      for (const Entry& e : entries()) {
        if (std::string(e.name) != p.ws1) continue;
        v.push_back(e);
        v.back().name = p.name;
        v.back().call = p.call;
      }
    }
    return v;
  }();
  return all;
}

void PrintTo(const Entry& entry, std::ostream* os) { *os << entry.name; }

class Mutations : public ::testing::TestWithParam<Entry> {};

TEST_P(Mutations, EveryArgumentRefusedBeforeAnyWrite) { expect_mutations_refused(GetParam()); }

INSTANTIATE_TEST_SUITE_P(FailClosed, Mutations, ::testing::ValuesIn(all_entries()),
                         [](const ::testing::TestParamInfo<Entry>& info) { return std::string(info.param.name); });

// ---- sizes that only one rule contradicts -------------------------------------------

// weight (N, D) re-shaped to 18 * 2^36 rows over the same memory (a multiple
// of 18, so the weight's own rule passes; validation reads no data), the
// outputs absent (the re-shaped view would overlap them): only grad
// contradicts it, and the scratch the backward needs would be petabytes, so
// only a refusal before any allocation gives the ValueError.
TEST(FailClosed, AdalnModulationBackwardChecksSizesBeforeScratch) {
  CpuCase k(op_cases("adaln_modulation", Suite::kTest, CaseContext{}).at(0));
  const TensorView& w = k.view("weight");
  const TensorView huge =
      TensorView::contiguous(w.data, w.dtype, {18 * ((int64_t{1} << 40) / 16), w.shape[1]}, w.device);
  AdalnModulationBackwardParams p;
  p.in.temb = k.view("temb");
  p.in.weight = huge;
  p.in.plan = k.plan();
  p.act = k.view("act");
  p.grad = k.view("grad");
  EXPECT_TRUE(refused(adaln_modulation_backward(p), ErrorKind::kValue, "grad must be (6, B*S, H)"));
  EXPECT_TRUE(still_canary(k.outputs()));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
