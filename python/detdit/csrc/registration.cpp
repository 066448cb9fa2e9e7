// The torch registration of detdit: the custom classes, one def_op per op
// (its forward and backward schemas, their CPU and CUDA kernels, the
// forward's Autograd kernel), and the Python module `detdit._C`.
//
// Contract: TORCH_LIBRARY(detdit) defines `detdit::<op>` (returning the output
// and the tensors its backward needs) and `detdit::<op>_backward` (the raw
// backward, with an output mask where the op has one). The CPU and CUDA
// kernels of an op are the same function (ops.h, distributed.h): detdit
// dispatches on the tensors' device, and CUDA work runs on torch's current
// stream. The Autograd kernel is the op's Function (autograd.h). The plan
// constructors and release_scratch_memory have one kernel for every key
// (they take no differentiable input). rmsnorm and rmsnorm_backward have a `.plan` overload whose plan is
// not optional (ops.h says why); rmsnorm.plan's Autograd kernel is rmsnorm's
// Function. rmsnorm, gate_residual, gate_residual_rmsnorm and their backwards have a `.forms`
// overload (every modulation form and recipe, the plan optional; ops.h), whose
// Autograd kernel is its own Function; so have layernorm and
// layernorm_backward (the modulation), and their sp_ ops (the region's plan;
// distributed.h), and gate_residual_layernorm takes
// every form in its one overload. Every op with an IndexPlan that is not
// optional also has a `.tables` overload taking
// the plan's tables in its place (plan.h), whose Autograd kernel
// detdit/_compile.py registers. The classes' __obj_flatten__ (plan.h) and, from torch 2.4, the
// Python module of the fake kernels (detdit._compile, which torch imports
// when it needs one) serve torch.compile.
#include <Python.h>

#include <torch/library.h>
#ifdef DETDIT_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cstring>
#include <string>

#include "autograd.h"
#include "detdit/memory.h"
#include "distributed.h"
#include "ops.h"
#include "plan.h"

// The schema types of the plan classes.
#define DETDIT_PLAN "__torch__.torch.classes.detdit.IndexPlan"
#define DETDIT_SP_PLAN "__torch__.torch.classes.detdit.SpPlan"

