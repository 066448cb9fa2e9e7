// The autograd Functions of every detdit op, and the Autograd kernel made of
// each (autograd_kernel<Function>(&forward_kernel)), registered by
// registration.cpp, the one file that includes this header.
//
// Contract:
// - One torch::autograd::Function per forward op. Its forward calls the op
//   below autograd (at::AutoDispatchBelowADInplaceOrView) and saves what the
//   backward op reads; its backward calls the op's backward op with
//   contiguous grads and an output mask of the inputs that
//   require grad (the sp_ backward kernels take none: they compute every
//   gradient, distributed.h), and returns one grad per forward argument
//   (undefined for non-tensors and for inputs that do not require grad).
// - Autograd hands a zero tensor for an output that received no gradient,
//   except to the gate_residual_rmsnorm Functions, which must tell one from a
//   zero gradient (see GateResidualRmsnormFunction).
// - The tensors a forward returns for its backward (rstd, act, pre, ...) are
//   marked non-differentiable.
// - Both calls go through the dispatcher (DETDIT_OP), never to the kernel
//   directly, so that torch.compile traces them as the ops they are. This is
//   the op's autograd wherever its plan argument is a real plan: eager, and
//   tracing with a real plan (torch.library.opcheck); under torch.compile the
//   plan is a fake one that only Python can hold, and detdit/_compile.py
//   registers the same Functions in Python for that case.
// - First order only: detdit's backward kernels are not differentiable, so a
//   backward under create_graph=True is a RuntimeError instead of silently
//   treating first-order grads as constants.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <initializer_list>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "distributed.h"
#include "ops.h"

namespace detdit_torch {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Backward grads arrive expanded or strided; detdit takes contiguous ones.
inline Tensor contiguous_grad(const Tensor& grad) { return grad.defined() ? grad.contiguous() : grad; }

inline bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const OptTensor& t) { return t.has_value() && requires_grad(*t); }

// The operator detdit::<name> whose kernel is Kernel, called through the
// dispatcher: the Functions call their forward and backward ops this way, so
// that the modes of torch.compile's tracing (fake tensors, functionalization,
// the graph recorder) see each call and record it as one node; a kernel called
// directly would be handed tensors without data there.
template <auto* Kernel>
const auto& dispatched(const char* name, const char* overload = "") {
  using Signature = std::remove_pointer_t<decltype(Kernel)>;
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).template typed<Signature>();
  return handle;
}
// DETDIT_OP(kernel)(args...): the call of detdit::<kernel> through the dispatcher.
#define DETDIT_OP(kernel) dispatched<&kernel>("detdit::" #kernel).call
// DETDIT_OP_FORMS(op)(args...): the call of detdit::<op>.forms (kernel <op>_forms).
#define DETDIT_OP_FORMS(op) dispatched<&op##_forms>("detdit::" #op, "forms").call

// detdit's backward kernels are not differentiable: a double backward
// (create_graph=True) fails instead of treating first-order grads as constants.
inline void check_first_order() {
  if (at::GradMode::is_enabled())
    C10_THROW_ERROR(Error, "detdit ops support first-order gradients only: backward with create_graph=True "
                           "(double backward) is not implemented");
}

// The backward's output mask: which of the forward's tensor inputs require grad.
inline void save_needs(AutogradContext* ctx, std::initializer_list<bool> needs) {
  ctx->saved_data["needs"] = c10::List<bool>(needs);
}

template <size_t N>
std::array<bool, N> saved_needs(AutogradContext* ctx) {
  const c10::List<bool> needs = ctx->saved_data["needs"].toBoolList();
  std::array<bool, N> mask{};
  for (size_t i = 0; i < N; ++i) mask[i] = needs.get(i);
  return mask;
}

// A gradient that may not have arrived (set_materialize_grads(false)): absent
// when undefined, else contiguous.
inline OptTensor optional_grad(const Tensor& grad) {
  return grad.defined() ? OptTensor(grad.contiguous()) : OptTensor();
}

// An optional input saved as a tensor (undefined when absent), restored.
inline OptTensor saved_optional(const Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); }

inline PlanPtr saved_plan(AutogradContext* ctx) { return ctx->saved_data["plan"].toCustomClass<PlanHolder>(); }

inline c10::IValue plan_ivalue(const OptPlan& plan) { return plan.has_value() ? c10::IValue(*plan) : c10::IValue(); }
inline OptPlan plan_from_ivalue(const c10::IValue& value) {
  if (value.isNone()) return OptPlan();
  return value.toCustomClass<PlanHolder>();
}

