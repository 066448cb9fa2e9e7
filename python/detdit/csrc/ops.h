// The device kernels of every single-device detdit op: the CPU and CUDA
// kernels of `torch.ops.detdit.<op>` and `<op>_backward` (the same functions:
// detdit dispatches on the tensors' device).
//
// Contract: each kernel allocates its outputs with at::empty, builds the op's
// Params (the op's inputs struct from one <op>_inputs helper shared by the
// forward and the backward, then the other views) and calls the public C++
// API, which validates every argument; it does no arithmetic (besides the
// exact bf16 -> fp32 upcast of a linear grad). A forward returns its output
// and the tensors its backward needs; a backward returns one gradient per
// differentiable input, undefined where output_mask says it is not wanted.
// Output dtypes are docs/numerics.md section 8's "Python allocates" column.
//
// The ops that detdit.distributed also runs sharded share one <op>_with
// function that takes the detdit call to make (distributed.cpp passes the
// tp_/sp_ entry point).
#pragma once

#include <array>
#include <functional>
#include <string>
#include <tuple>

#include "plan.h"
#include "tensors.h"

namespace detdit_torch {

// The detdit call of an <op>_with: the op's entry point, or a lambda adding
// the communicator and SpPlan of the tp_/sp_ entry point.
template <typename Params>
using Call = std::function<Status(const Params&, detdit::Stream)>;

// timestep_sinusoid: (T,) -> (T, C) fp32 in diffusers' convention
// (flip_sin_to_cos, downscale_freq_shift, scale; t in [0, t_max]).
// check_range = false: the caller guarantees finite t in [0, t_max]; the op
// then never reads the timesteps on the host (no sync: CUDA-graph capturable).
// Backward: d_timesteps (T,) in the timesteps' dtype.
Tensor timestep_sinusoid(const Tensor& timesteps, int64_t num_channels, double max_period,
                         const std::string& numerics, bool check_range, bool flip_sin_to_cos,
                         double downscale_freq_shift, double scale, double t_max);
Tensor timestep_sinusoid_backward(const Tensor& grad_features, const Tensor& timesteps, double max_period,
                                  const std::string& numerics, bool check_range, bool flip_sin_to_cos,
                                  double downscale_freq_shift, double scale, double t_max);

// linear: (out (T, N) in x's dtype, pre (T, N) fp32 = x W^T + b before the
// activation when it is silu, else an empty tensor). Backward: (d_x, d_weight,
// d_bias); grad is upcast to fp32 (exact), through the SiLU VJP first when
// the activation is silu.
std::tuple<Tensor, Tensor> linear(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                  const std::string& activation, const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor> linear_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                                                   const Tensor& pre, const std::string& activation,
                                                   const std::string& numerics, std::array<bool, 3> output_mask);

// timestep_mlp: (temb (T, D), pre (T, Hm), hidden (T, Hm)), all in the
// features' dtype (fp32 or bf16). Backward: (d_features, d_w1, d_b1, d_w2,
// d_b2) in the features' dtype.
std::tuple<Tensor, Tensor, Tensor> timestep_mlp(const Tensor& features, const Tensor& w1, const Tensor& b1,
                                                const Tensor& w2, const Tensor& b2, const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> timestep_mlp_backward(
    const Tensor& grad_temb, const Tensor& features, const Tensor& w1, const Tensor& w2, const Tensor& pre,
    const Tensor& hidden, const std::string& numerics, std::array<bool, 5> output_mask);

// adaln_projection: (table (T, columns), act (T, D)) in weight's dtype, for
// an (N, D) weight: columns = N, or for tp the full table's width, every
// rank's shard. Backward: (d_temb in temb's dtype (the library's FP32 value,
// rounded once for a family's bf16 temb), d_weight, d_bias in weight's
// dtype). chunks: AdalnProjectionInputs::chunks (0: H3's projection).
std::tuple<Tensor, Tensor> adaln_projection_with(const Call<detdit::AdalnProjectionParams>& call, int64_t columns,
                                                 const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                 const std::string& numerics, int64_t chunks = 0);
std::tuple<Tensor, Tensor, Tensor> adaln_projection_backward_with(
    const Call<detdit::AdalnProjectionBackwardParams>& call, const Tensor& grad_table, const Tensor& temb,
    const Tensor& weight, const Tensor& act, const std::string& numerics, std::array<bool, 3> output_mask,
    int64_t chunks = 0);
std::tuple<Tensor, Tensor> adaln_projection(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                            const std::string& numerics, int64_t chunks);
std::tuple<Tensor, Tensor, Tensor> adaln_projection_backward(const Tensor& grad_table, const Tensor& temb,
                                                             const Tensor& weight, const Tensor& act,
                                                             const std::string& numerics,
                                                             std::array<bool, 3> output_mask, int64_t chunks);

// adaln_table_add: out (T, K, H) in the promoted dtype of table (K, H) and
// proj (T, K, H) or (T, 1, H). Backward: (d_table in table_dtype, d_proj in
// proj_dtype, (T, 1, H) when proj_broadcast), each where output_mask asks.
Tensor adaln_table_add(const Tensor& table, const Tensor& proj);
std::tuple<Tensor, Tensor> adaln_table_add_backward(const Tensor& grad, at::ScalarType table_dtype,
                                                    at::ScalarType proj_dtype, bool proj_broadcast,
                                                    std::array<bool, 2> output_mask);
// The chunk names of the AdaLN chunk order `name` (adaln.h), in table order.
std::vector<std::string> adaln_chunk_order(const std::string& name);

// adaln_row_gather: out (6, S, H) in rows' dtype. Backward: d_rows (R, 6H) in
// grad's dtype; grad (6, S, H) (batch summed) or (6, B*S, H) / (6, B, S, H)
// with B = plan.batch().
Tensor adaln_row_gather(const Tensor& rows, const PlanPtr& plan);
Tensor adaln_row_gather_backward(const Tensor& grad, const PlanPtr& plan);

// rmsnorm (and sp_rmsnorm through the _with forms): (out like x, rstd (M,)
// fp32). Backward: (dx like x, d_weight in weight's dtype, d_shift / d_scale
// in the table's dtype; none for an absent table).
std::tuple<Tensor, Tensor> rmsnorm_with(const Call<detdit::RmsnormParams>& call, const Tensor& x,
                                        const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                                        const IndexPlan& plan, double eps, const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_with(
    const Call<detdit::RmsnormBackwardParams>& call, const Tensor& grad, const Tensor& x, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& rstd, double eps,
    const std::string& numerics, std::array<bool, 4> output_mask);
std::tuple<Tensor, Tensor> rmsnorm(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                   const OptTensor& scale, const OptPlan& plan, double eps,
                                   const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward(const Tensor& grad, const Tensor& x,
                                                            const Tensor& weight, const OptTensor& shift,
                                                            const OptTensor& scale, const OptPlan& plan,
                                                            const Tensor& rstd, double eps,
                                                            const std::string& numerics,
                                                            std::array<bool, 4> output_mask);
// The `.plan` overloads: rmsnorm and rmsnorm_backward with a plan that is
// not optional. torch.compile passes a traced plan only to an argument whose
// type is the plan class itself (an optional one is not recognised), so the
// modulated norm is called through these (detdit.rmsnorm).
std::tuple<Tensor, Tensor> rmsnorm_plan(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                        const OptTensor& scale, const PlanPtr& plan, double eps,
                                        const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_plan(const Tensor& grad, const Tensor& x,
                                                                 const Tensor& weight, const OptTensor& shift,
                                                                 const OptTensor& scale, const PlanPtr& plan,
                                                                 const Tensor& rstd, double eps,
                                                                 const std::string& numerics,
                                                                 std::array<bool, 4> output_mask);

// gate_residual (and sp_gate_residual): out like residual. Backward:
// (d_residual, d_y like y, d_gate in gate's dtype).
Tensor gate_residual_with(const Call<detdit::GateResidualParams>& call, const Tensor& residual, const Tensor& y,
                          const Tensor& gate, const IndexPlan& plan);
std::tuple<Tensor, Tensor, Tensor> gate_residual_backward_with(const Call<detdit::GateResidualBackwardParams>& call,
                                                               const Tensor& grad, const Tensor& y,
                                                               const Tensor& gate, const IndexPlan& plan,
                                                               std::array<bool, 3> output_mask);
Tensor gate_residual(const Tensor& residual, const Tensor& y, const Tensor& gate, const PlanPtr& plan);
std::tuple<Tensor, Tensor, Tensor> gate_residual_backward(const Tensor& grad, const Tensor& y, const Tensor& gate,
                                                          const PlanPtr& plan, std::array<bool, 3> output_mask);

// The modulation forms (detdit/modulation.h): the `.forms` overloads of
// rmsnorm, gate_residual and their backwards take every form (the plan
// optional: absent for per sample, per frame, per token and none), fp32 or
// x's-dtype modulation, the recipe (upcast) and gate_residual's constant k
// (absent: no k step) and optional gate. out: fp32 when the modulation is
// fp32 and upcast is false, else x's dtype (docs/numerics.md 5.12). The
// modulation gradients have the modulation tensor's shape ((R, H) for the
// indexed form) and dtype, allocated once detdit's resolve_modulation has
// accepted the tensors (their dims are then x's B, F or S, and H).
std::tuple<Tensor, Tensor> rmsnorm_forms(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                         const OptTensor& scale, const OptPlan& plan, double eps,
                                         const std::string& numerics, bool upcast);
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_forms(const Tensor& grad, const Tensor& x,
                                                                  const Tensor& weight, const OptTensor& shift,
                                                                  const OptTensor& scale, const OptPlan& plan,
                                                                  const Tensor& rstd, double eps,
                                                                  const std::string& numerics, bool upcast,
                                                                  std::array<bool, 4> output_mask);
Tensor gate_residual_forms(const Tensor& residual, const Tensor& y, const OptTensor& gate, const OptPlan& plan,
                           bool upcast, Optional<double> k);
std::tuple<Tensor, Tensor, Tensor> gate_residual_backward_forms(const Tensor& grad, const Tensor& y,
                                                                const OptTensor& gate, const OptPlan& plan,
                                                                bool upcast, Optional<double> k,
                                                                std::array<bool, 3> output_mask);
// The _with forms (the plan resolved). local_rows: x (y, h) is one rank's rows
// of a sequence-parallel region (distributed.cpp), so a modulation gradient
// takes its tensor's own shape and the sp_ op resolves the form against the
// global (B, S, H); false: resolved against x here, as above.
std::tuple<Tensor, Tensor> rmsnorm_forms_with(const Call<detdit::RmsnormParams>& call, const Tensor& x,
                                              const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                                              const IndexPlan& plan, double eps, const std::string& numerics,
                                              bool upcast);
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_forms_with(
    const Call<detdit::RmsnormBackwardParams>& call, const Tensor& grad, const Tensor& x, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& rstd, double eps,
    const std::string& numerics, bool upcast, std::array<bool, 4> output_mask, bool local_rows);
Tensor gate_residual_forms_with(const Call<detdit::GateResidualParams>& call, const Tensor& residual, const Tensor& y,
                                const OptTensor& gate, const IndexPlan& plan, bool upcast, Optional<double> k);
std::tuple<Tensor, Tensor, Tensor> gate_residual_backward_forms_with(
    const Call<detdit::GateResidualBackwardParams>& call, const Tensor& grad, const Tensor& y, const OptTensor& gate,
    const IndexPlan& plan, bool upcast, Optional<double> k, std::array<bool, 3> output_mask, bool local_rows);

// gate_residual_rmsnorm (and sp_gate_residual_rmsnorm): h = gate_residual
// of (residual, y, gate), out = rmsnorm of h; (h, out like residual, rstd
// (M,) fp32). Backward from d_out and d_h, the gradients of out and of h from
// the rest of the network, either absent: (d_residual, d_y like h, d_gate in
// gate's dtype, d_weight in weight's dtype, d_shift / d_scale in the table's
// dtype), the dtypes autograd gets through gate_residual then rmsnorm. An
// absent d_out runs gate_call (the gate_residual backward) of d_h alone and
// gives no norm gradients, as autograd through the two ops runs no rmsnorm
// backward when no gradient reaches out; with neither, every gradient is
// undefined.
std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm_with(const Call<detdit::GateResidualRmsnormParams>& call,
                                                              const Tensor& residual, const Tensor& y,
                                                              const Tensor& gate, const Tensor& weight,
                                                              const OptTensor& shift, const OptTensor& scale,
                                                              const IndexPlan& plan, double eps,
                                                              const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward_with(
    const Call<detdit::GateResidualRmsnormBackwardParams>& call, const Call<detdit::GateResidualBackwardParams>& gate_call,
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const Tensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& h, const Tensor& rstd,
    double eps, const std::string& numerics, std::array<bool, 6> output_mask);
std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm(const Tensor& residual, const Tensor& y, const Tensor& gate,
                                                         const Tensor& weight, const OptTensor& shift,
                                                         const OptTensor& scale, const PlanPtr& plan, double eps,
                                                         const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const Tensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const PlanPtr& plan, const Tensor& h, const Tensor& rstd,
    double eps, const std::string& numerics, std::array<bool, 6> output_mask);

// gate_residual_rmsnorm.forms: gate_residual_rmsnorm in every modulation
// form and recipe (the gate optional, the plan optional, fp32 or residual's
// dtype, upcast, k; gate_residual_forms' and rmsnorm_forms' rules): (h, out,
// rstd) as the plan overload returns them, h in gate_residual's out dtype
// (fp32 for an fp32 gate with upcast false, else residual's), out in
// rmsnorm's for x = h. Backward as gate_residual_rmsnorm_backward, with
// d_residual and d_y in y's dtype and each modulation gradient in its
// tensor's shape ((R, H) indexed) and dtype.
std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm_forms(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const Tensor& weight, const OptTensor& shift,
    const OptTensor& scale, const OptPlan& plan, double eps, const std::string& numerics, bool upcast,
    Optional<double> k);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward_forms(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const OptPlan& plan, const Tensor& h, const Tensor& rstd,
    double eps, const std::string& numerics, bool upcast, Optional<double> k, std::array<bool, 6> output_mask);
// The _with forms (sp_gate_residual_rmsnorm.forms): gate_call is the
// gate_residual backward an absent d_out runs, with gate_plan (the plan, or
// none where that call takes none); local_rows as
// gate_residual_backward_forms_with.
std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm_forms_with(
    const Call<detdit::GateResidualRmsnormParams>& call, const Tensor& residual, const Tensor& y,
    const OptTensor& gate, const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
    const IndexPlan& plan, double eps, const std::string& numerics, bool upcast, Optional<double> k);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward_forms_with(
    const Call<detdit::GateResidualRmsnormBackwardParams>& call, const Call<detdit::GateResidualBackwardParams>& gate_call,
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const IndexPlan& gate_plan,
    const Tensor& h, const Tensor& rstd, double eps, const std::string& numerics, bool upcast, Optional<double> k,
    std::array<bool, 6> output_mask, bool local_rows);

// final_adaln_out: (out like x, table (T, 2H), act (T, D) in weight's dtype,
// rstd (M,) fp32). Backward: (dx like x, d_norm_weight in its dtype, d_temb
// fp32, d_weight, d_bias in weight's dtype).
std::tuple<Tensor, Tensor, Tensor, Tensor> final_adaln_out(const Tensor& x, const Tensor& norm_weight,
                                                           const Tensor& temb, const Tensor& weight,
                                                           const Tensor& bias, const PlanPtr& plan, double eps,
                                                           const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> final_adaln_out_backward(
    const Tensor& grad, const Tensor& x, const Tensor& norm_weight, const Tensor& temb, const Tensor& weight,
    const Tensor& table, const Tensor& act, const Tensor& rstd, const PlanPtr& plan, double eps,
    const std::string& numerics, std::array<bool, 5> output_mask);

// adaln_modulation: (out (6, S, H), table (T, 18H), act (T, D)), weight's
// dtype. Backward: (d_temb fp32, d_weight, d_bias in weight's dtype); grad as
// in adaln_row_gather_backward.
std::tuple<Tensor, Tensor, Tensor> adaln_modulation(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                    const PlanPtr& plan, const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor> adaln_modulation_backward(const Tensor& grad, const Tensor& temb,
                                                             const Tensor& weight, const Tensor& act,
                                                             const PlanPtr& plan, const std::string& numerics,
                                                             std::array<bool, 3> output_mask);

// layernorm: (out like x, mean (M,) fp32, rstd (M,) fp32); weight and bias
// optional (bias needs weight). Backward: (dx like x, d_weight, d_bias in the
// parameters' dtype; each only where the mask asks and the parameter exists).
std::tuple<Tensor, Tensor, Tensor> layernorm(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                             double eps, const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor> layernorm_backward(const Tensor& grad, const Tensor& x, const OptTensor& weight,
                                                      const OptTensor& bias, const Tensor& mean, const Tensor& rstd,
                                                      double eps, const std::string& numerics,
                                                      std::array<bool, 3> output_mask);

// layernorm.forms: layernorm modulated by shift and scale in every form
// (rmsnorm_forms' rules: the plan optional, fp32 or x's-dtype modulation, the
// recipe upcast): (out, mean, rstd); out fp32 when the modulation is fp32 and
// upcast is false, else x's dtype. Backward: (dx like x, d_weight, d_bias in
// the parameters' dtype, d_shift / d_scale in the modulation tensors' shape
// ((R, H) indexed) and dtype), each only where the mask asks and the tensor
// exists.
std::tuple<Tensor, Tensor, Tensor> layernorm_forms(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                                   const OptTensor& shift, const OptTensor& scale,
                                                   const OptPlan& plan, double eps, const std::string& numerics,
                                                   bool upcast);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_backward_forms(
    const Tensor& grad, const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const OptPlan& plan, const Tensor& mean, const Tensor& rstd, double eps,
    const std::string& numerics, bool upcast, std::array<bool, 5> output_mask);
// The _with forms (sp_layernorm; local_rows as gate_residual_backward_forms_with).
std::tuple<Tensor, Tensor, Tensor> layernorm_forms_with(const Call<detdit::LayernormParams>& call, const Tensor& x,
                                                        const OptTensor& weight, const OptTensor& bias,
                                                        const OptTensor& shift, const OptTensor& scale,
                                                        const IndexPlan& plan, double eps,
                                                        const std::string& numerics, bool upcast);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_backward_forms_with(
    const Call<detdit::LayernormBackwardParams>& call, const Tensor& grad, const Tensor& x, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& mean,
    const Tensor& rstd, double eps, const std::string& numerics, bool upcast, std::array<bool, 5> output_mask,
    bool local_rows);

// gate_residual_layernorm: h = gate_residual.forms of (residual, y, gate, plan,
// upcast, k), out = layernorm.forms of h; (out, h, mean, rstd): h in
// gate_residual's out dtype (fp32 for an fp32 gate with upcast false, else
// residual's), out in layernorm's for x = h, mean and rstd (M,) fp32. Every
// form of gate_residual_forms / layernorm_forms, all present modulation
// tensors in one form. Backward from d_out and d_h (the gradient of h from the
// rest of the network), either absent, as gate_residual_rmsnorm_backward:
// (d_residual, d_y like y, d_gate, d_weight, d_bias, d_shift, d_scale in
// their tensors' dtype); no d_out runs gate_residual_backward_forms of d_h
// alone (no norm gradients); neither: every gradient undefined.
std::tuple<Tensor, Tensor, Tensor, Tensor> gate_residual_layernorm(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& shift, const OptTensor& scale, const OptPlan& plan, double eps, const std::string& numerics,
    bool upcast, Optional<double> k);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_layernorm_backward(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& shift, const OptTensor& scale, const OptPlan& plan, const Tensor& h,
    const Tensor& mean, const Tensor& rstd, double eps, const std::string& numerics, bool upcast,
    Optional<double> k, std::array<bool, 7> output_mask);
// The _with forms (sp_gate_residual_layernorm): gate_call is the
// gate_residual backward an absent d_out runs; local_rows as
// gate_residual_backward_forms_with.
std::tuple<Tensor, Tensor, Tensor, Tensor> gate_residual_layernorm_with(
    const Call<detdit::GateResidualLayernormParams>& call, const Tensor& residual, const Tensor& y,
    const OptTensor& gate, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const IndexPlan& plan, double eps, const std::string& numerics, bool upcast,
    Optional<double> k);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_layernorm_backward_with(
    const Call<detdit::GateResidualLayernormBackwardParams>& call,
    const Call<detdit::GateResidualBackwardParams>& gate_call, const OptTensor& d_out, const OptTensor& d_h,
    const Tensor& y, const OptTensor& gate, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const IndexPlan& plan, const Tensor& h, const Tensor& mean, const Tensor& rstd,
    double eps, const std::string& numerics, bool upcast, Optional<double> k, std::array<bool, 7> output_mask,
    bool local_rows);

}  // namespace detdit_torch
