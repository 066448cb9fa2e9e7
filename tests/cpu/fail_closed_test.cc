// Fail closed, argument by argument: each entry point below is called with the
// valid arguments of its smallest op test case (cases/), one tensor argument
// broken at a time; every call must be refused with the documented kind and a
// message naming that argument, and every output of the case must still be
// the canary (nothing allocated-then-written before the refusal).
//
// The breakages: a present view whose data pointer is null (every tensor
// argument, optional outputs included), dimensions of 2^40 that only the
// other arguments contradict (no scratch may be sized from them before that
// is checked), an output that is the same memory as an input, and a saved
// output the header requires but the caller left absent.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cases/op_case.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/linear.h"
#include "detdit/rmsnorm.h"
#include "support/rowwise_fixture.h"
#include "support/cases.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {
namespace {

// Argument views by the name the entry point's errors use.
using Args = std::map<std::string, TensorView>;

struct Entry {
  const char* name;                     // the entry point, for the trace
  const char* op;                       // the op whose test cases give the arguments
  std::vector<std::string> needs;       // the case tensors it takes (picks the case)
  std::function<void(Args*)> derive;    // views made from the case's (may be empty)
  std::vector<std::string> arguments;   // the tensor arguments to break, one at a time
  std::function<Status(const Args&, const Instance&)> call;
};

bool has_tensor(const OpCase& c, const std::string& name) {
  for (const TensorSpec& t : c.tensors)
    if (t.name == name) return true;
  return false;
}

// The smallest test case of entry.op with every tensor entry.needs names and,
// when `without` is given, none of those.
OpCase pick_case(const Entry& entry, const std::vector<std::string>& without = {}) {
  OpCase best;
  int64_t best_elements = -1;
  for (const OpCase& c : op_cases(entry.op, Suite::kTest, CaseContext{})) {
    bool fits = true;
    for (const std::string& n : entry.needs) fits = fits && has_tensor(c, n);
    for (const std::string& n : without) fits = fits && !has_tensor(c, n);
    if (fits && (best_elements < 0 || case_elements(c) < best_elements)) {
      best = c;
      best_elements = case_elements(c);
    }
  }
  EXPECT_GE(best_elements, 0) << "no " << entry.op << " test case has the tensors " << entry.name << " needs";
  return best;
}

// A case instantiated on the CPU: its tensors (outputs the canary) by name.
struct Prepared {
  OpCase c;
  Instance instance;
  Args args;
};

void prepare(const Entry& entry, const std::vector<std::string>& without, Prepared* p) {
  p->c = pick_case(entry, without);
  ASSERT_FALSE(p->c.op.empty());
  DETDIT_ASSERT_OK(instantiate(p->c, Device::cpu(), nullptr, &p->instance));
  for (const TensorSpec& t : p->c.tensors) p->args[t.name] = p->instance[t.name];
  if (entry.derive) entry.derive(&p->args);
}

// Every output of the case is still all canary (names the first that is not).
::testing::AssertionResult outputs_untouched(const Prepared& p) {
  std::map<std::string, HostTensor> host;
  const Status s = download_outputs(p.c, p.instance, &host);
  if (!s.ok()) return ::testing::AssertionFailure() << s.to_string();
  for (const auto& [name, t] : host)
    if (!all_bytes_are(t, kCanary)) return ::testing::AssertionFailure() << name << " was written";
  return ::testing::AssertionSuccess();
}

// Each argument in turn as a present view with a null data pointer.
void expect_null_data_refused(const Entry& entry, const std::vector<std::string>& without = {}) {
  SCOPED_TRACE(entry.name);
  Prepared p;
  prepare(entry, without, &p);
  if (::testing::Test::HasFatalFailure()) return;
  SCOPED_TRACE(p.c.full_name());
  for (const std::string& argument : entry.arguments) {
    SCOPED_TRACE("null " + argument);
    Args broken = p.args;
    ASSERT_TRUE(broken.count(argument)) << "unknown argument " << argument;
    ASSERT_TRUE(broken[argument].present());
    broken[argument].data = nullptr;
    EXPECT_TRUE(refused(entry.call(broken, p.instance), ErrorKind::kValue, argument + " is ("));
    EXPECT_TRUE(refused(entry.call(broken, p.instance), ErrorKind::kValue, "with a null data pointer"));
    EXPECT_TRUE(outputs_untouched(p));
  }
}

// ---- the entry points ------------------------------------------------------------

const Args::mapped_type kAbsent{};

// The (R, H) chunk c of a (R, 6H) table whose H is x's last dimension.
TensorView chunk(const Args& a, const char* table, const char* x, int c) {
  const TensorView& rows = a.at(x);
  TensorView view;
  const Status s = adaln_table_chunk(a.at(table), rows.shape[rows.rank - 1], c, &view);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return view;
}

Entry linear_forward_entry() {
  return {"linear_forward", "linear", {"x", "weight", "bias", "out", "pre"},
          [](Args* a) { (*a)["pre_activation"] = a->at("pre"); },
          {"x", "weight", "bias", "out", "pre_activation"},
          [](const Args& a, const Instance&) {
            return linear_forward({a.at("x"), a.at("weight"), a.at("bias"), a.at("out"), a.at("pre_activation"),
                                   Activation::kSilu});
          }};
}

LinearBackwardInputParams input_grad(const Args& a) {
  return {a.at("grad"), a.at("weight"), a.at("partials"), a.at("d_x")};
}
LinearBackwardWeightParams weight_grads(const Args& a) {
  return {a.at("grad"), a.at("x"), a.at("d_weight"), a.at("d_bias")};
}
const std::vector<std::string> kLinearBackward = {"grad", "x", "weight", "partials", "d_x", "d_weight", "d_bias"};

TEST(FailClosed, LinearRefusesNullData) {
  expect_null_data_refused(linear_forward_entry());
  expect_null_data_refused({"linear_backward_input", "linear", kLinearBackward, nullptr,
                            {"grad", "weight", "partials", "d_x"},
                            [](const Args& a, const Instance&) { return linear_backward_input(input_grad(a)); }});
  expect_null_data_refused({"linear_backward_input_partials", "linear", kLinearBackward, nullptr,
                            {"grad", "weight", "partials"}, [](const Args& a, const Instance&) {
                              return linear_backward_input_partials(input_grad(a));
                            }});
  expect_null_data_refused({"linear_fold_partials", "linear", kLinearBackward, nullptr, {"partials", "d_x"},
                            [](const Args& a, const Instance&) { return linear_fold_partials(input_grad(a)); }});
  expect_null_data_refused({"linear_backward_weight", "linear", kLinearBackward, nullptr,
                            {"grad", "x", "d_weight", "d_bias"},
                            [](const Args& a, const Instance&) { return linear_backward_weight(weight_grads(a)); }});
  expect_null_data_refused({"linear_backward_weight_and_input", "linear", kLinearBackward, nullptr, kLinearBackward,
                            [](const Args& a, const Instance&) {
                              return linear_backward_weight_and_input(weight_grads(a), input_grad(a));
                            }});
}

Entry projection_backward_entry() {
  return {"adaln_projection_backward", "adaln_projection", {"temb", "act"}, nullptr,
          {"temb", "weight", "act", "grad_table", "d_temb", "d_weight", "d_bias"}, [](const Args& a, const Instance&) {
            return adaln_projection_backward({{a.at("temb"), a.at("weight"), kAbsent}, a.at("act"),
                                              a.at("grad_table"), a.at("d_temb"), a.at("d_weight"), a.at("d_bias")});
          }};
}

TEST(FailClosed, AdalnProjectionRefusesNullData) {
  expect_null_data_refused({"adaln_projection_forward", "adaln_projection", {"temb", "act"}, nullptr,
                            {"temb", "weight", "bias", "table", "act"}, [](const Args& a, const Instance&) {
                              return adaln_projection_forward(
                                  {{a.at("temb"), a.at("weight"), a.at("bias")}, a.at("table"), a.at("act")});
                            }});
  expect_null_data_refused(projection_backward_entry());
}

AdalnModulationInputs modulation_inputs(const Args& a, const Instance& t, bool bias) {
  return {a.at("temb"), a.at("weight"), bias ? a.at("bias") : kAbsent, t.plan("plan")};
}

Entry modulation_forward_entry() {
  return {"adaln_modulation_forward", "adaln_modulation", {"temb", "act"}, nullptr,
          {"temb", "weight", "bias", "table", "act", "out"}, [](const Args& a, const Instance& t) {
            return adaln_modulation_forward({modulation_inputs(a, t, true), a.at("table"), a.at("act"), a.at("out")});
          }};
}

Entry modulation_backward_entry() {
  return {"adaln_modulation_backward", "adaln_modulation", {"temb", "act"}, nullptr,
          {"temb", "weight", "act", "grad", "d_temb", "d_weight", "d_bias"}, [](const Args& a, const Instance& t) {
            return adaln_modulation_backward({modulation_inputs(a, t, false), a.at("act"), a.at("grad"),
                                              a.at("d_temb"), a.at("d_weight"), a.at("d_bias")});
          }};
}

TEST(FailClosed, AdalnModulationRefusesNullData) {
  expect_null_data_refused(modulation_forward_entry());
  expect_null_data_refused(modulation_backward_entry());
}

FinalAdalnOutInputs final_inputs(const Args& a, const Instance& t, bool bias) {
  return {a.at("x"), a.at("norm_weight"), a.at("temb"), a.at("weight"), bias ? a.at("bias") : kAbsent,
          t.plan("plan")};
}

Entry final_forward_entry() {
  return {"final_adaln_out_forward", "final_adaln_out", {"x", "act"}, nullptr,
          {"x", "norm_weight", "temb", "weight", "bias", "out", "table", "act", "rstd"},
          [](const Args& a, const Instance& t) {
            return final_adaln_out_forward(
                {final_inputs(a, t, true), a.at("out"), a.at("table"), a.at("act"), a.at("rstd")});
          }};
}

Entry final_backward_entry() {
  return {"final_adaln_out_backward", "final_adaln_out", {"x", "act"}, nullptr,
          {"x", "norm_weight", "temb", "weight", "table", "act", "rstd", "grad", "dx", "d_norm_weight", "d_temb",
           "d_weight", "d_bias"},
          [](const Args& a, const Instance& t) {
            return final_adaln_out_backward({final_inputs(a, t, false), a.at("table"), a.at("act"), a.at("rstd"),
                                             a.at("grad"), a.at("dx"), a.at("d_norm_weight"), a.at("d_temb"),
                                             a.at("d_weight"), a.at("d_bias")});
          }};
}

TEST(FailClosed, FinalAdalnOutRefusesNullData) {
  expect_null_data_refused(final_forward_entry());
  expect_null_data_refused(final_backward_entry());
}

RmsnormInputs norm_inputs(const Args& a, const Instance& t, bool modulated) {
  RmsnormInputs in;
  in.x = a.at("x");
  in.weight = a.at("weight");
  if (modulated) {
    in.shift = a.at("shift");
    in.scale = a.at("scale");
    in.plan = t.plan("plan");
  }
  return in;
}

void expect_rmsnorm_refuses_null_data(bool modulated) {
  std::vector<std::string> forward = {"x", "weight", "out", "rstd"};
  std::vector<std::string> backward = {"x", "weight", "rstd", "grad", "dx", "d_weight"};
  std::vector<std::string> needs = {"x", "d_weight"};
  std::function<void(Args*)> derive;
  if (modulated) {
    for (const char* n : {"shift", "scale"}) forward.push_back(n), backward.push_back(n);
    for (const char* n : {"d_shift", "d_scale"}) backward.push_back(n);
    needs.push_back("table");
    derive = [](Args* a) {
      (*a)["shift"] = chunk(*a, "table", "x", 0);
      (*a)["scale"] = chunk(*a, "table", "x", 1);
    };
  }
  // A plain case has neither the table nor its offset form.
  const std::vector<std::string> without =
      modulated ? std::vector<std::string>{} : std::vector<std::string>{"table", "shift_storage"};
  expect_null_data_refused({"rmsnorm_forward", "rmsnorm", needs, derive, forward,
                            [modulated](const Args& a, const Instance& t) {
                              return rmsnorm_forward({norm_inputs(a, t, modulated), a.at("out"), a.at("rstd")});
                            }},
                           without);
  expect_null_data_refused({"rmsnorm_backward", "rmsnorm", needs, derive, backward,
                            [modulated](const Args& a, const Instance& t) {
                              return rmsnorm_backward({norm_inputs(a, t, modulated), a.at("rstd"), a.at("grad"),
                                                       a.at("dx"), a.at("d_weight"),
                                                       modulated ? a.at("d_shift") : kAbsent,
                                                       modulated ? a.at("d_scale") : kAbsent});
                            }},
                           without);
}

TEST(FailClosed, RmsnormRefusesNullData) {
  expect_rmsnorm_refuses_null_data(false);
  expect_rmsnorm_refuses_null_data(true);
}

// gate, shift and scale are chunks 2, 3 and 4 of the case's (R, 6H) table.
GateResidualRmsnormInputs region_inputs(const Args& a, const Instance& t) {
  return {a.at("residual"), a.at("y"), a.at("gate"), a.at("weight"), a.at("shift"), a.at("scale"), t.plan("plan")};
}

TEST(FailClosed, GateResidualRmsnormRefusesNullData) {
  const std::vector<std::string> needs = {"table", "d_h", "d_shift"};
  auto derive = [](Args* a) {
    (*a)["gate"] = chunk(*a, "table", "residual", 2);
    (*a)["shift"] = chunk(*a, "table", "residual", 3);
    (*a)["scale"] = chunk(*a, "table", "residual", 4);
  };
  expect_null_data_refused({"gate_residual_rmsnorm_forward", "gate_residual_rmsnorm", needs, derive,
                            {"residual", "y", "gate", "weight", "shift", "scale", "h", "out", "rstd"},
                            [](const Args& a, const Instance& t) {
                              return gate_residual_rmsnorm_forward(
                                  {region_inputs(a, t), a.at("h"), a.at("out"), a.at("rstd")});
                            }});
  // residual is not read by the backward (gate_residual_rmsnorm.h).
  expect_null_data_refused(
      {"gate_residual_rmsnorm_backward", "gate_residual_rmsnorm", needs, derive,
       {"y", "gate", "weight", "shift", "scale", "h", "rstd", "d_out", "d_h", "d_residual", "d_y", "d_gate",
        "d_weight", "d_shift", "d_scale"},
       [](const Args& a, const Instance& t) {
         return gate_residual_rmsnorm_backward({region_inputs(a, t), a.at("h"), a.at("rstd"), a.at("d_out"),
                                                a.at("d_h"), a.at("d_residual"), a.at("d_y"), a.at("d_gate"),
                                                a.at("d_weight"), a.at("d_shift"), a.at("d_scale")});
       }});
}

// A null d_temb is refused under its own name before any output (d_weight,
// dx) is written, by each backward that ends in the projection's.
TEST(FailClosed, NullDTembRefusedBeforeAnyWrite) {
  auto only_d_temb = [](Entry entry) {
    entry.arguments = {"d_temb"};
    return entry;
  };
  expect_null_data_refused(only_d_temb(modulation_backward_entry()));
  expect_null_data_refused(only_d_temb(projection_backward_entry()));
  expect_null_data_refused(only_d_temb(final_backward_entry()));
}

// ---- silu_backward: null data, and an output that is an input's memory ----------

struct Silu {
  HostTensor grad = random_tensor(DType::kF32, {4, 8}, 1);
  HostTensor pre = random_tensor(DType::kF32, {4, 8}, 2);
  HostTensor d_pre{DType::kF32, {4, 8}};
  Silu() { d_pre.fill_bytes(kCanary); }
  SiluBackwardParams params() const { return {grad.view(), pre.view(), d_pre.view()}; }
};

TEST(FailClosed, SiluBackwardRefusesNullData) {
  for (TensorView SiluBackwardParams::*argument :
       {&SiluBackwardParams::grad, &SiluBackwardParams::pre, &SiluBackwardParams::d_pre}) {
    Silu s;
    SiluBackwardParams p = s.params();
    (p.*argument).data = nullptr;
    EXPECT_TRUE(refused(silu_backward(p), ErrorKind::kValue, "with a null data pointer"));
    EXPECT_TRUE(all_bytes_are(s.d_pre, kCanary));
  }
}

TEST(FailClosed, SiluBackwardRefusesAnOutputThatIsAnInput) {
  {
    Silu s;
    SiluBackwardParams p = s.params();
    p.d_pre = p.grad;
    const HostTensor before = s.grad;
    EXPECT_TRUE(refused(silu_backward(p), ErrorKind::kValue, "d_pre must not overlap grad"));
    EXPECT_BITWISE_EQ(before, s.grad);
  }
  {
    Silu s;
    SiluBackwardParams p = s.params();
    p.d_pre = p.pre;
    const HostTensor before = s.pre;
    EXPECT_TRUE(refused(silu_backward(p), ErrorKind::kValue, "d_pre must not overlap pre"));
    EXPECT_BITWISE_EQ(before, s.pre);
  }
}

// ---- saved outputs the headers require ----------------------------------------------

void expect_absent_refused(const Entry& entry, const std::string& argument) {
  SCOPED_TRACE(entry.name);
  Prepared p;
  prepare(entry, {}, &p);
  if (::testing::Test::HasFatalFailure()) return;
  Args broken = p.args;
  broken[argument] = TensorView();
  EXPECT_TRUE(refused(entry.call(broken, p.instance), ErrorKind::kValue, argument + " is required"));
  EXPECT_TRUE(outputs_untouched(p));
}

TEST(FailClosed, SavedActIsRequired) {
  expect_absent_refused(modulation_forward_entry(), "act");
  expect_absent_refused(final_forward_entry(), "act");
}

// ---- sizes that only the other arguments contradict -------------------------------

// temb (T, D) or weight (N, D) re-shaped to 2^40 rows over the same memory
// (validation reads no data), the outputs absent (the re-shaped view would
// overlap them), so that act, the weight's own rule or grad is what
// contradicts it: the scratch the backward
// needs would be petabytes, so only a refusal before any allocation gives the
// ValueError.
TEST(FailClosed, AdalnModulationBackwardChecksSizesBeforeScratch) {
  const Entry entry = modulation_backward_entry();
  Prepared p;
  prepare(entry, {}, &p);
  ASSERT_FALSE(HasFatalFailure());
  constexpr int64_t kHuge = int64_t{1} << 40;
  struct Huge {
    const char* argument;
    int64_t rows;
    const char* message;
  };
  for (const Huge& h : {Huge{"weight", kHuge, "weight must be (6 * H * 3, D)"},
                        Huge{"weight", 18 * (kHuge / 16), "grad must be (6, B*S, H)"},
                        Huge{"temb", kHuge, "must be (T, D) = (1099511627776, "}}) {
    SCOPED_TRACE(std::string(h.argument) + " rows " + std::to_string(h.rows));
    Args broken = p.args;
    broken["d_temb"] = broken["d_weight"] = broken["d_bias"] = TensorView();
    const TensorView& t = broken.at(h.argument);
    broken[h.argument] = TensorView::contiguous(t.data, t.dtype, {h.rows, t.shape[1]}, t.device);
    EXPECT_TRUE(refused(entry.call(broken, p.instance), ErrorKind::kValue, h.message));
    EXPECT_TRUE(outputs_untouched(p));
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