inline SpPlanPtr saved_sp(AutogradContext* ctx) { return ctx->saved_data["sp"].toCustomClass<SpPlanHolder>(); }

// ---------------------------------------------------------------------------
// The Functions, in the order of ops.h and distributed.h

struct TimestepSinusoidFunction : torch::autograd::Function<TimestepSinusoidFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& timesteps, int64_t num_channels, double max_period,
                        const std::string& numerics, bool check_range, bool flip_sin_to_cos,
                        double downscale_freq_shift, double scale, double t_max) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({timesteps});
    ctx->saved_data["max_period"] = max_period;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["check_range"] = check_range;
    ctx->saved_data["flip_sin_to_cos"] = flip_sin_to_cos;
    ctx->saved_data["downscale_freq_shift"] = downscale_freq_shift;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["t_max"] = t_max;
    return DETDIT_OP(timestep_sinusoid)(timesteps, num_channels, max_period, numerics, check_range, flip_sin_to_cos,
                                        downscale_freq_shift, scale, t_max);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    const Tensor timesteps = ctx->get_saved_variables()[0];
    Tensor d_t = DETDIT_OP(timestep_sinusoid_backward)(
        contiguous_grad(grads[0]), timesteps, ctx->saved_data["max_period"].toDouble(),
        ctx->saved_data["numerics"].toStringRef(), ctx->saved_data["check_range"].toBool(),
        ctx->saved_data["flip_sin_to_cos"].toBool(), ctx->saved_data["downscale_freq_shift"].toDouble(),
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["t_max"].toDouble());
    return {d_t, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               const std::string& activation, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, pre] = DETDIT_OP(linear)(x, weight, bias, activation, numerics);
    ctx->save_for_backward({x, weight, pre});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(x), requires_grad(weight), requires_grad(bias)});
    ctx->mark_non_differentiable({pre});
    return {out, pre};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_x, d_weight, d_bias] =
        DETDIT_OP(linear_backward)(contiguous_grad(grads[0]), s[0], s[1], s[2], ctx->saved_data["activation"].toStringRef(),
                                   ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx));
    return {d_x, d_weight, d_bias, Tensor(), Tensor()};
  }
};

struct TimestepMlpFunction : torch::autograd::Function<TimestepMlpFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& features, const Tensor& w1, const Tensor& b1,
                               const Tensor& w2, const Tensor& b2, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [temb, pre, hidden] = DETDIT_OP(timestep_mlp)(features, w1, b1, w2, b2, numerics);
    ctx->save_for_backward({features, w1, w2, pre, hidden});
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(features), requires_grad(w1), requires_grad(b1), requires_grad(w2),
                     requires_grad(b2)});
    ctx->mark_non_differentiable({pre, hidden});
    return {temb, pre, hidden};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_f, d_w1, d_b1, d_w2, d_b2] =
        DETDIT_OP(timestep_mlp_backward)(contiguous_grad(grads[0]), s[0], s[1], s[2], s[3], s[4],
                                         ctx->saved_data["numerics"].toStringRef(), saved_needs<5>(ctx));
    return {d_f, d_w1, d_b1, d_w2, d_b2, Tensor()};
  }
};

struct AdalnProjectionFunction : torch::autograd::Function<AdalnProjectionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& temb, const Tensor& weight, const Tensor& bias,
                               const std::string& numerics, int64_t chunks) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [table, act] = DETDIT_OP(adaln_projection)(temb, weight, bias, numerics, chunks);
    ctx->save_for_backward({temb, weight, act});
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["chunks"] = chunks;
    save_needs(ctx, {requires_grad(temb), requires_grad(weight), requires_grad(bias)});
    ctx->mark_non_differentiable({act});
    return {table, act};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_temb, d_weight, d_bias] = DETDIT_OP(adaln_projection_backward)(
        contiguous_grad(grads[0]), s[0], s[1], s[2], ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx),
        ctx->saved_data["chunks"].toInt());
    return {d_temb, d_weight, d_bias, Tensor(), Tensor()};
  }
};