namespace detdit_torch {
namespace {

// The operator name of a schema: what precedes its argument list.
std::string op_name(const char* schema) {
  const std::string text(schema);
  return text.substr(0, text.find('('));
}

// One op: defines the forward and backward schemas, registers `forward` and
// `backward` as their CPU and CUDA kernels and Function's Autograd kernel for
// the forward (the backward has none: first order only).
template <typename Function, typename Forward, typename Backward>
void def_op(torch::Library& m, const char* schema, Forward* forward, const char* backward_schema,
            Backward* backward) {
  m.def(schema);
  m.def(backward_schema);
  const std::string name = op_name(schema), backward_name = op_name(backward_schema);
  for (c10::DispatchKey key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA}) {
    m.impl(name.c_str(), key, forward);
    m.impl(backward_name.c_str(), key, backward);
  }
  m.impl(name.c_str(), c10::DispatchKey::Autograd, autograd_kernel<Function>(forward));
}

// rmsnorm.plan's Autograd kernel: rmsnorm's, with the plan as the optional one.
std::tuple<Tensor, Tensor> rmsnorm_plan_autograd(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                                 const OptTensor& scale, const PlanPtr& plan, double eps,
                                                 const std::string& numerics) {
  return autograd_kernel<RmsnormFunction>(&rmsnorm)(x, weight, shift, scale, OptPlan(plan), eps, numerics);
}

// The overloads that take a plan as a tensor, resolved to the plan it stands
// for before any kernel runs (plan.h): `.handle` (the backward ops: the
// plan's handle, what detdit/_compile.py's traced autograd saves, since torch
// 2.11 cannot save a plan for a compiled backward) and `.tables` (every op
// with an IndexPlan: the plan's tables, a compiled graph's tensor-only
// boundary for CUDA graphs). Each is the op on the resolved plan.
using PlanOfTensor = PlanPtr (*)(const Tensor&, const char*);

template <PlanOfTensor plan_of>
Tensor adaln_row_gather_backward_by(const Tensor& grad, const Tensor& plan_tensor, int64_t num_rows) {
  const PlanPtr plan = plan_of(plan_tensor, "adaln_row_gather_backward");
  if (plan->num_rows() != num_rows)
    C10_THROW_ERROR(ValueError, "adaln_row_gather_backward: num_rows must be the plan's " +
                                    std::to_string(plan->num_rows()) + ", got " + std::to_string(num_rows));
  return adaln_row_gather_backward(grad, plan);
}
template <PlanOfTensor plan_of>
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_by(const Tensor& grad, const Tensor& x,
                                                               const Tensor& weight, const OptTensor& shift,
                                                               const OptTensor& scale, const Tensor& plan_tensor,
                                                               const Tensor& rstd, double eps,
                                                               const std::string& numerics,
                                                               std::array<bool, 4> output_mask) {
  return rmsnorm_backward_plan(grad, x, weight, shift, scale, plan_of(plan_tensor, "rmsnorm_backward"), rstd, eps,
                               numerics, output_mask);
}
template <PlanOfTensor plan_of>
std::tuple<Tensor, Tensor, Tensor> gate_residual_backward_by(const Tensor& grad, const Tensor& y, const Tensor& gate,
                                                             const Tensor& plan_tensor,
                                                             std::array<bool, 3> output_mask) {
  return gate_residual_backward(grad, y, gate, plan_of(plan_tensor, "gate_residual_backward"), output_mask);
}
template <PlanOfTensor plan_of>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward_by(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const Tensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const Tensor& plan_tensor, const Tensor& h, const Tensor& rstd,
    double eps, const std::string& numerics, std::array<bool, 6> output_mask) {
  return gate_residual_rmsnorm_backward(d_out, d_h, y, gate, weight, shift, scale,
                                        plan_of(plan_tensor, "gate_residual_rmsnorm_backward"), h, rstd, eps,
                                        numerics, output_mask);
}
template <PlanOfTensor plan_of>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> final_adaln_out_backward_by(
    const Tensor& grad, const Tensor& x, const Tensor& norm_weight, const Tensor& temb, const Tensor& weight,
    const Tensor& table, const Tensor& act, const Tensor& rstd, const Tensor& plan_tensor, double eps,
    const std::string& numerics, std::array<bool, 5> output_mask) {
  return final_adaln_out_backward(grad, x, norm_weight, temb, weight, table, act, rstd,
                                  plan_of(plan_tensor, "final_adaln_out_backward"), eps, numerics, output_mask);
}
template <PlanOfTensor plan_of>
std::tuple<Tensor, Tensor, Tensor> adaln_modulation_backward_by(const Tensor& grad, const Tensor& temb,
                                                                const Tensor& weight, const Tensor& act,
                                                                const Tensor& plan_tensor,
                                                                const std::string& numerics,
                                                                std::array<bool, 3> output_mask) {
  return adaln_modulation_backward(grad, temb, weight, act, plan_of(plan_tensor, "adaln_modulation_backward"),
                                   numerics, output_mask);
}

// The `.tables` forward ops (their Autograd kernel is the traced Function of
// detdit/_compile.py, registered there).
Tensor adaln_row_gather_tables(const Tensor& rows, const Tensor& plan_tables) {
  return adaln_row_gather(rows, plan_of_tables(plan_tables, "adaln_row_gather"));
}
std::tuple<Tensor, Tensor> rmsnorm_tables(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                          const OptTensor& scale, const Tensor& plan_tables, double eps,
                                          const std::string& numerics) {
  return rmsnorm_plan(x, weight, shift, scale, plan_of_tables(plan_tables, "rmsnorm"), eps, numerics);
}
Tensor gate_residual_tables(const Tensor& residual, const Tensor& y, const Tensor& gate, const Tensor& plan_tables) {
  return gate_residual(residual, y, gate, plan_of_tables(plan_tables, "gate_residual"));
}
std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm_tables(const Tensor& residual, const Tensor& y,
                                                                const Tensor& gate, const Tensor& weight,
                                                                const OptTensor& shift, const OptTensor& scale,
                                                                const Tensor& plan_tables, double eps,
                                                                const std::string& numerics) {
  return gate_residual_rmsnorm(residual, y, gate, weight, shift, scale,
                               plan_of_tables(plan_tables, "gate_residual_rmsnorm"), eps, numerics);
}
std::tuple<Tensor, Tensor, Tensor, Tensor> final_adaln_out_tables(const Tensor& x, const Tensor& norm_weight,
                                                                  const Tensor& temb, const Tensor& weight,
                                                                  const Tensor& bias, const Tensor& plan_tables,
                                                                  double eps, const std::string& numerics) {
  return final_adaln_out(x, norm_weight, temb, weight, bias, plan_of_tables(plan_tables, "final_adaln_out"), eps,
                         numerics);
}
std::tuple<Tensor, Tensor, Tensor> adaln_modulation_tables(const Tensor& temb, const Tensor& weight,
                                                           const Tensor& bias, const Tensor& plan_tables,
                                                           const std::string& numerics) {
  return adaln_modulation(temb, weight, bias, plan_of_tables(plan_tables, "adaln_modulation"), numerics);
}
std::tuple<Tensor, Tensor, Tensor, Tensor> sp_rmsnorm_backward_handle(const Tensor& grad, const Tensor& x,
                                                                      const Tensor& weight, const OptTensor& shift,
                                                                      const OptTensor& scale, const Tensor& handle,
                                                                      const Tensor& rstd, int64_t comm, double eps,
                                                                      const std::string& numerics) {
  return sp_rmsnorm_backward(grad, x, weight, shift, scale, sp_plan_of_handle(handle, "sp_rmsnorm_backward"), rstd,
                             comm, eps, numerics);
}
std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_backward_handle(const Tensor& grad, const Tensor& y,
                                                                    const Tensor& gate, const Tensor& handle,
                                                                    int64_t comm) {
  return sp_gate_residual_backward(grad, y, gate, sp_plan_of_handle(handle, "sp_gate_residual_backward"), comm);
}
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm_backward_handle(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const Tensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const Tensor& handle, const Tensor& h, const Tensor& rstd,
    int64_t comm, double eps, const std::string& numerics) {
  return sp_gate_residual_rmsnorm_backward(d_out, d_h, y, gate, weight, shift, scale,
                                           sp_plan_of_handle(handle, "sp_gate_residual_rmsnorm_backward"), h, rstd,
                                           comm, eps, numerics);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> sp_rmsnorm_backward_forms_handle(
    const Tensor& grad, const Tensor& x, const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
    const Tensor& handle, const Tensor& rstd, int64_t comm, double eps, const std::string& numerics, bool upcast) {
  return sp_rmsnorm_backward_forms(grad, x, weight, shift, scale, sp_plan_of_handle(handle, "sp_rmsnorm_backward"),
                                   rstd, comm, eps, numerics, upcast);
}
std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_backward_forms_handle(const Tensor& grad, const Tensor& y,
                                                                          const OptTensor& gate, const Tensor& handle,
                                                                          int64_t comm, bool upcast,
                                                                          Optional<double> k) {
  return sp_gate_residual_backward_forms(grad, y, gate, sp_plan_of_handle(handle, "sp_gate_residual_backward"), comm,
                                         upcast, k);
}
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm_backward_forms_handle(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const Tensor& handle, const Tensor& h, const Tensor& rstd,
    int64_t comm, double eps, const std::string& numerics, bool upcast, Optional<double> k) {
  return sp_gate_residual_rmsnorm_backward_forms(d_out, d_h, y, gate, weight, shift, scale,
                                                 sp_plan_of_handle(handle, "sp_gate_residual_rmsnorm_backward"), h,
                                                 rstd, comm, eps, numerics, upcast, k);
}
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sp_layernorm_backward_handle(
    const Tensor& grad, const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const Tensor& handle, const Tensor& mean, const Tensor& rstd, int64_t comm, double eps,
    const std::string& numerics, bool upcast) {
  return sp_layernorm_backward(grad, x, weight, bias, shift, scale, sp_plan_of_handle(handle, "sp_layernorm_backward"),
                               mean, rstd, comm, eps, numerics, upcast);
}
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_layernorm_backward_handle(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& shift, const OptTensor& scale, const Tensor& handle, const Tensor& h,
    const Tensor& mean, const Tensor& rstd, int64_t comm, double eps, const std::string& numerics, bool upcast,
    Optional<double> k) {
  return sp_gate_residual_layernorm_backward(d_out, d_h, y, gate, weight, bias, shift, scale,
                                             sp_plan_of_handle(handle, "sp_gate_residual_layernorm_backward"), h,
                                             mean, rstd, comm, eps, numerics, upcast, k);
}

// `<op>.<overload>(...)`: the schema with its plan argument as `Tensor
// <argument>`, at the CPU and CUDA keys (a handle is on the CPU, the other
// tensors decide the key). A schema that names an overload already
// (`<op>.forms`) gets `<op>.forms_<overload>`: an operator name has one.
template <typename Kernel>
void def_tensor_plan_overload(torch::Library& m, const std::string& op_schema, const char* overload,
                              const char* argument, Kernel* kernel) {
  std::string schema = op_schema;
  const std::size_t paren = schema.find('(');
  const bool named = schema.substr(0, paren).find('.') != std::string::npos;
  schema.insert(paren, std::string(named ? "_" : ".") + overload);
  for (const char* plan : {DETDIT_PLAN " plan", DETDIT_PLAN "? plan", DETDIT_SP_PLAN " sp"}) {
    const std::size_t at = schema.find(plan);
    if (at != std::string::npos) schema.replace(at, std::strlen(plan), std::string("Tensor ") + argument);
  }
  m.def(schema.c_str());
  const std::string name = op_name(schema.c_str());
  for (c10::DispatchKey key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA}) m.impl(name.c_str(), key, kernel);
}
template <typename Kernel>
void def_handle_overload(torch::Library& m, const std::string& backward_schema, Kernel* kernel) {
  def_tensor_plan_overload(m, backward_schema, "handle", "plan_handle", kernel);
}
template <typename Kernel>
void def_tables_overload(torch::Library& m, const std::string& schema, Kernel* kernel) {
  def_tensor_plan_overload(m, schema, "tables", "plan_tables", kernel);
}

// A plan is no sequence: len() raises TypeError, as for any Python object
// without a length. Without the method, torch's ScriptObject answers len()
// with NotImplementedError, which code that probes for a sequence (torch's
// schema check in opcheck: try len(), catch TypeError) does not expect.
template <typename Holder>
int64_t plan_has_no_len(const c10::intrusive_ptr<Holder>&) {
  TORCH_CHECK_TYPE(false, "a detdit plan has no len()");
  return 0;
}

// detdit's CUDA scratch pool of `device` back to the driver
// (include/detdit/memory.h); the CPU has no pool. "cuda" without an index is
// torch's current device.
void release_scratch_memory(c10::Device device) {
  if (device.is_cpu()) return;
  if (!device.is_cuda())
    raise(detdit::Status::value_error("release_scratch_memory: device must be a cpu or cuda device, got " +
                                      device.str()));
  int index = device.has_index() ? device.index() : 0;
#ifdef DETDIT_TORCH_CUDA
  if (!device.has_index()) index = c10::cuda::current_device();
#endif
  check_ok(detdit::release_scratch_memory(detdit::Device::cuda(index)));
}

}  // namespace
}  // namespace detdit_torch