// adaln_table_add: the backward needs only the operands' dtypes and whether
// proj was broadcast over K (nothing saved but metadata).
struct AdalnTableAddFunction : torch::autograd::Function<AdalnTableAddFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& table, const Tensor& proj) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = DETDIT_OP(adaln_table_add)(table, proj);
    ctx->saved_data["table_dtype"] = static_cast<int64_t>(table.scalar_type());
    ctx->saved_data["proj_dtype"] = static_cast<int64_t>(proj.scalar_type());
    ctx->saved_data["broadcast"] = proj.dim() == 3 && proj.size(1) == 1 && out.size(1) != 1;
    save_needs(ctx, {requires_grad(table), requires_grad(proj)});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto [d_table, d_proj] = DETDIT_OP(adaln_table_add_backward)(
        contiguous_grad(grads[0]), static_cast<at::ScalarType>(ctx->saved_data["table_dtype"].toInt()),
        static_cast<at::ScalarType>(ctx->saved_data["proj_dtype"].toInt()), ctx->saved_data["broadcast"].toBool(),
        saved_needs<2>(ctx));
    return {d_table, d_proj};
  }
};

struct AdalnRowGatherFunction : torch::autograd::Function<AdalnRowGatherFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& rows, const PlanPtr& plan) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["plan"] = plan;
    return DETDIT_OP(adaln_row_gather)(rows, plan);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    return {DETDIT_OP(adaln_row_gather_backward)(contiguous_grad(grads[0]), saved_plan(ctx)), Tensor()};
  }
};

struct RmsnormFunction : torch::autograd::Function<RmsnormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& shift,
                               const OptTensor& scale, const OptPlan& plan, double eps,
                               const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = DETDIT_OP(rmsnorm)(x, weight, shift, scale, plan, eps, numerics);
    ctx->save_for_backward({x, weight, shift.value_or(Tensor()), scale.value_or(Tensor()), rstd});
    ctx->saved_data["plan"] = plan_ivalue(plan);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(x), requires_grad(weight), requires_grad(shift), requires_grad(scale)});
    ctx->mark_non_differentiable({rstd});
    return {out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [dx, d_weight, d_shift, d_scale] =
        DETDIT_OP(rmsnorm_backward)(contiguous_grad(grads[0]), s[0], s[1], saved_optional(s[2]), saved_optional(s[3]),
                                    plan_from_ivalue(ctx->saved_data["plan"]), s[4], ctx->saved_data["eps"].toDouble(),
                                    ctx->saved_data["numerics"].toStringRef(), saved_needs<4>(ctx));
    return {dx, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor()};
  }
};

struct GateResidualFunction : torch::autograd::Function<GateResidualFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const Tensor& gate,
                        const PlanPtr& plan) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = DETDIT_OP(gate_residual)(residual, y, gate, plan);
    ctx->save_for_backward({y, gate});
    ctx->saved_data["plan"] = plan;
    save_needs(ctx, {requires_grad(residual), requires_grad(y), requires_grad(gate)});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_residual, d_y, d_gate] =
        DETDIT_OP(gate_residual_backward)(contiguous_grad(grads[0]), s[0], s[1], saved_plan(ctx), saved_needs<3>(ctx));
    return {d_residual, d_y, d_gate, Tensor()};
  }
};

// rmsnorm.forms and gate_residual.forms (ops.h): the arguments of the
// modulation forms and recipes saved beside the tensors.
struct RmsnormFormsFunction : torch::autograd::Function<RmsnormFormsFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& shift,
                               const OptTensor& scale, const OptPlan& plan, double eps, const std::string& numerics,
                               bool upcast) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = DETDIT_OP_FORMS(rmsnorm)(x, weight, shift, scale, plan, eps, numerics, upcast);
    ctx->save_for_backward({x, weight, shift.value_or(Tensor()), scale.value_or(Tensor()), rstd});
    ctx->saved_data["plan"] = plan_ivalue(plan);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["upcast"] = upcast;
    save_needs(ctx, {requires_grad(x), requires_grad(weight), requires_grad(shift), requires_grad(scale)});
    ctx->mark_non_differentiable({rstd});
    return {out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [dx, d_weight, d_shift, d_scale] = DETDIT_OP_FORMS(rmsnorm_backward)(
        contiguous_grad(grads[0]), s[0], s[1], saved_optional(s[2]), saved_optional(s[3]),
        plan_from_ivalue(ctx->saved_data["plan"]), s[4], ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["numerics"].toStringRef(), ctx->saved_data["upcast"].toBool(), saved_needs<4>(ctx));
    return {dx, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct GateResidualFormsFunction : torch::autograd::Function<GateResidualFormsFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const OptTensor& gate,
                        const OptPlan& plan, bool upcast, Optional<double> k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = DETDIT_OP_FORMS(gate_residual)(residual, y, gate, plan, upcast, k);
    ctx->save_for_backward({y, gate.value_or(Tensor())});
    ctx->saved_data["plan"] = plan_ivalue(plan);
    ctx->saved_data["upcast"] = upcast;
    ctx->saved_data["k"] = k.has_value() ? c10::IValue(*k) : c10::IValue();
    save_needs(ctx, {requires_grad(residual), requires_grad(y), requires_grad(gate)});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    const c10::IValue& k = ctx->saved_data["k"];
    auto [d_residual, d_y, d_gate] = DETDIT_OP_FORMS(gate_residual_backward)(
        contiguous_grad(grads[0]), s[0], saved_optional(s[1]), plan_from_ivalue(ctx->saved_data["plan"]),
        ctx->saved_data["upcast"].toBool(), k.isNone() ? Optional<double>() : Optional<double>(k.toDouble()),
        saved_needs<3>(ctx));
    return {d_residual, d_y, d_gate, Tensor(), Tensor(), Tensor()};
  }
};

// Its h and out may each receive a gradient or not; grads are not
// materialised, so the backward tells an absent gradient of h (none but the
// norm's) from a zero one, and an absent gradient of out (no norm backward)
// from a zero one, as autograd through gate_residual then rmsnorm does.
struct GateResidualRmsnormFunction : torch::autograd::Function<GateResidualRmsnormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const Tensor& gate,
                               const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                               const PlanPtr& plan, double eps, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [h, out, rstd] =
        DETDIT_OP(gate_residual_rmsnorm)(residual, y, gate, weight, shift, scale, plan, eps, numerics);
    ctx->save_for_backward({y, gate, weight, shift.value_or(Tensor()), scale.value_or(Tensor()), h, rstd});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(residual), requires_grad(y), requires_grad(gate), requires_grad(weight),
                     requires_grad(shift), requires_grad(scale)});
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    return {h, out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_residual, d_y, d_gate, d_weight, d_shift, d_scale] = DETDIT_OP(gate_residual_rmsnorm_backward)(
        optional_grad(grads[1]), optional_grad(grads[0]), s[0], s[1], s[2], saved_optional(s[3]), saved_optional(s[4]),
        saved_plan(ctx), s[5], s[6], ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(),
        saved_needs<6>(ctx));
    return {d_residual, d_y, d_gate, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor()};
  }
};

// gate_residual_rmsnorm.forms (ops.h): GateResidualRmsnormFunction with the
// plan optional, the gate optional, the recipe and k.
struct GateResidualRmsnormFormsFunction : torch::autograd::Function<GateResidualRmsnormFormsFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const OptTensor& gate,
                               const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                               const OptPlan& plan, double eps, const std::string& numerics, bool upcast,
                               Optional<double> k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [h, out, rstd] = DETDIT_OP_FORMS(gate_residual_rmsnorm)(residual, y, gate, weight, shift, scale, plan, eps,
                                                                 numerics, upcast, k);
    ctx->save_for_backward({y, gate.value_or(Tensor()), weight, shift.value_or(Tensor()), scale.value_or(Tensor()), h,
                            rstd});
    ctx->saved_data["plan"] = plan_ivalue(plan);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["upcast"] = upcast;
    ctx->saved_data["k"] = k.has_value() ? c10::IValue(*k) : c10::IValue();
    save_needs(ctx, {requires_grad(residual), requires_grad(y), requires_grad(gate), requires_grad(weight),
                     requires_grad(shift), requires_grad(scale)});
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    return {h, out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    const c10::IValue& k = ctx->saved_data["k"];
    auto [d_residual, d_y, d_gate, d_weight, d_shift, d_scale] = DETDIT_OP_FORMS(gate_residual_rmsnorm_backward)(
        optional_grad(grads[1]), optional_grad(grads[0]), s[0], saved_optional(s[1]), s[2], saved_optional(s[3]),
        saved_optional(s[4]), plan_from_ivalue(ctx->saved_data["plan"]), s[5], s[6],
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(),
        ctx->saved_data["upcast"].toBool(), k.isNone() ? Optional<double>() : Optional<double>(k.toDouble()),
        saved_needs<6>(ctx));
    return {d_residual, d_y, d_gate, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct FinalAdalnOutFunction : torch::autograd::Function<FinalAdalnOutFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& norm_weight, const Tensor& temb,
                               const Tensor& weight, const Tensor& bias, const PlanPtr& plan, double eps,
                               const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, table, act, rstd] = DETDIT_OP(final_adaln_out)(x, norm_weight, temb, weight, bias, plan, eps, numerics);
    ctx->save_for_backward({x, norm_weight, temb, weight, table, act, rstd});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(x), requires_grad(norm_weight), requires_grad(temb), requires_grad(weight),
                     requires_grad(bias)});
    ctx->mark_non_differentiable({table, act, rstd});
    return {out, table, act, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [dx, d_norm_weight, d_temb, d_weight, d_bias] = DETDIT_OP(final_adaln_out_backward)(
        contiguous_grad(grads[0]), s[0], s[1], s[2], s[3], s[4], s[5], s[6], saved_plan(ctx),
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(), saved_needs<5>(ctx));
    return {dx, d_norm_weight, d_temb, d_weight, d_bias, Tensor(), Tensor(), Tensor()};
  }
};