TORCH_LIBRARY(detdit, m) {
  using namespace detdit_torch;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  m.set_python_module("detdit._compile");
#endif
  // The forward schemas with an IndexPlan, which also get a `.tables` overload.
  static const std::string kAdalnRowGatherSchema = "adaln_row_gather(Tensor rows, " DETDIT_PLAN " plan) -> Tensor";
  static const std::string kRmsnormPlanSchema =
      "rmsnorm.plan(Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_PLAN
      " plan, float eps, str numerics) -> (Tensor, Tensor)";
  static const std::string kGateResidualSchema =
      "gate_residual(Tensor residual, Tensor y, Tensor gate, " DETDIT_PLAN " plan) -> Tensor";
  static const std::string kGateResidualRmsnormSchema =
      "gate_residual_rmsnorm(Tensor residual, Tensor y, Tensor gate, Tensor weight, Tensor? shift, Tensor? scale, "
      DETDIT_PLAN " plan, float eps, str numerics) -> (Tensor, Tensor, Tensor)";
  static const std::string kFinalAdalnOutSchema =
      "final_adaln_out(Tensor x, Tensor norm_weight, Tensor temb, Tensor weight, Tensor bias, " DETDIT_PLAN
      " plan, float eps, str numerics) -> (Tensor, Tensor, Tensor, Tensor)";
  static const std::string kAdalnModulationSchema =
      "adaln_modulation(Tensor temb, Tensor weight, Tensor bias, " DETDIT_PLAN
      " plan, str numerics) -> (Tensor, Tensor, Tensor)";
  // The backward schemas that also get a `.handle` overload (def_handle_overload)
  // and, those with an IndexPlan, a `.tables` one.
  static const std::string kRmsnormBackwardSchema =
      "rmsnorm_backward(Tensor grad, Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_PLAN
      "? plan, Tensor rstd, float eps, str numerics, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)";
  static const std::string kGateResidualBackwardSchema =
      "gate_residual_backward(Tensor grad, Tensor y, Tensor gate, " DETDIT_PLAN
      " plan, bool[3] output_mask) -> (Tensor, Tensor, Tensor)";
  static const std::string kGateResidualRmsnormBackwardSchema =
      "gate_residual_rmsnorm_backward(Tensor? d_out, Tensor? d_h, Tensor y, Tensor gate, Tensor weight, "
      "Tensor? shift, Tensor? scale, " DETDIT_PLAN " plan, Tensor h, Tensor rstd, float eps, str numerics, "
      "bool[6] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)";
  static const std::string kFinalAdalnOutBackwardSchema =
      "final_adaln_out_backward(Tensor grad, Tensor x, Tensor norm_weight, Tensor temb, Tensor weight, "
      "Tensor table, Tensor act, Tensor rstd, " DETDIT_PLAN
      " plan, float eps, str numerics, bool[5] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)";
  static const std::string kAdalnModulationBackwardSchema =
      "adaln_modulation_backward(Tensor grad, Tensor temb, Tensor weight, Tensor act, " DETDIT_PLAN
      " plan, str numerics, bool[3] output_mask) -> (Tensor, Tensor, Tensor)";
  static const std::string kSpRmsnormBackwardSchema =
      "sp_rmsnorm_backward(Tensor grad, Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN
      " sp, Tensor rstd, int comm, float eps, str numerics) -> (Tensor, Tensor, Tensor, Tensor)";
  static const std::string kSpGateResidualBackwardSchema =
      "sp_gate_residual_backward(Tensor grad, Tensor y, Tensor gate, " DETDIT_SP_PLAN
      " sp, int comm) -> (Tensor, Tensor, Tensor)";
  static const std::string kSpGateResidualRmsnormBackwardSchema =
      "sp_gate_residual_rmsnorm_backward(Tensor? d_out, Tensor? d_h, Tensor y, Tensor gate, Tensor weight, "
      "Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN " sp, Tensor h, Tensor rstd, int comm, float eps, "
      "str numerics) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)";
  static const std::string kSpRmsnormBackwardFormsSchema =
      "sp_rmsnorm_backward.forms(Tensor grad, Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN
      " sp, Tensor rstd, int comm, float eps, str numerics, bool upcast) -> (Tensor, Tensor, Tensor, Tensor)";
  static const std::string kSpGateResidualBackwardFormsSchema =
      "sp_gate_residual_backward.forms(Tensor grad, Tensor y, Tensor? gate, " DETDIT_SP_PLAN
      " sp, int comm, bool upcast, float? k) -> (Tensor, Tensor, Tensor)";
  static const std::string kSpGateResidualRmsnormBackwardFormsSchema =
      "sp_gate_residual_rmsnorm_backward.forms(Tensor? d_out, Tensor? d_h, Tensor y, Tensor? gate, Tensor weight, "
      "Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN " sp, Tensor h, Tensor rstd, int comm, float eps, "
      "str numerics, bool upcast, float? k) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)";
  static const std::string kSpLayernormBackwardSchema =
      "sp_layernorm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, Tensor? shift, Tensor? scale, "
      DETDIT_SP_PLAN " sp, Tensor mean, Tensor rstd, int comm, float eps, str numerics, bool upcast) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)";
  static const std::string kSpGateResidualLayernormBackwardSchema =
      "sp_gate_residual_layernorm_backward(Tensor? d_out, Tensor? d_h, Tensor y, Tensor? gate, Tensor? weight, "
      "Tensor? bias, Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN " sp, Tensor h, Tensor mean, Tensor rstd, "
      "int comm, float eps, str numerics, bool upcast, float? k) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)";
  m.class_<PlanHolder>("IndexPlan")
      .def("seq_len", &PlanHolder::seq_len)
      .def("batch", &PlanHolder::batch)
      .def("num_rows", &PlanHolder::num_rows)
      .def("positions", &PlanHolder::positions)
      .def("num_chunks", &PlanHolder::num_chunks)
      .def("num_segments", &PlanHolder::num_segments)
      .def("device", &PlanHolder::device)
      .def("row_index", &PlanHolder::row_index)
      .def("__repr__", &PlanHolder::repr)
      .def("__str__", &PlanHolder::repr)
      .def("__obj_flatten__", &PlanHolder::flatten)
      .def("handle", [](const PlanPtr& self) { return plan_handle(self); })
      .def("tables", [](const PlanPtr& self) { return plan_tables(self); })
      .def("__len__", &plan_has_no_len<PlanHolder>)
      .def("__eq__", [](const PlanPtr& self, const PlanPtr& other) { return same_table(self->plan, other->plan); })
      .def("__ne__", [](const PlanPtr& self, const PlanPtr& other) { return !same_table(self->plan, other->plan); })
      .def_pickle([](const PlanPtr& self) { return plan_state(self->plan); },
                  [](PlanHolder::State state) { return plan_from_state(state); });
  m.class_<SpPlanHolder>("SpPlan")
      .def("world", &SpPlanHolder::world)
      .def("rank", &SpPlanHolder::rank)
      .def("local_begin", &SpPlanHolder::local_begin)
      .def("local_end", &SpPlanHolder::local_end)
      .def("local_seq_len", &SpPlanHolder::local_seq_len)
      .def("max_send", &SpPlanHolder::max_send)
      .def("__obj_flatten__", &SpPlanHolder::flatten)
      .def("handle", [](const SpPlanPtr& self) { return sp_plan_handle(self); })
      .def("__len__", &plan_has_no_len<SpPlanHolder>)
      .def("__eq__", [](const SpPlanPtr& self, const SpPlanPtr& other) { return self->equals(*other); })
      .def("__ne__", [](const SpPlanPtr& self, const SpPlanPtr& other) { return !self->equals(*other); })
      .def_pickle([](const SpPlanPtr& self) { return self->state(); },
                  [](SpPlanHolder::State state) { return sp_plan_from_state(state); });
  // A plan's handle as an op beside the method: a traced autograd Function
  // saves it for the backward, and tracing runs an op's fake kernel where it
  // would call the method of a real plan (opcheck's AOT dispatch), leaving a
  // real tensor in a fake graph. No tensor argument: CompositeExplicitAutograd.
  m.def("plan_handle(" DETDIT_PLAN " plan) -> Tensor");
  m.impl("plan_handle", c10::DispatchKey::CompositeExplicitAutograd, &plan_handle);
  m.def("plan_handle.sp(" DETDIT_SP_PLAN " sp) -> Tensor");
  m.impl("plan_handle.sp", c10::DispatchKey::CompositeExplicitAutograd, &sp_plan_handle);
  m.def("plan(Tensor timestep_indices, Tensor token_tags, int num_timesteps, int batch) -> " DETDIT_PLAN,
        &make_plan);
  m.def("plan_from_rows(Tensor row_index, int num_rows, int batch) -> " DETDIT_PLAN, &make_plan_from_rows);
  // Memory management, not part of a model: no tensor argument, one kernel for every key.
  m.def("release_scratch_memory(Device device) -> ()", &release_scratch_memory);

  def_op<TimestepSinusoidFunction>(
      m,
      "timestep_sinusoid(Tensor timesteps, int num_channels, float max_period, str numerics, "
      "bool check_range=True, bool flip_sin_to_cos=True, float downscale_freq_shift=0.0, float scale=1.0, "
      "float t_max=1.0) -> Tensor",
      &timestep_sinusoid,
      "timestep_sinusoid_backward(Tensor grad_features, Tensor timesteps, float max_period, str numerics, "
      "bool check_range=True, bool flip_sin_to_cos=True, float downscale_freq_shift=0.0, float scale=1.0, "
      "float t_max=1.0) -> Tensor",
      &timestep_sinusoid_backward);
  def_op<LinearFunction>(
      m, "linear(Tensor x, Tensor weight, Tensor? bias, str activation, str numerics) -> (Tensor, Tensor)", &linear,
      "linear_backward(Tensor grad, Tensor x, Tensor weight, Tensor pre, str activation, str numerics, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
      &linear_backward);
  def_op<TimestepMlpFunction>(
      m,
      "timestep_mlp(Tensor features, Tensor w1, Tensor b1, Tensor w2, Tensor b2, str numerics) "
      "-> (Tensor, Tensor, Tensor)",
      &timestep_mlp,
      "timestep_mlp_backward(Tensor grad_temb, Tensor features, Tensor w1, Tensor w2, Tensor pre, "
      "Tensor hidden, str numerics, bool[5] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      &timestep_mlp_backward);
  def_op<AdalnProjectionFunction>(
      m, "adaln_projection(Tensor temb, Tensor weight, Tensor bias, str numerics, int chunks=0) -> (Tensor, Tensor)",
      &adaln_projection,
      "adaln_projection_backward(Tensor grad_table, Tensor temb, Tensor weight, Tensor act, str numerics, "
      "bool[3] output_mask, int chunks=0) -> (Tensor, Tensor, Tensor)",
      &adaln_projection_backward);
  def_op<AdalnTableAddFunction>(
      m, "adaln_table_add(Tensor table, Tensor proj) -> Tensor", &adaln_table_add,
      "adaln_table_add_backward(Tensor grad, ScalarType table_dtype, ScalarType proj_dtype, bool proj_broadcast, "
      "bool[2] output_mask) -> (Tensor, Tensor)",
      &adaln_table_add_backward);
  // The families' chunk orders (adaln.h): no tensor argument, one kernel for every key.
  m.def("adaln_chunk_order(str name) -> str[]", &adaln_chunk_order);
  def_op<AdalnRowGatherFunction>(m, kAdalnRowGatherSchema.c_str(), &adaln_row_gather,
                                 "adaln_row_gather_backward(Tensor grad, " DETDIT_PLAN " plan) -> Tensor",
                                 &adaln_row_gather_backward);
  def_op<RmsnormFunction>(
      m,
      "rmsnorm(Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_PLAN
      "? plan, float eps, str numerics) -> (Tensor, Tensor)",
      &rmsnorm,
      kRmsnormBackwardSchema.c_str(),
      &rmsnorm_backward);
  m.def(kRmsnormPlanSchema.c_str());
  m.def("rmsnorm_backward.plan(Tensor grad, Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_PLAN
        " plan, Tensor rstd, float eps, str numerics, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  for (c10::DispatchKey key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA}) {
    m.impl("rmsnorm.plan", key, &rmsnorm_plan);
    m.impl("rmsnorm_backward.plan", key, &rmsnorm_backward_plan);
  }
  m.impl("rmsnorm.plan", c10::DispatchKey::Autograd, &rmsnorm_plan_autograd);
  def_op<GateResidualFunction>(
      m, kGateResidualSchema.c_str(), &gate_residual,
      kGateResidualBackwardSchema.c_str(),
      &gate_residual_backward);
  // The modulation forms and recipes (ops.h): `.forms` overloads, the plan optional.
  def_op<RmsnormFormsFunction>(
      m,
      "rmsnorm.forms(Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_PLAN
      "? plan, float eps, str numerics, bool upcast) -> (Tensor, Tensor)",
      &rmsnorm_forms,
      "rmsnorm_backward.forms(Tensor grad, Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_PLAN
      "? plan, Tensor rstd, float eps, str numerics, bool upcast, bool[4] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor)",
      &rmsnorm_backward_forms);
  def_op<GateResidualFormsFunction>(
      m,
      "gate_residual.forms(Tensor residual, Tensor y, Tensor? gate, " DETDIT_PLAN
      "? plan, bool upcast, float? k) -> Tensor",
      &gate_residual_forms,
      "gate_residual_backward.forms(Tensor grad, Tensor y, Tensor? gate, " DETDIT_PLAN
      "? plan, bool upcast, float? k, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
      &gate_residual_backward_forms);
  def_op<GateResidualRmsnormFunction>(
      m, kGateResidualRmsnormSchema.c_str(), &gate_residual_rmsnorm,
      kGateResidualRmsnormBackwardSchema.c_str(),
      &gate_residual_rmsnorm_backward);
  def_op<GateResidualRmsnormFormsFunction>(
      m,
      "gate_residual_rmsnorm.forms(Tensor residual, Tensor y, Tensor? gate, Tensor weight, Tensor? shift, "
      "Tensor? scale, " DETDIT_PLAN "? plan, float eps, str numerics, bool upcast, float? k) "
      "-> (Tensor, Tensor, Tensor)",
      &gate_residual_rmsnorm_forms,
      "gate_residual_rmsnorm_backward.forms(Tensor? d_out, Tensor? d_h, Tensor y, Tensor? gate, Tensor weight, "
      "Tensor? shift, Tensor? scale, " DETDIT_PLAN "? plan, Tensor h, Tensor rstd, float eps, str numerics, "
      "bool upcast, float? k, bool[6] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      &gate_residual_rmsnorm_backward_forms);
  def_op<FinalAdalnOutFunction>(
      m, kFinalAdalnOutSchema.c_str(), &final_adaln_out,
      kFinalAdalnOutBackwardSchema.c_str(),
      &final_adaln_out_backward);
  def_op<AdalnModulationFunction>(
      m, kAdalnModulationSchema.c_str(), &adaln_modulation,
      kAdalnModulationBackwardSchema.c_str(),
      &adaln_modulation_backward);

  // detdit.distributed: `comm` is a handle from _C._register_communicator.
  m.def("sp_plan(" DETDIT_PLAN "? plan, int world, int rank) -> " DETDIT_SP_PLAN, &make_sp_plan);
  m.def("sp_plan.positions(int seq_len, int batch, int world, int rank) -> " DETDIT_SP_PLAN,
        &make_sp_plan_positions);
  def_op<TpAdalnProjectionFunction>(
      m, "tp_adaln_projection(Tensor temb, Tensor weight, Tensor bias, int comm, str numerics, "
      "int? out_features=None, int chunks=0) -> (Tensor, Tensor)",
      &tp_adaln_projection,
      "tp_adaln_projection_backward(Tensor grad_table, Tensor temb, Tensor weight, Tensor act, int comm, "
      "str numerics, bool[3] output_mask, int chunks=0) -> (Tensor, Tensor, Tensor)",
      &tp_adaln_projection_backward);
  def_op<SpRmsnormFunction>(
      m,
      "sp_rmsnorm(Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN
      " sp, int comm, float eps, str numerics) -> (Tensor, Tensor)",
      &sp_rmsnorm,
      kSpRmsnormBackwardSchema.c_str(),
      &sp_rmsnorm_backward);
  def_op<SpGateResidualFunction>(
      m, "sp_gate_residual(Tensor residual, Tensor y, Tensor gate, " DETDIT_SP_PLAN " sp, int comm) -> Tensor",
      &sp_gate_residual,
      kSpGateResidualBackwardSchema.c_str(),
      &sp_gate_residual_backward);
  def_op<SpGateResidualRmsnormFunction>(
      m,
      "sp_gate_residual_rmsnorm(Tensor residual, Tensor y, Tensor gate, Tensor weight, Tensor? shift, "
      "Tensor? scale, " DETDIT_SP_PLAN " sp, int comm, float eps, str numerics) -> (Tensor, Tensor, Tensor)",
      &sp_gate_residual_rmsnorm,
      kSpGateResidualRmsnormBackwardSchema.c_str(),
      &sp_gate_residual_rmsnorm_backward);

  def_op<SpRmsnormFormsFunction>(
      m,
      "sp_rmsnorm.forms(Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN
      " sp, int comm, float eps, str numerics, bool upcast) -> (Tensor, Tensor)",
      &sp_rmsnorm_forms,
      kSpRmsnormBackwardFormsSchema.c_str(),
      &sp_rmsnorm_backward_forms);
  def_op<SpGateResidualFormsFunction>(
      m,
      "sp_gate_residual.forms(Tensor residual, Tensor y, Tensor? gate, " DETDIT_SP_PLAN
      " sp, int comm, bool upcast, float? k) -> Tensor",
      &sp_gate_residual_forms,
      kSpGateResidualBackwardFormsSchema.c_str(),
      &sp_gate_residual_backward_forms);
  def_op<SpGateResidualRmsnormFormsFunction>(
      m,
      "sp_gate_residual_rmsnorm.forms(Tensor residual, Tensor y, Tensor? gate, Tensor weight, Tensor? shift, "
      "Tensor? scale, " DETDIT_SP_PLAN " sp, int comm, float eps, str numerics, bool upcast, float? k) "
      "-> (Tensor, Tensor, Tensor)",
      &sp_gate_residual_rmsnorm_forms,
      kSpGateResidualRmsnormBackwardFormsSchema.c_str(),
      &sp_gate_residual_rmsnorm_backward_forms);
  def_op<SpLayernormFunction>(
      m,
      "sp_layernorm(Tensor x, Tensor? weight, Tensor? bias, Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN
      " sp, int comm, float eps, str numerics, bool upcast) -> (Tensor, Tensor, Tensor)",
      &sp_layernorm,
      kSpLayernormBackwardSchema.c_str(),
      &sp_layernorm_backward);
  def_op<SpGateResidualLayernormFunction>(
      m,
      "sp_gate_residual_layernorm(Tensor residual, Tensor y, Tensor? gate, Tensor? weight, Tensor? bias, "
      "Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN " sp, int comm, float eps, str numerics, bool upcast, "
      "float? k) -> (Tensor, Tensor, Tensor, Tensor)",
      &sp_gate_residual_layernorm,
      kSpGateResidualLayernormBackwardSchema.c_str(),
      &sp_gate_residual_layernorm_backward);

  def_op<LayernormFunction>(
      m, "layernorm(Tensor x, Tensor? weight, Tensor? bias, float eps, str numerics) -> (Tensor, Tensor, Tensor)",
      &layernorm,
      "layernorm_backward(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, float eps, "
      "str numerics, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
      &layernorm_backward);
  def_op<LayernormFormsFunction>(
      m,
      "layernorm.forms(Tensor x, Tensor? weight, Tensor? bias, Tensor? shift, Tensor? scale, " DETDIT_PLAN
      "? plan, float eps, str numerics, bool upcast) -> (Tensor, Tensor, Tensor)",
      &layernorm_forms,
      "layernorm_backward.forms(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, Tensor? shift, Tensor? scale, "
      DETDIT_PLAN "? plan, Tensor mean, Tensor rstd, float eps, str numerics, bool upcast, bool[5] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      &layernorm_backward_forms);
  def_op<GateResidualLayernormFunction>(
      m,
      "gate_residual_layernorm(Tensor residual, Tensor y, Tensor? gate, Tensor? weight, Tensor? bias, "
      "Tensor? shift, Tensor? scale, " DETDIT_PLAN "? plan, float eps, str numerics, bool upcast, float? k) "
      "-> (Tensor, Tensor, Tensor, Tensor)",
      &gate_residual_layernorm,
      "gate_residual_layernorm_backward(Tensor? d_out, Tensor? d_h, Tensor y, Tensor? gate, Tensor? weight, "
      "Tensor? bias, Tensor? shift, Tensor? scale, " DETDIT_PLAN "? plan, Tensor h, Tensor mean, Tensor rstd, "
      "float eps, str numerics, bool upcast, float? k, bool[7] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      &gate_residual_layernorm_backward);

  // The `.handle` and `.tables` overloads (plan.h, registration above).
  // adaln_row_gather_backward's also take the plan's num_rows, which its fake
  // kernel needs.
  static const std::string kAdalnRowGatherBackwardByTensorSchema =
      "adaln_row_gather_backward(Tensor grad, " DETDIT_PLAN " plan, int num_rows) -> Tensor";
  def_handle_overload(m, kAdalnRowGatherBackwardByTensorSchema, &adaln_row_gather_backward_by<plan_of_handle>);
  def_handle_overload(m, kRmsnormBackwardSchema, &rmsnorm_backward_by<plan_of_handle>);
  def_handle_overload(m, kGateResidualBackwardSchema, &gate_residual_backward_by<plan_of_handle>);
  def_handle_overload(m, kGateResidualRmsnormBackwardSchema, &gate_residual_rmsnorm_backward_by<plan_of_handle>);
  def_handle_overload(m, kFinalAdalnOutBackwardSchema, &final_adaln_out_backward_by<plan_of_handle>);
  def_handle_overload(m, kAdalnModulationBackwardSchema, &adaln_modulation_backward_by<plan_of_handle>);
  def_tables_overload(m, kAdalnRowGatherSchema, &adaln_row_gather_tables);
  def_tables_overload(m, "rmsnorm" + kRmsnormPlanSchema.substr(kRmsnormPlanSchema.find('(')), &rmsnorm_tables);
  def_tables_overload(m, kGateResidualSchema, &gate_residual_tables);
  def_tables_overload(m, kGateResidualRmsnormSchema, &gate_residual_rmsnorm_tables);
  def_tables_overload(m, kFinalAdalnOutSchema, &final_adaln_out_tables);
  def_tables_overload(m, kAdalnModulationSchema, &adaln_modulation_tables);
  def_tables_overload(m, kAdalnRowGatherBackwardByTensorSchema, &adaln_row_gather_backward_by<plan_of_tables>);
  def_tables_overload(m, kRmsnormBackwardSchema, &rmsnorm_backward_by<plan_of_tables>);
  def_tables_overload(m, kGateResidualBackwardSchema, &gate_residual_backward_by<plan_of_tables>);
  def_tables_overload(m, kGateResidualRmsnormBackwardSchema, &gate_residual_rmsnorm_backward_by<plan_of_tables>);
  def_tables_overload(m, kFinalAdalnOutBackwardSchema, &final_adaln_out_backward_by<plan_of_tables>);
  def_tables_overload(m, kAdalnModulationBackwardSchema, &adaln_modulation_backward_by<plan_of_tables>);
  def_handle_overload(m, kSpRmsnormBackwardSchema, &sp_rmsnorm_backward_handle);
  def_handle_overload(m, kSpGateResidualBackwardSchema, &sp_gate_residual_backward_handle);
  def_handle_overload(m, kSpGateResidualRmsnormBackwardSchema, &sp_gate_residual_rmsnorm_backward_handle);
  def_handle_overload(m, kSpRmsnormBackwardFormsSchema, &sp_rmsnorm_backward_forms_handle);
  def_handle_overload(m, kSpGateResidualBackwardFormsSchema, &sp_gate_residual_backward_forms_handle);
  def_handle_overload(m, kSpGateResidualRmsnormBackwardFormsSchema, &sp_gate_residual_rmsnorm_backward_forms_handle);
  def_handle_overload(m, kSpLayernormBackwardSchema, &sp_layernorm_backward_handle);
  def_handle_overload(m, kSpGateResidualLayernormBackwardSchema, &sp_gate_residual_layernorm_backward_handle);
}

// `import detdit._C` loads this library, which registers the operators above
// (torch.ops.detdit.*); the module itself holds only the communicator registry.
static PyMethodDef detdit_methods[] = {
    {"_register_communicator", detdit_torch::register_communicator, METH_VARARGS,
     "_register_communicator(gather, rank, world, device) -> handle"},
    {"_release_communicator", detdit_torch::release_communicator, METH_VARARGS, "_release_communicator(handle)"},
    {"_tp_column_shard", detdit_torch::tp_column_shard, METH_VARARGS,
     "_tp_column_shard(columns, world, rank) -> (begin, end)"},
    {nullptr, nullptr, 0, nullptr}};

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "detdit._C", nullptr, -1, detdit_methods,
                               nullptr,               nullptr,     nullptr, nullptr};
  return PyModule_Create(&module);
}