struct AdalnModulationFunction : torch::autograd::Function<AdalnModulationFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& temb, const Tensor& weight, const Tensor& bias,
                               const PlanPtr& plan, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, table, act] = DETDIT_OP(adaln_modulation)(temb, weight, bias, plan, numerics);
    ctx->save_for_backward({temb, weight, act});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(temb), requires_grad(weight), requires_grad(bias)});
    ctx->mark_non_differentiable({table, act});
    return {out, table, act};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_temb, d_weight, d_bias] =
        DETDIT_OP(adaln_modulation_backward)(contiguous_grad(grads[0]), s[0], s[1], s[2], saved_plan(ctx),
                                             ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx));
    return {d_temb, d_weight, d_bias, Tensor(), Tensor()};
  }
};

struct TpAdalnProjectionFunction : torch::autograd::Function<TpAdalnProjectionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& temb, const Tensor& weight, const Tensor& bias,
                               int64_t comm, const std::string& numerics, Optional<int64_t> out_features,
                               int64_t chunks) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [table, act] = DETDIT_OP(tp_adaln_projection)(temb, weight, bias, comm, numerics, out_features, chunks);
    ctx->save_for_backward({temb, weight, act});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["chunks"] = chunks;
    save_needs(ctx, {requires_grad(temb), requires_grad(weight), requires_grad(bias)});
    ctx->mark_non_differentiable({act});
    return {table, act};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_temb, d_weight, d_bias] = DETDIT_OP(tp_adaln_projection_backward)(
        contiguous_grad(grads[0]), s[0], s[1], s[2], ctx->saved_data["comm"].toInt(),
        ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx), ctx->saved_data["chunks"].toInt());
    return {d_temb, d_weight, d_bias, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct SpRmsnormFunction : torch::autograd::Function<SpRmsnormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& shift,
                               const OptTensor& scale, const SpPlanPtr& sp, int64_t comm, double eps,
                               const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = DETDIT_OP(sp_rmsnorm)(x, weight, shift, scale, sp, comm, eps, numerics);
    ctx->save_for_backward({x, weight, shift.value_or(Tensor()), scale.value_or(Tensor()), rstd});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->mark_non_differentiable({rstd});
    return {out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [dx, d_weight, d_shift, d_scale] = DETDIT_OP(sp_rmsnorm_backward)(
        contiguous_grad(grads[0]), s[0], s[1], saved_optional(s[2]), saved_optional(s[3]), saved_sp(ctx), s[4],
        ctx->saved_data["comm"].toInt(), ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef());
    return {dx, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct SpGateResidualFunction : torch::autograd::Function<SpGateResidualFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const Tensor& gate,
                        const SpPlanPtr& sp, int64_t comm) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = DETDIT_OP(sp_gate_residual)(residual, y, gate, sp, comm);
    ctx->save_for_backward({y, gate});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_residual, d_y, d_gate] = DETDIT_OP(sp_gate_residual_backward)(
        contiguous_grad(grads[0]), s[0], s[1], saved_sp(ctx), ctx->saved_data["comm"].toInt());
    return {d_residual, d_y, d_gate, Tensor(), Tensor()};
  }
};

// As GateResidualRmsnormFunction, on the local rows.
struct SpGateResidualRmsnormFunction : torch::autograd::Function<SpGateResidualRmsnormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const Tensor& gate,
                               const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                               const SpPlanPtr& sp, int64_t comm, double eps, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [h, out, rstd] =
        DETDIT_OP(sp_gate_residual_rmsnorm)(residual, y, gate, weight, shift, scale, sp, comm, eps, numerics);
    ctx->save_for_backward({y, gate, weight, shift.value_or(Tensor()), scale.value_or(Tensor()), h, rstd});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    return {h, out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_residual, d_y, d_gate, d_weight, d_shift, d_scale] = DETDIT_OP(sp_gate_residual_rmsnorm_backward)(
        optional_grad(grads[1]), optional_grad(grads[0]), s[0], s[1], s[2], saved_optional(s[3]), saved_optional(s[4]),
        saved_sp(ctx), s[5], s[6], ctx->saved_data["comm"].toInt(), ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["numerics"].toStringRef());
    return {d_residual, d_y, d_gate, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct LayernormFunction : torch::autograd::Function<LayernormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                               double eps, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mean, rstd] = DETDIT_OP(layernorm)(x, weight, bias, eps, numerics);
    ctx->save_for_backward({x, weight.value_or(Tensor()), bias.value_or(Tensor()), mean, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(x), requires_grad(weight), requires_grad(bias)});
    ctx->mark_non_differentiable({mean, rstd});
    return {out, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [dx, d_weight, d_bias] = DETDIT_OP(layernorm_backward)(
        contiguous_grad(grads[0]), s[0], saved_optional(s[1]), saved_optional(s[2]), s[3], s[4],
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx));
    return {dx, d_weight, d_bias, Tensor(), Tensor()};
  }
};

// layernorm.forms (ops.h): LayernormFunction with the modulation and the
// recipe, as RmsnormFormsFunction.
struct LayernormFormsFunction : torch::autograd::Function<LayernormFormsFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                               const OptTensor& shift, const OptTensor& scale, const OptPlan& plan, double eps,
                               const std::string& numerics, bool upcast) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mean, rstd] = DETDIT_OP_FORMS(layernorm)(x, weight, bias, shift, scale, plan, eps, numerics, upcast);
    ctx->save_for_backward({x, weight.value_or(Tensor()), bias.value_or(Tensor()), shift.value_or(Tensor()),
                            scale.value_or(Tensor()), mean, rstd});
    ctx->saved_data["plan"] = plan_ivalue(plan);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["upcast"] = upcast;
    save_needs(ctx, {requires_grad(x), requires_grad(weight), requires_grad(bias), requires_grad(shift),
                     requires_grad(scale)});
    ctx->mark_non_differentiable({mean, rstd});
    return {out, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [dx, d_weight, d_bias, d_shift, d_scale] = DETDIT_OP_FORMS(layernorm_backward)(
        contiguous_grad(grads[0]), s[0], saved_optional(s[1]), saved_optional(s[2]), saved_optional(s[3]),
        saved_optional(s[4]), plan_from_ivalue(ctx->saved_data["plan"]), s[5], s[6],
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(),
        ctx->saved_data["upcast"].toBool(), saved_needs<5>(ctx));
    return {dx, d_weight, d_bias, d_shift, d_scale, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// gate_residual_layernorm returns (out, h, mean, rstd); out and h may each
// receive a gradient or not, told apart from a zero one as in
// GateResidualRmsnormFunction (grads not materialised).
struct GateResidualLayernormFunction : torch::autograd::Function<GateResidualLayernormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const OptTensor& gate,
                               const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
                               const OptTensor& scale, const OptPlan& plan, double eps, const std::string& numerics,
                               bool upcast, Optional<double> k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, h, mean, rstd] = DETDIT_OP(gate_residual_layernorm)(residual, y, gate, weight, bias, shift, scale, plan,
                                                                   eps, numerics, upcast, k);
    ctx->save_for_backward({y, gate.value_or(Tensor()), weight.value_or(Tensor()), bias.value_or(Tensor()),
                            shift.value_or(Tensor()), scale.value_or(Tensor()), h, mean, rstd});
    ctx->saved_data["plan"] = plan_ivalue(plan);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["upcast"] = upcast;
    ctx->saved_data["k"] = k.has_value() ? c10::IValue(*k) : c10::IValue();
    save_needs(ctx, {requires_grad(residual), requires_grad(y), requires_grad(gate), requires_grad(weight),
                     requires_grad(bias), requires_grad(shift), requires_grad(scale)});
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    return {out, h, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    const c10::IValue& k = ctx->saved_data["k"];
    auto [d_residual, d_y, d_gate, d_weight, d_bias, d_shift, d_scale] = DETDIT_OP(gate_residual_layernorm_backward)(
        optional_grad(grads[0]), optional_grad(grads[1]), s[0], saved_optional(s[1]), saved_optional(s[2]),
        saved_optional(s[3]), saved_optional(s[4]), saved_optional(s[5]), plan_from_ivalue(ctx->saved_data["plan"]),
        s[6], s[7], s[8], ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(),
        ctx->saved_data["upcast"].toBool(), k.isNone() ? Optional<double>() : Optional<double>(k.toDouble()),
        saved_needs<7>(ctx));
    return {d_residual, d_y, d_gate, d_weight, d_bias, d_shift, d_scale,
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// sp_rmsnorm.forms: RmsnormFormsFunction on the local rows (the sp_ backward
// computes every gradient).
struct SpRmsnormFormsFunction : torch::autograd::Function<SpRmsnormFormsFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& shift,
                               const OptTensor& scale, const SpPlanPtr& sp, int64_t comm, double eps,
                               const std::string& numerics, bool upcast) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = DETDIT_OP_FORMS(sp_rmsnorm)(x, weight, shift, scale, sp, comm, eps, numerics, upcast);
    ctx->save_for_backward({x, weight, shift.value_or(Tensor()), scale.value_or(Tensor()), rstd});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["upcast"] = upcast;
    ctx->mark_non_differentiable({rstd});
    return {out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [dx, d_weight, d_shift, d_scale] = DETDIT_OP_FORMS(sp_rmsnorm_backward)(
        contiguous_grad(grads[0]), s[0], s[1], saved_optional(s[2]), saved_optional(s[3]), saved_sp(ctx), s[4],
        ctx->saved_data["comm"].toInt(), ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(),
        ctx->saved_data["upcast"].toBool());
    return {dx, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// sp_gate_residual.forms: GateResidualFormsFunction on the local rows.
struct SpGateResidualFormsFunction : torch::autograd::Function<SpGateResidualFormsFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const OptTensor& gate,
                        const SpPlanPtr& sp, int64_t comm, bool upcast, Optional<double> k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = DETDIT_OP_FORMS(sp_gate_residual)(residual, y, gate, sp, comm, upcast, k);
    ctx->save_for_backward({y, gate.value_or(Tensor())});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["upcast"] = upcast;
    ctx->saved_data["k"] = k.has_value() ? c10::IValue(*k) : c10::IValue();
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    const c10::IValue& k = ctx->saved_data["k"];
    auto [d_residual, d_y, d_gate] = DETDIT_OP_FORMS(sp_gate_residual_backward)(
        contiguous_grad(grads[0]), s[0], saved_optional(s[1]), saved_sp(ctx), ctx->saved_data["comm"].toInt(),
        ctx->saved_data["upcast"].toBool(), k.isNone() ? Optional<double>() : Optional<double>(k.toDouble()));
    return {d_residual, d_y, d_gate, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// sp_gate_residual_rmsnorm.forms: GateResidualRmsnormFormsFunction on the
// local rows (grads not materialised, as there).
struct SpGateResidualRmsnormFormsFunction : torch::autograd::Function<SpGateResidualRmsnormFormsFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const OptTensor& gate,
                               const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                               const SpPlanPtr& sp, int64_t comm, double eps, const std::string& numerics, bool upcast,
                               Optional<double> k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [h, out, rstd] = DETDIT_OP_FORMS(sp_gate_residual_rmsnorm)(residual, y, gate, weight, shift, scale, sp, comm,
                                                                    eps, numerics, upcast, k);
    ctx->save_for_backward({y, gate.value_or(Tensor()), weight, shift.value_or(Tensor()), scale.value_or(Tensor()), h,
                            rstd});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["upcast"] = upcast;
    ctx->saved_data["k"] = k.has_value() ? c10::IValue(*k) : c10::IValue();
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    return {h, out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    const c10::IValue& k = ctx->saved_data["k"];
    auto [d_residual, d_y, d_gate, d_weight, d_shift, d_scale] = DETDIT_OP_FORMS(sp_gate_residual_rmsnorm_backward)(
        optional_grad(grads[1]), optional_grad(grads[0]), s[0], saved_optional(s[1]), s[2], saved_optional(s[3]),
        saved_optional(s[4]), saved_sp(ctx), s[5], s[6], ctx->saved_data["comm"].toInt(),
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(),
        ctx->saved_data["upcast"].toBool(), k.isNone() ? Optional<double>() : Optional<double>(k.toDouble()));
    return {d_residual, d_y, d_gate, d_weight, d_shift, d_scale,
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// sp_layernorm: LayernormFormsFunction on the local rows (the sp_ backward
// computes every gradient).
struct SpLayernormFunction : torch::autograd::Function<SpLayernormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                               const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, int64_t comm,
                               double eps, const std::string& numerics, bool upcast) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mean, rstd] =
        DETDIT_OP(sp_layernorm)(x, weight, bias, shift, scale, sp, comm, eps, numerics, upcast);
    ctx->save_for_backward({x, weight.value_or(Tensor()), bias.value_or(Tensor()), shift.value_or(Tensor()),
                            scale.value_or(Tensor()), mean, rstd});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["upcast"] = upcast;
    ctx->mark_non_differentiable({mean, rstd});
    return {out, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [dx, d_weight, d_bias, d_shift, d_scale] = DETDIT_OP(sp_layernorm_backward)(
        contiguous_grad(grads[0]), s[0], saved_optional(s[1]), saved_optional(s[2]), saved_optional(s[3]),
        saved_optional(s[4]), saved_sp(ctx), s[5], s[6], ctx->saved_data["comm"].toInt(),
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(),
        ctx->saved_data["upcast"].toBool());
    return {dx, d_weight, d_bias, d_shift, d_scale, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// sp_gate_residual_layernorm: GateResidualLayernormFunction on the local rows.
struct SpGateResidualLayernormFunction : torch::autograd::Function<SpGateResidualLayernormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const OptTensor& gate,
                               const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
                               const OptTensor& scale, const SpPlanPtr& sp, int64_t comm, double eps,
                               const std::string& numerics, bool upcast, Optional<double> k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, h, mean, rstd] = DETDIT_OP(sp_gate_residual_layernorm)(residual, y, gate, weight, bias, shift, scale,
                                                                      sp, comm, eps, numerics, upcast, k);
    ctx->save_for_backward({y, gate.value_or(Tensor()), weight.value_or(Tensor()), bias.value_or(Tensor()),
                            shift.value_or(Tensor()), scale.value_or(Tensor()), h, mean, rstd});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["upcast"] = upcast;
    ctx->saved_data["k"] = k.has_value() ? c10::IValue(*k) : c10::IValue();
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    return {out, h, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    const c10::IValue& k = ctx->saved_data["k"];
    auto [d_residual, d_y, d_gate, d_weight, d_bias, d_shift, d_scale] = DETDIT_OP(sp_gate_residual_layernorm_backward)(
        optional_grad(grads[0]), optional_grad(grads[1]), s[0], saved_optional(s[1]), saved_optional(s[2]),
        saved_optional(s[3]), saved_optional(s[4]), saved_optional(s[5]), saved_sp(ctx), s[6], s[7], s[8],
        ctx->saved_data["comm"].toInt(), ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(),
        ctx->saved_data["upcast"].toBool(), k.isNone() ? Optional<double>() : Optional<double>(k.toDouble()));
    return {d_residual, d_y, d_gate, d_weight, d_bias, d_shift, d_scale,
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// ---------------------------------------------------------------------------
// The Autograd kernel of a forward op: Function::apply with the forward
// kernel's signature (the schema's), its variable_list unpacked into the
// kernel's tuple.

template <typename Function, typename Signature>
struct AutogradKernel;

template <typename Function, typename... Args>
struct AutogradKernel<Function, Tensor(Args...)> {
  static Tensor call(Args... args) { return Function::apply(args...); }
};

template <typename Function, typename... Outputs, typename... Args>
struct AutogradKernel<Function, std::tuple<Outputs...>(Args...)> {
  static std::tuple<Outputs...> call(Args... args) {
    return unpack(Function::apply(args...), std::index_sequence_for<Outputs...>());
  }

 private:
  template <size_t... I>
  static std::tuple<Outputs...> unpack(const variable_list& out, std::index_sequence<I...>) {
    return {out[I]...};
  }
};

template <typename Function, typename Signature>
auto autograd_kernel(Signature*) {
  return &AutogradKernel<Function, Signature>::call;
}

}  // namespace detdit_torch
