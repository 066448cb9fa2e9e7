// The device kernels of the single-device ops (contract in ops.h), one section
// per op: its <op>_inputs helper (the inputs struct that the forward and the
// backward Params share as `in`), then the forward and backward kernels.
//
// Each kernel first checks the layout of the inputs its outputs are sized
// from (require_contiguous, tensors.h), so that no output is allocated from a
// shape detdit would refuse; a table gradient is sized from the plan, which
// pins its rows. Then it allocates its outputs and fills the Params with the
// inputs' views before the outputs', so that a bad input is reported before an
// output derived from it. The backward passes an empty tensor for an input
// that only feeds the forward (a bias, the residual): an absent view.
#include "ops.h"

#include <algorithm>
#include <limits>
#include <string>

namespace detdit_torch {

// ---------------------------------------------------------------------------
// timestep_sinusoid

namespace {
detdit::TimestepSinusoidInputs timestep_sinusoid_inputs(const Tensor& timesteps, double max_period,
                                                        const std::string& numerics, bool check_range,
                                                        bool flip_sin_to_cos, double downscale_freq_shift,
                                                        double scale, double t_max) {
  detdit::TimestepSinusoidInputs in;
  in.timesteps = view(timesteps, "timesteps");
  in.max_period = static_cast<float>(max_period);
  in.numerics = parse_numerics(numerics);
  in.check_range = check_range;
  in.flip_sin_to_cos = flip_sin_to_cos;
  in.downscale_freq_shift = static_cast<float>(downscale_freq_shift);
  in.scale = static_cast<float>(scale);
  in.t_max = static_cast<float>(t_max);
  return in;
}
}  // namespace

Tensor timestep_sinusoid(const Tensor& timesteps, int64_t num_channels, double max_period,
                         const std::string& numerics, bool check_range, bool flip_sin_to_cos,
                         double downscale_freq_shift, double scale, double t_max) {
  if (num_channels < 1)
    C10_THROW_ERROR(ValueError, "num_channels must be positive, got " + std::to_string(num_channels));
  require_contiguous(timesteps, "timesteps");
  // the (T, num_channels) float32 features' byte count must be an int64, or torch's allocator
  // reports the overflow as a RuntimeError
  const int64_t count = std::max<int64_t>(dim_or_zero(timesteps, 0), 1);
  if (num_channels > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(sizeof(float)) / count)
    C10_THROW_ERROR(ValueError, "num_channels = " + std::to_string(num_channels) + " makes the (" +
                                    std::to_string(count) + ", num_channels) float32 features larger than 2^63 bytes");
  DeviceScope scope(timesteps);
  Tensor features = empty_like_shape(timesteps, {dim_or_zero(timesteps, 0), num_channels}, at::kFloat);
  detdit::TimestepSinusoidParams p;
  p.in = timestep_sinusoid_inputs(timesteps, max_period, numerics, check_range, flip_sin_to_cos, downscale_freq_shift,
                                  scale, t_max);
  p.features = view(features, "features");
  check_ok(detdit::timestep_sinusoid_forward(p, scope.stream()));
  return features;
}

Tensor timestep_sinusoid_backward(const Tensor& grad_features, const Tensor& timesteps, double max_period,
                                  const std::string& numerics, bool check_range, bool flip_sin_to_cos,
                                  double downscale_freq_shift, double scale, double t_max) {
  require_contiguous(timesteps, "timesteps");
  DeviceScope scope(timesteps);
  Tensor d_timesteps = empty_like_shape(timesteps, {dim_or_zero(timesteps, 0)}, timesteps.scalar_type());
  detdit::TimestepSinusoidBackwardParams p;
  p.in = timestep_sinusoid_inputs(timesteps, max_period, numerics, check_range, flip_sin_to_cos, downscale_freq_shift,
                                  scale, t_max);
  p.grad_features = view(grad_features, "grad_features");
  p.d_timesteps = view(d_timesteps, "d_timesteps");
  check_ok(detdit::timestep_sinusoid_backward(p, scope.stream()));
  return d_timesteps;
}

// ---------------------------------------------------------------------------
// linear (no shared inputs struct: the backward is two library calls, d_x and
// d_weight/d_bias, each with its own Params)

std::tuple<Tensor, Tensor> linear(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                  const std::string& activation, const std::string& numerics) {
  DeviceScope scope(x);
  const detdit::Activation act = parse_activation(activation);
  require_contiguous(x, "x");
  require_contiguous(weight, "weight");
  if (x.dim() == 2) require_dims(weight, "weight", {-1, x.size(1)}, "(N, K)");
  const int64_t rows = dim_or_zero(x, 0), outputs = dim_or_zero(weight, 0);
  Tensor out = empty_like_shape(x, {rows, outputs}, x.scalar_type());
  Tensor pre = act == detdit::Activation::kSilu ? empty_like_shape(x, {rows, outputs}, at::kFloat)
                                                : empty_like_shape(x, {0}, at::kFloat);
  detdit::LinearParams p;
  p.x = view(x, "x");
  p.weight = view(weight, "weight");
  p.bias = view(bias, "bias");
  p.out = view(out, "out");
  if (act == detdit::Activation::kSilu) p.pre_activation = view(pre, "pre_activation");
  p.activation = act;
  p.numerics = parse_numerics(numerics);
  check_ok(detdit::linear_forward(p, scope.stream()));
  return {out, pre};
}

std::tuple<Tensor, Tensor, Tensor> linear_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                                                   const Tensor& pre, const std::string& activation,
                                                   const std::string& numerics, std::array<bool, 3> output_mask) {
  DeviceScope scope(x);
  const detdit::Activation act = parse_activation(activation);
  const Numerics profile = parse_numerics(numerics);
  require_contiguous(grad, "grad");
  require_contiguous(x, "x");
  require_contiguous(weight, "weight");
  Tensor g = grad.defined() ? grad.to(at::kFloat) : grad;
  if (act == detdit::Activation::kSilu) {
    Tensor d_pre = empty_like_shape(x, matrix_shape(g), at::kFloat);
    detdit::SiluBackwardParams s;
    s.grad = view(g, "grad");
    s.pre = view(pre, "pre");
    s.d_pre = view(d_pre, "d_pre");
    s.numerics = profile;
    check_ok(detdit::silu_backward(s, scope.stream()));
    g = d_pre;
  }
  Tensor d_x = maybe_empty(output_mask[0], x, matrix_shape(x), x.scalar_type());
  Tensor d_weight = maybe_empty(output_mask[1], x, matrix_shape(weight), weight.scalar_type());
  Tensor d_bias = maybe_empty(output_mask[2], x, {dim_or_zero(weight, 0)}, weight.scalar_type());
  if (output_mask[0]) {
    detdit::LinearBackwardInputParams p;
    p.grad = view(g, "grad");
    p.weight = view(weight, "weight");
    p.d_x = view(d_x, "d_x");
    check_ok(detdit::linear_backward_input(p, scope.stream()));
  }
  if (output_mask[1] || output_mask[2]) {
    detdit::LinearBackwardWeightParams p;
    p.grad = view(g, "grad");
    p.x = view(x, "x");
    p.d_weight = view(d_weight, "d_weight");
    p.d_bias = view(d_bias, "d_bias");
    check_ok(detdit::linear_backward_weight(p, scope.stream()));
  }
  return {d_x, d_weight, d_bias};
}

// ---------------------------------------------------------------------------
// timestep_mlp (also the pooled-text embedder: detdit.text_projection calls it)

namespace {
// The MLP's dtype: the input's (fp32 or bf16; any other the library refuses,
// after these allocations).
at::ScalarType mlp_dtype(const Tensor& x) { return x.is_floating_point() ? x.scalar_type() : at::kFloat; }

struct MlpForwardTensors {
  Tensor out, pre, hidden;
};

MlpForwardTensors mlp_forward_tensors(const Tensor& x, const char* x_name, const Tensor& w1, const Tensor& w2) {
  require_contiguous(x, x_name);
  require_contiguous(w1, "w1");
  require_contiguous(w2, "w2");
  if (x.dim() == 2) require_dims(w1, "w1", {-1, x.size(1)}, "(H, K)");
  if (w1.dim() == 2) require_dims(w2, "w2", {-1, w1.size(0)}, "(D, H)");
  const int64_t rows = dim_or_zero(x, 0), hidden_dim = dim_or_zero(w1, 0);
  const at::ScalarType dtype = mlp_dtype(x);
  return {empty_like_shape(x, {rows, dim_or_zero(w2, 0)}, dtype), empty_like_shape(x, {rows, hidden_dim}, dtype),
          empty_like_shape(x, {rows, hidden_dim}, dtype)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mlp_backward_tensors(const Tensor& x, const char* x_name,
                                                                        const Tensor& w1, const Tensor& w2,
                                                                        std::array<bool, 5> output_mask) {
  require_contiguous(x, x_name);
  require_contiguous(w1, "w1");
  require_contiguous(w2, "w2");
  const at::ScalarType dtype = mlp_dtype(x);
  return {maybe_empty(output_mask[0], x, matrix_shape(x), dtype), maybe_empty(output_mask[1], x, matrix_shape(w1), dtype),
          maybe_empty(output_mask[2], x, {dim_or_zero(w1, 0)}, dtype),
          maybe_empty(output_mask[3], x, matrix_shape(w2), dtype),
          maybe_empty(output_mask[4], x, {dim_or_zero(w2, 0)}, dtype)};
}

detdit::TimestepMlpInputs timestep_mlp_inputs(const Tensor& features, const Tensor& w1, const Tensor& b1,
                                              const Tensor& w2, const Tensor& b2, const std::string& numerics) {
  detdit::TimestepMlpInputs in;
  in.features = view(features, "features");
  in.w1 = view(w1, "w1");
  in.b1 = view(b1, "b1");
  in.w2 = view(w2, "w2");
  in.b2 = view(b2, "b2");
  in.numerics = parse_numerics(numerics);
  return in;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> timestep_mlp(const Tensor& features, const Tensor& w1, const Tensor& b1,
                                                const Tensor& w2, const Tensor& b2, const std::string& numerics) {
  DeviceScope scope(features);
  MlpForwardTensors t = mlp_forward_tensors(features, "features", w1, w2);
  detdit::TimestepMlpParams p;
  p.in = timestep_mlp_inputs(features, w1, b1, w2, b2, numerics);
  p.temb = view(t.out, "temb");
  p.pre = view(t.pre, "pre");
  p.hidden = view(t.hidden, "hidden");
  check_ok(detdit::timestep_mlp_forward(p, scope.stream()));
  return {t.out, t.pre, t.hidden};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> timestep_mlp_backward(
    const Tensor& grad_temb, const Tensor& features, const Tensor& w1, const Tensor& w2, const Tensor& pre,
    const Tensor& hidden, const std::string& numerics, std::array<bool, 5> output_mask) {
  DeviceScope scope(features);
  auto [d_features, d_w1, d_b1, d_w2, d_b2] = mlp_backward_tensors(features, "features", w1, w2, output_mask);
  detdit::TimestepMlpBackwardParams p;
  p.in = timestep_mlp_inputs(features, w1, Tensor(), w2, Tensor(), numerics);
  p.pre = view(pre, "pre");
  p.hidden = view(hidden, "hidden");
  p.grad_temb = view(grad_temb, "grad_temb");
  p.d_features = view(d_features, "d_features");
  p.d_w1 = view(d_w1, "d_w1");
  p.d_b1 = view(d_b1, "d_b1");
  p.d_w2 = view(d_w2, "d_w2");
  p.d_b2 = view(d_b2, "d_b2");
  check_ok(detdit::timestep_mlp_backward(p, scope.stream()));
  return {d_features, d_w1, d_b1, d_w2, d_b2};
}

// ---------------------------------------------------------------------------
// adaln_projection (and tp_adaln_projection through the _with forms)

namespace {
detdit::AdalnProjectionInputs adaln_projection_inputs(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                      const std::string& numerics, int64_t chunks) {
  detdit::AdalnProjectionInputs in;
  in.temb = view(temb, "temb");
  in.weight = view(weight, "weight");
  in.bias = view(bias, "bias");
  in.numerics = parse_numerics(numerics);
  // a count past int is no family's; the library refuses the clamped value
  in.chunks = static_cast<int>(std::clamp<int64_t>(chunks, -1, 1 << 20));
  return in;
}

// temb (T, D) and weight (N, D) size the (T, N) table (and act (T, D)): their
// layout and shared D before anything is allocated (also for final_adaln_out
// and adaln_modulation, whose tables are such a projection).
void require_projection_operands(const Tensor& temb, const Tensor& weight) {
  require_contiguous(temb, "temb");
  require_contiguous(weight, "weight");
  if (temb.defined() && temb.dim() == 2) require_dims(weight, "weight", {-1, temb.size(1)}, "(N, D) with temb's D");
}
}  // namespace

std::tuple<Tensor, Tensor> adaln_projection_with(const Call<detdit::AdalnProjectionParams>& call, int64_t columns,
                                                 const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                 const std::string& numerics, int64_t chunks) {
  require_projection_operands(temb, weight);
  DeviceScope scope(temb);
  Tensor table = empty_like_shape(temb, {dim_or_zero(temb, 0), columns}, weight.scalar_type());
  Tensor act = empty_like_shape(temb, matrix_shape(temb), weight.scalar_type());
  detdit::AdalnProjectionParams p;
  p.in = adaln_projection_inputs(temb, weight, bias, numerics, chunks);
  p.table = view(table, "table");
  p.act = view(act, "act");
  check_ok(call(p, scope.stream()));
  return {table, act};
}

std::tuple<Tensor, Tensor, Tensor> adaln_projection_backward_with(
    const Call<detdit::AdalnProjectionBackwardParams>& call, const Tensor& grad_table, const Tensor& temb,
    const Tensor& weight, const Tensor& act, const std::string& numerics, std::array<bool, 3> output_mask,
    int64_t chunks) {
  require_contiguous(temb, "temb");
  require_contiguous(weight, "weight");
  DeviceScope scope(temb);
  Tensor d_temb = maybe_empty(output_mask[0], temb, matrix_shape(temb), at::kFloat);
  Tensor d_weight = maybe_empty(output_mask[1], temb, matrix_shape(weight), weight.scalar_type());
  Tensor d_bias = maybe_empty(output_mask[2], temb, {dim_or_zero(weight, 0)}, weight.scalar_type());
  detdit::AdalnProjectionBackwardParams p;
  p.in = adaln_projection_inputs(temb, weight, Tensor(), numerics, chunks);
  p.act = view(act, "act");
  p.grad_table = view(grad_table, "grad_table");
  p.d_temb = view(d_temb, "d_temb");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  check_ok(call(p, scope.stream()));
  // A family's bf16 temb: its gradient in its dtype, the FP32 value rounded once.
  if (d_temb.defined() && temb.scalar_type() != at::kFloat) d_temb = d_temb.to(temb.scalar_type());
  return {d_temb, d_weight, d_bias};
}

std::tuple<Tensor, Tensor> adaln_projection(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                            const std::string& numerics, int64_t chunks) {
  return adaln_projection_with(detdit::adaln_projection_forward, dim_or_zero(weight, 0), temb, weight, bias, numerics,
                               chunks);
}

std::tuple<Tensor, Tensor, Tensor> adaln_projection_backward(const Tensor& grad_table, const Tensor& temb,
                                                             const Tensor& weight, const Tensor& act,
                                                             const std::string& numerics,
                                                             std::array<bool, 3> output_mask, int64_t chunks) {
  return adaln_projection_backward_with(detdit::adaln_projection_backward, grad_table, temb, weight, act, numerics,
                                        output_mask, chunks);
}

// ---------------------------------------------------------------------------
// adaln_table_add and the chunk orders

Tensor adaln_table_add(const Tensor& table, const Tensor& proj) {
  DeviceScope scope(proj);
  require_contiguous(table, "table");
  require_contiguous(proj, "proj");
  // out's shape comes from the operands: their layout before anything is allocated
  require_dims(table, "table", {-1, -1}, "(K, H)");
  require_dims(proj, "proj", {-1, -1, dim_or_zero(table, 1)}, "(T, K, H) or (T, 1, H) with table's H");
  const at::ScalarType out_dtype =
      table.scalar_type() == proj.scalar_type() ? table.scalar_type() : at::kFloat;
  Tensor out = empty_like_shape(proj, {proj.size(0), table.size(0), table.size(1)}, out_dtype);
  detdit::AdalnTableAddParams p;
  p.table = view(table, "table");
  p.proj = view(proj, "proj");
  p.out = view(out, "out");
  check_ok(detdit::adaln_table_add_forward(p, scope.stream()));
  return out;
}

std::tuple<Tensor, Tensor> adaln_table_add_backward(const Tensor& grad, at::ScalarType table_dtype,
                                                    at::ScalarType proj_dtype, bool proj_broadcast,
                                                    std::array<bool, 2> output_mask) {
  DeviceScope scope(grad);
  require_contiguous(grad, "grad");
  require_dims(grad, "grad", {-1, -1, -1}, "(T, K, H)");
  Tensor d_table = maybe_empty(output_mask[0], grad, {grad.size(1), grad.size(2)}, table_dtype);
  Tensor d_proj = maybe_empty(output_mask[1], grad, {grad.size(0), proj_broadcast ? 1 : grad.size(1), grad.size(2)},
                              proj_dtype);
  detdit::AdalnTableAddBackwardParams p;
  p.grad = view(grad, "grad");
  p.d_table = view(d_table, "d_table");
  p.d_proj = view(d_proj, "d_proj");
  check_ok(detdit::adaln_table_add_backward(p, scope.stream()));
  return {d_table, d_proj};
}

std::vector<std::string> adaln_chunk_order(const std::string& name) {
  const detdit::AdalnChunkOrder* order = nullptr;
  check_ok(detdit::adaln_chunk_order(name, &order));
  return std::vector<std::string>(order->chunks, order->chunks + order->count);
}

// ---------------------------------------------------------------------------
// adaln_row_gather (no shared inputs struct: the forward reads the rows, the
// backward only the grad)

namespace {
// The hidden size H of a (R, 6H) rows view or an 18H-column projection: a
// width that does not split evenly is reported here, because the output shape
// is derived from it.
int64_t hidden_of(int64_t width, int64_t parts, const char* name, const char* layout) {
  if (width % parts != 0)
    C10_THROW_ERROR(ValueError, std::string(name) + " must be " + layout + ": its width " + std::to_string(width) +
                                    " is not a multiple of " + std::to_string(parts));
  return width / parts;
}

// The plan of a gather's backward (adaln_row_gather, adaln_modulation): a
// (6, S, H) grad is already summed over the batch, so it takes the index with
// batch 1; a (6, B*S, H) or (6, B, S, H) grad takes the plan as it is.
const IndexPlan& gather_backward_plan(PlanHolder& holder, const Tensor& grad, detdit::Stream stream) {
  const bool batch_summed = grad.defined() && grad.dim() == 3 && grad.size(1) == holder.plan.seq_len();
  return batch_summed ? holder.single_batch(stream) : holder.plan;
}
}  // namespace

Tensor adaln_row_gather(const Tensor& rows, const PlanPtr& plan) {
  DeviceScope scope(rows);
  const IndexPlan& index = required_plan(plan, "adaln_row_gather")->plan;
  require_unit_column_stride(rows, "rows");
  require_dims(rows, "rows", {index.num_rows(), -1}, "(R, 6H) with R = plan.num_rows()");
  const int64_t hidden = hidden_of(dim_or_zero(rows, 1), detdit::kAdalnChunks, "rows", "(R, 6H)");
  Tensor out = empty_like_shape(rows, {detdit::kAdalnChunks, index.seq_len(), hidden}, rows.scalar_type());
  detdit::AdalnRowGatherParams p;
  p.rows = view(rows, "rows");
  p.plan = index;
  p.out = view(out, "out");
  check_ok(detdit::adaln_row_gather_forward(p, scope.stream()));
  return out;
}

Tensor adaln_row_gather_backward(const Tensor& grad, const PlanPtr& plan) {
  DeviceScope scope(grad);
  PlanPtr holder = required_plan(plan, "adaln_row_gather_backward");
  require_contiguous(grad, "grad");
  Tensor d_rows = empty_like_shape(
      grad, {holder->plan.num_rows(), detdit::kAdalnChunks * dim_or_zero(grad, -1)}, grad.scalar_type());
  detdit::AdalnRowGatherBackwardParams p;
  p.grad = view(grad, "grad");
  p.plan = gather_backward_plan(*holder, grad, scope.stream());
  p.d_rows = view(d_rows, "d_rows");
  check_ok(detdit::adaln_row_gather_backward(p, scope.stream()));
  return d_rows;
}

// ---------------------------------------------------------------------------
// rmsnorm (and sp_rmsnorm through the _with forms)

namespace {
detdit::RmsnormInputs rmsnorm_inputs(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                     const OptTensor& scale, const IndexPlan& plan, double eps,
                                     const std::string& numerics) {
  detdit::RmsnormInputs in;
  in.x = view(x, "x");
  in.weight = view(weight, "weight");
  in.shift = view(shift, "shift");
  in.scale = view(scale, "scale");
  in.plan = plan;
  in.eps = static_cast<float>(eps);
  in.numerics = parse_numerics(numerics);
  return in;
}

// A table gradient (d_shift, d_scale, d_gate) in the table's dtype, when
// wanted and the table is given: (R, H) with R the plan's rows and H the
// rows' of `like`, the shape detdit requires of the table (never the table's
// own dims, which a broadcast view may make any size).
Tensor table_grad(bool wanted, const OptTensor& table, const char* name, const IndexPlan& plan, const Tensor& like) {
  if (!wanted || !table.has_value() || !table->defined()) return Tensor();
  require_dims(*table, name, {plan.num_rows(), dim_or_zero(like, -1)}, "(R, H)");
  return empty_like_shape(like, {plan.num_rows(), dim_or_zero(like, -1)}, table->scalar_type());
}
}  // namespace

std::tuple<Tensor, Tensor> rmsnorm_with(const Call<detdit::RmsnormParams>& call, const Tensor& x,
                                        const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                                        const IndexPlan& plan, double eps, const std::string& numerics) {
  require_contiguous(x, "x");
  DeviceScope scope(x);
  Tensor out = output_like(x);
  Tensor rstd = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  detdit::RmsnormParams p;
  p.in = rmsnorm_inputs(x, weight, shift, scale, plan, eps, numerics);
  p.out = view(out, "out");
  p.rstd = view(rstd, "rstd");
  check_ok(call(p, scope.stream()));
  return {out, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_with(
    const Call<detdit::RmsnormBackwardParams>& call, const Tensor& grad, const Tensor& x, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& rstd, double eps,
    const std::string& numerics, std::array<bool, 4> output_mask) {
  require_contiguous(x, "x");
  require_contiguous(weight, "weight");
  DeviceScope scope(x);
  Tensor dx = output_like(x, output_mask[0]);
  Tensor d_weight = maybe_empty(output_mask[1], x, {dim_or_zero(weight, 0)}, weight.scalar_type());
  Tensor d_shift = table_grad(output_mask[2], shift, "shift", plan, x);
  Tensor d_scale = table_grad(output_mask[3], scale, "scale", plan, x);
  detdit::RmsnormBackwardParams p;
  p.in = rmsnorm_inputs(x, weight, shift, scale, plan, eps, numerics);
  p.rstd = view(rstd, "rstd");
  p.grad = view(grad, "grad");
  p.dx = view(dx, "dx");
  p.d_weight = view(d_weight, "d_weight");
  p.d_shift = view(d_shift, "d_shift");
  p.d_scale = view(d_scale, "d_scale");
  check_ok(call(p, scope.stream()));
  return {dx, d_weight, d_shift, d_scale};
}

std::tuple<Tensor, Tensor> rmsnorm(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                   const OptTensor& scale, const OptPlan& plan, double eps,
                                   const std::string& numerics) {
  return rmsnorm_with(detdit::rmsnorm_forward, x, weight, shift, scale, plan_of(plan), eps, numerics);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward(const Tensor& grad, const Tensor& x,
                                                            const Tensor& weight, const OptTensor& shift,
                                                            const OptTensor& scale, const OptPlan& plan,
                                                            const Tensor& rstd, double eps,
                                                            const std::string& numerics,
                                                            std::array<bool, 4> output_mask) {
  return rmsnorm_backward_with(detdit::rmsnorm_backward, grad, x, weight, shift, scale, plan_of(plan), rstd, eps,
                               numerics, output_mask);
}

std::tuple<Tensor, Tensor> rmsnorm_plan(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                        const OptTensor& scale, const PlanPtr& plan, double eps,
                                        const std::string& numerics) {
  return rmsnorm(x, weight, shift, scale, OptPlan(plan), eps, numerics);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_plan(const Tensor& grad, const Tensor& x,
                                                                 const Tensor& weight, const OptTensor& shift,
                                                                 const OptTensor& scale, const PlanPtr& plan,
                                                                 const Tensor& rstd, double eps,
                                                                 const std::string& numerics,
                                                                 std::array<bool, 4> output_mask) {
  return rmsnorm_backward(grad, x, weight, shift, scale, OptPlan(plan), rstd, eps, numerics, output_mask);
}

// ---------------------------------------------------------------------------
// gate_residual (and sp_gate_residual through the _with forms)

namespace {
detdit::GateResidualInputs gate_residual_inputs(const Tensor& residual, const Tensor& y, const Tensor& gate,
                                                const IndexPlan& plan) {
  detdit::GateResidualInputs in;
  in.residual = view(residual, "residual");
  in.y = view(y, "y");
  in.gate = view(gate, "gate");
  in.plan = plan;
  return in;
}
}  // namespace

Tensor gate_residual_with(const Call<detdit::GateResidualParams>& call, const Tensor& residual, const Tensor& y,
                          const Tensor& gate, const IndexPlan& plan) {
  require_contiguous(residual, "residual");
  DeviceScope scope(residual);
  Tensor out = output_like(residual);
  detdit::GateResidualParams p;
  p.in = gate_residual_inputs(residual, y, gate, plan);
  p.out = view(out, "out");
  check_ok(call(p, scope.stream()));
  return out;
}

std::tuple<Tensor, Tensor, Tensor> gate_residual_backward_with(const Call<detdit::GateResidualBackwardParams>& call,
                                                               const Tensor& grad, const Tensor& y,
                                                               const Tensor& gate, const IndexPlan& plan,
                                                               std::array<bool, 3> output_mask) {
  require_contiguous(y, "y");
  DeviceScope scope(y);
  Tensor d_residual = output_like(y, output_mask[0]);
  Tensor d_y = output_like(y, output_mask[1]);
  Tensor d_gate = table_grad(output_mask[2], gate, "gate", plan, y);
  detdit::GateResidualBackwardParams p;
  p.grad = view(grad, "grad");  // before the inputs: a bad grad has always been reported first
  p.in = gate_residual_inputs(Tensor(), y, gate, plan);
  p.d_residual = view(d_residual, "d_residual");
  p.d_y = view(d_y, "d_y");
  p.d_gate = view(d_gate, "d_gate");
  check_ok(call(p, scope.stream()));
  return {d_residual, d_y, d_gate};
}

Tensor gate_residual(const Tensor& residual, const Tensor& y, const Tensor& gate, const PlanPtr& plan) {
  return gate_residual_with(detdit::gate_residual_forward, residual, y, gate,
                            required_plan(plan, "gate_residual")->plan);
}

std::tuple<Tensor, Tensor, Tensor> gate_residual_backward(const Tensor& grad, const Tensor& y, const Tensor& gate,
                                                          const PlanPtr& plan, std::array<bool, 3> output_mask) {
  return gate_residual_backward_with(detdit::gate_residual_backward, grad, y, gate,
                                     required_plan(plan, "gate_residual_backward")->plan, output_mask);
}

// ---------------------------------------------------------------------------
// the modulation forms: rmsnorm.forms, gate_residual.forms and their backwards

namespace {
bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// out's dtype (numerics 5.12): fp32 for fp32 modulation with upcast = false,
// else x's. Mixed modulation dtypes are the op's error, raised in the call.
at::ScalarType modulated_out_type(const Tensor& x, const OptTensor& m, bool upcast) {
  const bool fp32_modulation = present(m) && m->scalar_type() == at::kFloat;
  return fp32_modulation && !upcast ? at::kFloat : x.scalar_type();
}

// The gradient of modulation tensor m (wanted and present): m's shape and
// dtype, or (R, H) for the indexed form, once resolve_modulation accepted the
// call's tensors (its error otherwise, as the op would raise it). local_rows:
// x is one rank's rows of a sequence-parallel region, against which a grouped
// form does not resolve (a frame is of the global S; the sp_ op resolves it
// against the global (B, S, H) and raises its error), so the gradient takes
// m's own shape, which is the resolved one ((R, H) for the indexed form).
Tensor modulation_grad(bool wanted, const OptTensor& m, const Tensor& x, const char* x_name,
                       std::initializer_list<detdit::NamedModulation> all, const IndexPlan& plan,
                       bool local_rows = false) {
  if (!wanted || !present(m)) return Tensor();
  if (local_rows) return empty_like_shape(x, m->sizes(), m->scalar_type());
  detdit::ResolvedModulation resolved;
  check_ok(detdit::resolve_modulation(view(x, x_name), x_name, all, plan, &resolved));
  if (resolved.form == detdit::ModulationForm::kIndexed)
    return empty_like_shape(x, {plan.num_rows(), dim_or_zero(x, -1)}, m->scalar_type());
  return empty_like_shape(x, m->sizes(), m->scalar_type());
}
}  // namespace

std::tuple<Tensor, Tensor> rmsnorm_forms_with(const Call<detdit::RmsnormParams>& call, const Tensor& x,
                                              const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                                              const IndexPlan& plan, double eps, const std::string& numerics,
                                              bool upcast) {
  require_contiguous(x, "x");
  DeviceScope scope(x);
  Tensor out = empty_like_shape(x, x.sizes(), modulated_out_type(x, shift, upcast));
  Tensor rstd = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  detdit::RmsnormParams p;
  p.in = rmsnorm_inputs(x, weight, shift, scale, plan, eps, numerics);
  p.in.upcast = upcast;
  p.out = view(out, "out");
  p.rstd = view(rstd, "rstd");
  check_ok(call(p, scope.stream()));
  return {out, rstd};
}

std::tuple<Tensor, Tensor> rmsnorm_forms(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                         const OptTensor& scale, const OptPlan& plan, double eps,
                                         const std::string& numerics, bool upcast) {
  return rmsnorm_forms_with(detdit::rmsnorm_forward, x, weight, shift, scale, plan_of(plan), eps, numerics, upcast);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_forms_with(
    const Call<detdit::RmsnormBackwardParams>& call, const Tensor& grad, const Tensor& x, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& rstd, double eps,
    const std::string& numerics, bool upcast, std::array<bool, 4> output_mask, bool local_rows) {
  require_contiguous(x, "x");
  require_contiguous(weight, "weight");
  DeviceScope scope(x);
  detdit::RmsnormBackwardParams p;
  p.in = rmsnorm_inputs(x, weight, shift, scale, plan, eps, numerics);
  p.in.upcast = upcast;
  Tensor dx = output_like(x, output_mask[0]);
  Tensor d_weight = maybe_empty(output_mask[1], x, {dim_or_zero(weight, 0)}, weight.scalar_type());
  const std::initializer_list<detdit::NamedModulation> all = {{&p.in.shift, "shift"}, {&p.in.scale, "scale"}};
  Tensor d_shift = modulation_grad(output_mask[2], shift, x, "x", all, p.in.plan, local_rows);
  Tensor d_scale = modulation_grad(output_mask[3], scale, x, "x", all, p.in.plan, local_rows);
  p.rstd = view(rstd, "rstd");
  p.grad = view(grad, "grad");
  p.dx = view(dx, "dx");
  p.d_weight = view(d_weight, "d_weight");
  p.d_shift = view(d_shift, "d_shift");
  p.d_scale = view(d_scale, "d_scale");
  check_ok(call(p, scope.stream()));
  return {dx, d_weight, d_shift, d_scale};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_forms(const Tensor& grad, const Tensor& x,
                                                                  const Tensor& weight, const OptTensor& shift,
                                                                  const OptTensor& scale, const OptPlan& plan,
                                                                  const Tensor& rstd, double eps,
                                                                  const std::string& numerics, bool upcast,
                                                                  std::array<bool, 4> output_mask) {
  return rmsnorm_backward_forms_with(detdit::rmsnorm_backward, grad, x, weight, shift, scale, plan_of(plan), rstd,
                                     eps, numerics, upcast, output_mask, false);
}

namespace {
detdit::GateResidualInputs gate_residual_forms_inputs(const Tensor& residual, const Tensor& y, const OptTensor& gate,
                                                      const IndexPlan& plan, bool upcast, Optional<double> k) {
  detdit::GateResidualInputs in;
  in.residual = view(residual, "residual");
  in.y = view(y, "y");
  in.gate = view(gate, "gate");
  in.plan = plan;
  in.has_k = k.has_value();
  in.k = k.has_value() ? static_cast<float>(*k) : 0.0f;  // an FP32 constant (gate_residual.h)
  in.upcast = upcast;
  return in;
}
}  // namespace

Tensor gate_residual_forms_with(const Call<detdit::GateResidualParams>& call, const Tensor& residual, const Tensor& y,
                                const OptTensor& gate, const IndexPlan& plan, bool upcast, Optional<double> k) {
  require_contiguous(residual, "residual");
  DeviceScope scope(residual);
  Tensor out = empty_like_shape(residual, residual.sizes(), modulated_out_type(residual, gate, upcast));
  detdit::GateResidualParams p;
  p.in = gate_residual_forms_inputs(residual, y, gate, plan, upcast, k);
  p.out = view(out, "out");
  check_ok(call(p, scope.stream()));
  return out;
}

Tensor gate_residual_forms(const Tensor& residual, const Tensor& y, const OptTensor& gate, const OptPlan& plan,
                           bool upcast, Optional<double> k) {
  return gate_residual_forms_with(detdit::gate_residual_forward, residual, y, gate, plan_of(plan), upcast, k);
}

std::tuple<Tensor, Tensor, Tensor> gate_residual_backward_forms_with(
    const Call<detdit::GateResidualBackwardParams>& call, const Tensor& grad, const Tensor& y, const OptTensor& gate,
    const IndexPlan& plan, bool upcast, Optional<double> k, std::array<bool, 3> output_mask, bool local_rows) {
  require_contiguous(y, "y");
  DeviceScope scope(y);
  detdit::GateResidualBackwardParams p;
  p.grad = view(grad, "grad");  // before the inputs, as gate_residual_backward
  p.in = gate_residual_forms_inputs(Tensor(), y, gate, plan, upcast, k);
  Tensor d_residual = output_like(y, output_mask[0]);
  Tensor d_y = output_like(y, output_mask[1]);
  Tensor d_gate = modulation_grad(output_mask[2], gate, y, "y", {{&p.in.gate, "gate"}}, p.in.plan, local_rows);
  p.d_residual = view(d_residual, "d_residual");
  p.d_y = view(d_y, "d_y");
  p.d_gate = view(d_gate, "d_gate");
  check_ok(call(p, scope.stream()));
  return {d_residual, d_y, d_gate};
}

std::tuple<Tensor, Tensor, Tensor> gate_residual_backward_forms(const Tensor& grad, const Tensor& y,
                                                                const OptTensor& gate, const OptPlan& plan,
                                                                bool upcast, Optional<double> k,
                                                                std::array<bool, 3> output_mask) {
  return gate_residual_backward_forms_with(detdit::gate_residual_backward, grad, y, gate, plan_of(plan), upcast, k,
                                           output_mask, false);
}

// ---------------------------------------------------------------------------
// gate_residual_rmsnorm (and sp_gate_residual_rmsnorm through the _with forms)

namespace {
detdit::GateResidualRmsnormInputs gate_residual_rmsnorm_inputs(const Tensor& residual, const Tensor& y,
                                                              const Tensor& gate, const Tensor& weight,
                                                              const OptTensor& shift, const OptTensor& scale,
                                                              const IndexPlan& plan, double eps,
                                                              const std::string& numerics) {
  detdit::GateResidualRmsnormInputs in;
  in.residual = view(residual, "residual");
  in.y = view(y, "y");
  in.gate = view(gate, "gate");
  in.weight = view(weight, "weight");
  in.shift = view(shift, "shift");
  in.scale = view(scale, "scale");
  in.plan = plan;
  in.eps = static_cast<float>(eps);
  in.numerics = parse_numerics(numerics);
  return in;
}
}  // namespace

namespace {
// The `.forms` inputs: the plan optional, the gate optional, the recipe and k.
detdit::GateResidualRmsnormInputs gate_residual_rmsnorm_forms_inputs(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const Tensor& weight, const OptTensor& shift,
    const OptTensor& scale, const IndexPlan& plan, double eps, const std::string& numerics, bool upcast,
    Optional<double> k) {
  detdit::GateResidualRmsnormInputs in = gate_residual_rmsnorm_inputs(
      residual, y, gate.value_or(Tensor()), weight, shift, scale, plan, eps, numerics);
  in.has_k = k.has_value();
  in.k = k.has_value() ? static_cast<float>(*k) : 0.0f;  // an FP32 constant (gate_residual.h)
  in.upcast = upcast;
  return in;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm_with(const Call<detdit::GateResidualRmsnormParams>& call,
                                                              const Tensor& residual, const Tensor& y,
                                                              const Tensor& gate, const Tensor& weight,
                                                              const OptTensor& shift, const OptTensor& scale,
                                                              const IndexPlan& plan, double eps,
                                                              const std::string& numerics) {
  require_contiguous(residual, "residual");
  DeviceScope scope(residual);
  Tensor h = output_like(residual);
  Tensor out = output_like(residual);
  Tensor rstd = empty_like_shape(residual, {leading_rows(residual)}, at::kFloat);
  detdit::GateResidualRmsnormParams p;
  p.in = gate_residual_rmsnorm_inputs(residual, y, gate, weight, shift, scale, plan, eps, numerics);
  p.h = view(h, "h");
  p.out = view(out, "out");
  p.rstd = view(rstd, "rstd");
  check_ok(call(p, scope.stream()));
  return {h, out, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward_with(
    const Call<detdit::GateResidualRmsnormBackwardParams>& call, const Call<detdit::GateResidualBackwardParams>& gate_call,
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const Tensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& h, const Tensor& rstd,
    double eps, const std::string& numerics, std::array<bool, 6> output_mask) {
  if (!d_out.has_value()) {
    if (!d_h.has_value()) return {};
    auto [d_residual, d_y, d_gate] =
        gate_residual_backward_with(gate_call, *d_h, y, gate, plan, {output_mask[0], output_mask[1], output_mask[2]});
    return {d_residual, d_y, d_gate, Tensor(), Tensor(), Tensor()};
  }
  require_contiguous(h, "h");
  require_contiguous(weight, "weight");
  DeviceScope scope(h);
  Tensor d_residual = output_like(h, output_mask[0]);
  Tensor d_y = output_like(h, output_mask[1]);
  Tensor d_gate = table_grad(output_mask[2], gate, "gate", plan, h);
  Tensor d_weight = maybe_empty(output_mask[3], h, {dim_or_zero(weight, 0)}, weight.scalar_type());
  Tensor d_shift = table_grad(output_mask[4], shift, "shift", plan, h);
  Tensor d_scale = table_grad(output_mask[5], scale, "scale", plan, h);
  detdit::GateResidualRmsnormBackwardParams p;
  p.in = gate_residual_rmsnorm_inputs(Tensor(), y, gate, weight, shift, scale, plan, eps, numerics);
  p.h = view(h, "h");
  p.rstd = view(rstd, "rstd");
  p.d_out = view(d_out, "d_out");
  p.d_h = view(d_h, "d_h");
  p.d_residual = view(d_residual, "d_residual");
  p.d_y = view(d_y, "d_y");
  p.d_gate = view(d_gate, "d_gate");
  p.d_weight = view(d_weight, "d_weight");
  p.d_shift = view(d_shift, "d_shift");
  p.d_scale = view(d_scale, "d_scale");
  check_ok(call(p, scope.stream()));
  return {d_residual, d_y, d_gate, d_weight, d_shift, d_scale};
}

std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm(const Tensor& residual, const Tensor& y, const Tensor& gate,
                                                         const Tensor& weight, const OptTensor& shift,
                                                         const OptTensor& scale, const PlanPtr& plan, double eps,
                                                         const std::string& numerics) {
  return gate_residual_rmsnorm_with(detdit::gate_residual_rmsnorm_forward, residual, y, gate, weight, shift, scale,
                                    required_plan(plan, "gate_residual_rmsnorm")->plan, eps, numerics);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const Tensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const PlanPtr& plan, const Tensor& h, const Tensor& rstd,
    double eps, const std::string& numerics, std::array<bool, 6> output_mask) {
  return gate_residual_rmsnorm_backward_with(detdit::gate_residual_rmsnorm_backward, detdit::gate_residual_backward,
                                             d_out, d_h, y, gate, weight, shift, scale,
                                             required_plan(plan, "gate_residual_rmsnorm_backward")->plan, h, rstd,
                                             eps, numerics, output_mask);
}

std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm_forms_with(
    const Call<detdit::GateResidualRmsnormParams>& call, const Tensor& residual, const Tensor& y,
    const OptTensor& gate, const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
    const IndexPlan& plan, double eps, const std::string& numerics, bool upcast, Optional<double> k) {
  require_contiguous(residual, "residual");
  DeviceScope scope(residual);
  // h: gate_residual's out dtype; out: rmsnorm's for x = h (numerics 5.12)
  const at::ScalarType h_type = modulated_out_type(residual, gate, upcast);
  const bool fp32_norm = present(shift) && shift->scalar_type() == at::kFloat && !upcast;
  Tensor h = empty_like_shape(residual, residual.sizes(), h_type);
  Tensor out = empty_like_shape(residual, residual.sizes(), fp32_norm ? at::kFloat : h_type);
  Tensor rstd = empty_like_shape(residual, {leading_rows(residual)}, at::kFloat);
  detdit::GateResidualRmsnormParams p;
  p.in = gate_residual_rmsnorm_forms_inputs(residual, y, gate, weight, shift, scale, plan, eps, numerics, upcast, k);
  p.h = view(h, "h");
  p.out = view(out, "out");
  p.rstd = view(rstd, "rstd");
  check_ok(call(p, scope.stream()));
  return {h, out, rstd};
}

std::tuple<Tensor, Tensor, Tensor> gate_residual_rmsnorm_forms(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const Tensor& weight, const OptTensor& shift,
    const OptTensor& scale, const OptPlan& plan, double eps, const std::string& numerics, bool upcast,
    Optional<double> k) {
  return gate_residual_rmsnorm_forms_with(detdit::gate_residual_rmsnorm_forward, residual, y, gate, weight, shift,
                                          scale, plan_of(plan), eps, numerics, upcast, k);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward_forms_with(
    const Call<detdit::GateResidualRmsnormBackwardParams>& call, const Call<detdit::GateResidualBackwardParams>& gate_call,
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const IndexPlan& gate_plan,
    const Tensor& h, const Tensor& rstd, double eps, const std::string& numerics, bool upcast, Optional<double> k,
    std::array<bool, 6> output_mask, bool local_rows) {
  if (!d_out.has_value()) {
    if (!d_h.has_value()) return {};
    auto [d_residual, d_y, d_gate] = gate_residual_backward_forms_with(
        gate_call, *d_h, y, gate, gate_plan, upcast, k, {output_mask[0], output_mask[1], output_mask[2]}, local_rows);
    return {d_residual, d_y, d_gate, Tensor(), Tensor(), Tensor()};
  }
  require_contiguous(y, "y");
  require_contiguous(h, "h");
  require_contiguous(weight, "weight");
  DeviceScope scope(h);
  detdit::GateResidualRmsnormBackwardParams p;
  p.in = gate_residual_rmsnorm_forms_inputs(Tensor(), y, gate, weight, shift, scale, plan, eps, numerics, upcast, k);
  Tensor d_residual = output_like(y, output_mask[0]);
  Tensor d_y = output_like(y, output_mask[1]);
  Tensor d_gate = modulation_grad(output_mask[2], gate, y, "y", {{&p.in.gate, "gate"}}, p.in.plan, local_rows);
  Tensor d_weight = maybe_empty(output_mask[3], h, {dim_or_zero(weight, 0)}, weight.scalar_type());
  const std::initializer_list<detdit::NamedModulation> all = {{&p.in.shift, "shift"}, {&p.in.scale, "scale"}};
  Tensor d_shift = modulation_grad(output_mask[4], shift, h, "h", all, p.in.plan, local_rows);
  Tensor d_scale = modulation_grad(output_mask[5], scale, h, "h", all, p.in.plan, local_rows);
  p.h = view(h, "h");
  p.rstd = view(rstd, "rstd");
  p.d_out = view(d_out, "d_out");
  p.d_h = view(d_h, "d_h");
  p.d_residual = view(d_residual, "d_residual");
  p.d_y = view(d_y, "d_y");
  p.d_gate = view(d_gate, "d_gate");
  p.d_weight = view(d_weight, "d_weight");
  p.d_shift = view(d_shift, "d_shift");
  p.d_scale = view(d_scale, "d_scale");
  check_ok(call(p, scope.stream()));
  return {d_residual, d_y, d_gate, d_weight, d_shift, d_scale};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_rmsnorm_backward_forms(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const OptPlan& plan, const Tensor& h, const Tensor& rstd,
    double eps, const std::string& numerics, bool upcast, Optional<double> k, std::array<bool, 6> output_mask) {
  const IndexPlan index = plan_of(plan);
  return gate_residual_rmsnorm_backward_forms_with(detdit::gate_residual_rmsnorm_backward,
                                                   detdit::gate_residual_backward, d_out, d_h, y, gate, weight, shift,
                                                   scale, index, index, h, rstd, eps, numerics, upcast, k, output_mask,
                                                   false);
}

// ---------------------------------------------------------------------------
// final_adaln_out

namespace {
detdit::FinalAdalnOutInputs final_adaln_out_inputs(const Tensor& x, const Tensor& norm_weight, const Tensor& temb,
                                                   const Tensor& weight, const Tensor& bias, const IndexPlan& plan,
                                                   double eps, const std::string& numerics) {
  detdit::FinalAdalnOutInputs in;
  in.x = view(x, "x");
  in.norm_weight = view(norm_weight, "norm_weight");
  in.temb = view(temb, "temb");
  in.weight = view(weight, "weight");
  in.bias = view(bias, "bias");
  in.plan = plan;
  in.eps = static_cast<float>(eps);
  in.numerics = parse_numerics(numerics);
  return in;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> final_adaln_out(const Tensor& x, const Tensor& norm_weight,
                                                           const Tensor& temb, const Tensor& weight,
                                                           const Tensor& bias, const PlanPtr& plan, double eps,
                                                           const std::string& numerics) {
  const IndexPlan& index = required_plan(plan, "final_adaln_out")->plan;
  require_contiguous(x, "x");
  require_projection_operands(temb, weight);
  DeviceScope scope(x);
  Tensor out = output_like(x);
  Tensor table = empty_like_shape(x, {dim_or_zero(temb, 0), dim_or_zero(weight, 0)}, weight.scalar_type());
  Tensor act = empty_like_shape(x, matrix_shape(temb), weight.scalar_type());
  Tensor rstd = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  detdit::FinalAdalnOutParams p;
  p.in = final_adaln_out_inputs(x, norm_weight, temb, weight, bias, index, eps, numerics);
  p.out = view(out, "out");
  p.table = view(table, "table");
  p.act = view(act, "act");
  p.rstd = view(rstd, "rstd");
  check_ok(detdit::final_adaln_out_forward(p, scope.stream()));
  return {out, table, act, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> final_adaln_out_backward(
    const Tensor& grad, const Tensor& x, const Tensor& norm_weight, const Tensor& temb, const Tensor& weight,
    const Tensor& table, const Tensor& act, const Tensor& rstd, const PlanPtr& plan, double eps,
    const std::string& numerics, std::array<bool, 5> output_mask) {
  const IndexPlan& index = required_plan(plan, "final_adaln_out_backward")->plan;
  require_contiguous(x, "x");
  require_contiguous(norm_weight, "norm_weight");
  require_contiguous(temb, "temb");
  require_contiguous(weight, "weight");
  DeviceScope scope(x);
  Tensor dx = output_like(x, output_mask[0]);
  Tensor d_norm_weight = maybe_empty(output_mask[1], x, {dim_or_zero(norm_weight, 0)}, norm_weight.scalar_type());
  Tensor d_temb = maybe_empty(output_mask[2], x, matrix_shape(temb), at::kFloat);
  Tensor d_weight = maybe_empty(output_mask[3], x, matrix_shape(weight), weight.scalar_type());
  Tensor d_bias = maybe_empty(output_mask[4], x, {dim_or_zero(weight, 0)}, weight.scalar_type());
  detdit::FinalAdalnOutBackwardParams p;
  p.in = final_adaln_out_inputs(x, norm_weight, temb, weight, Tensor(), index, eps, numerics);
  p.table = view(table, "table");
  p.act = view(act, "act");
  p.rstd = view(rstd, "rstd");
  p.grad = view(grad, "grad");
  p.dx = view(dx, "dx");
  p.d_norm_weight = view(d_norm_weight, "d_norm_weight");
  p.d_temb = view(d_temb, "d_temb");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  check_ok(detdit::final_adaln_out_backward(p, scope.stream()));
  return {dx, d_norm_weight, d_temb, d_weight, d_bias};
}

// ---------------------------------------------------------------------------
// adaln_modulation

namespace {
detdit::AdalnModulationInputs adaln_modulation_inputs(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                      const IndexPlan& plan, const std::string& numerics) {
  detdit::AdalnModulationInputs in;
  in.temb = view(temb, "temb");
  in.weight = view(weight, "weight");
  in.bias = view(bias, "bias");
  in.plan = plan;
  in.numerics = parse_numerics(numerics);
  return in;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> adaln_modulation(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                    const PlanPtr& plan, const std::string& numerics) {
  const IndexPlan& index = required_plan(plan, "adaln_modulation")->plan;
  require_projection_operands(temb, weight);
  // the plan indexes the (3T, 6H) rows of the table: out (6, S, H) is sized from it
  if (temb.dim() == 2 && index.num_rows() != 3 * temb.size(0))
    C10_THROW_ERROR(ValueError, "plan must have R = 3T = " + std::to_string(3 * temb.size(0)) +
                                    " table rows, got R = " + std::to_string(index.num_rows()));
  DeviceScope scope(temb);
  const int64_t outputs = dim_or_zero(weight, 0);
  const int64_t hidden = hidden_of(outputs, detdit::kNumModalities * detdit::kAdalnChunks, "weight", "(18H, D)");
  Tensor out = empty_like_shape(temb, {detdit::kAdalnChunks, index.seq_len(), hidden}, weight.scalar_type());
  Tensor table = empty_like_shape(temb, {dim_or_zero(temb, 0), outputs}, weight.scalar_type());
  Tensor act = empty_like_shape(temb, matrix_shape(temb), weight.scalar_type());
  detdit::AdalnModulationParams p;
  p.in = adaln_modulation_inputs(temb, weight, bias, index, numerics);
  p.table = view(table, "table");
  p.act = view(act, "act");
  p.out = view(out, "out");
  check_ok(detdit::adaln_modulation_forward(p, scope.stream()));
  return {out, table, act};
}

std::tuple<Tensor, Tensor, Tensor> adaln_modulation_backward(const Tensor& grad, const Tensor& temb,
                                                             const Tensor& weight, const Tensor& act,
                                                             const PlanPtr& plan, const std::string& numerics,
                                                             std::array<bool, 3> output_mask) {
  PlanPtr holder = required_plan(plan, "adaln_modulation_backward");
  require_contiguous(temb, "temb");
  require_contiguous(weight, "weight");
  DeviceScope scope(temb);
  Tensor d_temb = maybe_empty(output_mask[0], temb, matrix_shape(temb), at::kFloat);
  Tensor d_weight = maybe_empty(output_mask[1], temb, matrix_shape(weight), weight.scalar_type());
  Tensor d_bias = maybe_empty(output_mask[2], temb, {dim_or_zero(weight, 0)}, weight.scalar_type());
  detdit::AdalnModulationBackwardParams p;
  p.in = adaln_modulation_inputs(temb, weight, Tensor(), gather_backward_plan(*holder, grad, scope.stream()),
                                 numerics);
  p.act = view(act, "act");
  p.grad = view(grad, "grad");
  p.d_temb = view(d_temb, "d_temb");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  check_ok(detdit::adaln_modulation_backward(p, scope.stream()));
  return {d_temb, d_weight, d_bias};
}

// ---------------------------------------------------------------------------
// layernorm

namespace {
detdit::LayernormInputs layernorm_inputs(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps,
                                         const std::string& numerics) {
  detdit::LayernormInputs in;
  in.x = view(x, "x");
  in.weight = view(weight, "weight");
  in.bias = view(bias, "bias");
  in.eps = static_cast<float>(eps);
  in.numerics = parse_numerics(numerics);
  return in;
}

// A parameter's gradient (H,) in its dtype, when wanted and the parameter is given.
Tensor parameter_grad(bool wanted, const OptTensor& parameter, const Tensor& like) {
  if (!wanted || !parameter.has_value() || !parameter->defined()) return Tensor();
  return empty_like_shape(like, {dim_or_zero(like, -1)}, parameter->scalar_type());
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> layernorm(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                             double eps, const std::string& numerics) {
  require_contiguous(x, "x");
  DeviceScope scope(x);
  Tensor out = output_like(x);
  Tensor mean = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  Tensor rstd = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  detdit::LayernormParams p;
  p.in = layernorm_inputs(x, weight, bias, eps, numerics);
  p.out = view(out, "out");
  p.mean = view(mean, "mean");
  p.rstd = view(rstd, "rstd");
  check_ok(detdit::layernorm_forward(p, scope.stream()));
  return {out, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_backward(const Tensor& grad, const Tensor& x, const OptTensor& weight,
                                                      const OptTensor& bias, const Tensor& mean, const Tensor& rstd,
                                                      double eps, const std::string& numerics,
                                                      std::array<bool, 3> output_mask) {
  require_contiguous(x, "x");
  DeviceScope scope(x);
  Tensor dx = output_like(x, output_mask[0]);
  Tensor d_weight = parameter_grad(output_mask[1], weight, x);
  Tensor d_bias = parameter_grad(output_mask[2], bias, x);
  detdit::LayernormBackwardParams p;
  p.in = layernorm_inputs(x, weight, bias, eps, numerics);
  p.mean = view(mean, "mean");
  p.rstd = view(rstd, "rstd");
  p.grad = view(grad, "grad");
  p.dx = view(dx, "dx");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  check_ok(detdit::layernorm_backward(p, scope.stream()));
  return {dx, d_weight, d_bias};
}

// ---------------------------------------------------------------------------
// layernorm.forms (the modulation forms, as rmsnorm.forms)

namespace {
detdit::LayernormInputs layernorm_forms_inputs(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                               const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan,
                                               double eps, const std::string& numerics, bool upcast) {
  detdit::LayernormInputs in = layernorm_inputs(x, weight, bias, eps, numerics);
  in.shift = view(shift, "shift");
  in.scale = view(scale, "scale");
  in.plan = plan;
  in.upcast = upcast;
  return in;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> layernorm_forms_with(const Call<detdit::LayernormParams>& call, const Tensor& x,
                                                        const OptTensor& weight, const OptTensor& bias,
                                                        const OptTensor& shift, const OptTensor& scale,
                                                        const IndexPlan& plan, double eps,
                                                        const std::string& numerics, bool upcast) {
  require_contiguous(x, "x");
  DeviceScope scope(x);
  Tensor out = empty_like_shape(x, x.sizes(), modulated_out_type(x, shift, upcast));
  Tensor mean = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  Tensor rstd = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  detdit::LayernormParams p;
  p.in = layernorm_forms_inputs(x, weight, bias, shift, scale, plan, eps, numerics, upcast);
  p.out = view(out, "out");
  p.mean = view(mean, "mean");
  p.rstd = view(rstd, "rstd");
  check_ok(call(p, scope.stream()));
  return {out, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_forms(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                                   const OptTensor& shift, const OptTensor& scale,
                                                   const OptPlan& plan, double eps, const std::string& numerics,
                                                   bool upcast) {
  return layernorm_forms_with(detdit::layernorm_forward, x, weight, bias, shift, scale, plan_of(plan), eps, numerics,
                              upcast);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_backward_forms_with(
    const Call<detdit::LayernormBackwardParams>& call, const Tensor& grad, const Tensor& x, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& mean,
    const Tensor& rstd, double eps, const std::string& numerics, bool upcast, std::array<bool, 5> output_mask,
    bool local_rows) {
  require_contiguous(x, "x");
  DeviceScope scope(x);
  detdit::LayernormBackwardParams p;
  p.in = layernorm_forms_inputs(x, weight, bias, shift, scale, plan, eps, numerics, upcast);
  Tensor dx = output_like(x, output_mask[0]);
  Tensor d_weight = parameter_grad(output_mask[1], weight, x);
  Tensor d_bias = parameter_grad(output_mask[2], bias, x);
  const std::initializer_list<detdit::NamedModulation> all = {{&p.in.shift, "shift"}, {&p.in.scale, "scale"}};
  Tensor d_shift = modulation_grad(output_mask[3], shift, x, "x", all, p.in.plan, local_rows);
  Tensor d_scale = modulation_grad(output_mask[4], scale, x, "x", all, p.in.plan, local_rows);
  p.mean = view(mean, "mean");
  p.rstd = view(rstd, "rstd");
  p.grad = view(grad, "grad");
  p.dx = view(dx, "dx");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  p.d_shift = view(d_shift, "d_shift");
  p.d_scale = view(d_scale, "d_scale");
  check_ok(call(p, scope.stream()));
  return {dx, d_weight, d_bias, d_shift, d_scale};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_backward_forms(
    const Tensor& grad, const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const OptPlan& plan, const Tensor& mean, const Tensor& rstd, double eps,
    const std::string& numerics, bool upcast, std::array<bool, 5> output_mask) {
  return layernorm_backward_forms_with(detdit::layernorm_backward, grad, x, weight, bias, shift, scale, plan_of(plan),
                                       mean, rstd, eps, numerics, upcast, output_mask, false);
}

// ---------------------------------------------------------------------------
// gate_residual_layernorm

namespace {
detdit::GateResidualLayernormInputs gate_residual_layernorm_inputs(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, double eps, const std::string& numerics,
    bool upcast, Optional<double> k) {
  detdit::GateResidualLayernormInputs in;
  in.residual = view(residual, "residual");
  in.y = view(y, "y");
  in.gate = view(gate, "gate");
  in.weight = view(weight, "weight");
  in.bias = view(bias, "bias");
  in.shift = view(shift, "shift");
  in.scale = view(scale, "scale");
  in.plan = plan;
  in.has_k = k.has_value();
  in.k = k.has_value() ? static_cast<float>(*k) : 0.0f;  // an FP32 constant (gate_residual.h)
  in.eps = static_cast<float>(eps);
  in.numerics = parse_numerics(numerics);
  in.upcast = upcast;
  return in;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> gate_residual_layernorm_with(
    const Call<detdit::GateResidualLayernormParams>& call, const Tensor& residual, const Tensor& y,
    const OptTensor& gate, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const IndexPlan& plan, double eps, const std::string& numerics, bool upcast,
    Optional<double> k) {
  require_contiguous(residual, "residual");
  DeviceScope scope(residual);
  // h: gate_residual's out dtype; out: layernorm's for x = h (numerics 5.12)
  const at::ScalarType h_type = modulated_out_type(residual, gate, upcast);
  const bool fp32_norm = present(shift) && shift->scalar_type() == at::kFloat && !upcast;
  Tensor h = empty_like_shape(residual, residual.sizes(), h_type);
  Tensor out = empty_like_shape(residual, residual.sizes(), fp32_norm ? at::kFloat : h_type);
  Tensor mean = empty_like_shape(residual, {leading_rows(residual)}, at::kFloat);
  Tensor rstd = empty_like_shape(residual, {leading_rows(residual)}, at::kFloat);
  detdit::GateResidualLayernormParams p;
  p.in = gate_residual_layernorm_inputs(residual, y, gate, weight, bias, shift, scale, plan, eps, numerics, upcast, k);
  p.h = view(h, "h");
  p.out = view(out, "out");
  p.mean = view(mean, "mean");
  p.rstd = view(rstd, "rstd");
  check_ok(call(p, scope.stream()));
  return {out, h, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> gate_residual_layernorm(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& shift, const OptTensor& scale, const OptPlan& plan, double eps, const std::string& numerics,
    bool upcast, Optional<double> k) {
  return gate_residual_layernorm_with(detdit::gate_residual_layernorm_forward, residual, y, gate, weight, bias, shift,
                                      scale, plan_of(plan), eps, numerics, upcast, k);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_layernorm_backward_with(
    const Call<detdit::GateResidualLayernormBackwardParams>& call,
    const Call<detdit::GateResidualBackwardParams>& gate_call, const OptTensor& d_out, const OptTensor& d_h,
    const Tensor& y, const OptTensor& gate, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const IndexPlan& plan, const Tensor& h, const Tensor& mean, const Tensor& rstd,
    double eps, const std::string& numerics, bool upcast, Optional<double> k, std::array<bool, 7> output_mask,
    bool local_rows) {
  if (!d_out.has_value()) {
    if (!d_h.has_value()) return {};
    auto [d_residual, d_y, d_gate] = gate_residual_backward_forms_with(
        gate_call, *d_h, y, gate, plan, upcast, k, {output_mask[0], output_mask[1], output_mask[2]}, local_rows);
    return {d_residual, d_y, d_gate, Tensor(), Tensor(), Tensor(), Tensor()};
  }
  require_contiguous(y, "y");
  require_contiguous(h, "h");
  DeviceScope scope(h);
  detdit::GateResidualLayernormBackwardParams p;
  p.in = gate_residual_layernorm_inputs(Tensor(), y, gate, weight, bias, shift, scale, plan, eps, numerics, upcast, k);
  Tensor d_residual = output_like(y, output_mask[0]);
  Tensor d_y = output_like(y, output_mask[1]);
  Tensor d_gate = modulation_grad(output_mask[2], gate, y, "y", {{&p.in.gate, "gate"}}, p.in.plan, local_rows);
  Tensor d_weight = parameter_grad(output_mask[3], weight, h);
  Tensor d_bias = parameter_grad(output_mask[4], bias, h);
  const std::initializer_list<detdit::NamedModulation> all = {{&p.in.shift, "shift"}, {&p.in.scale, "scale"}};
  Tensor d_shift = modulation_grad(output_mask[5], shift, h, "h", all, p.in.plan, local_rows);
  Tensor d_scale = modulation_grad(output_mask[6], scale, h, "h", all, p.in.plan, local_rows);
  p.h = view(h, "h");
  p.mean = view(mean, "mean");
  p.rstd = view(rstd, "rstd");
  p.d_out = view(d_out, "d_out");
  p.d_h = view(d_h, "d_h");
  p.d_residual = view(d_residual, "d_residual");
  p.d_y = view(d_y, "d_y");
  p.d_gate = view(d_gate, "d_gate");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  p.d_shift = view(d_shift, "d_shift");
  p.d_scale = view(d_scale, "d_scale");
  check_ok(call(p, scope.stream()));
  return {d_residual, d_y, d_gate, d_weight, d_bias, d_shift, d_scale};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gate_residual_layernorm_backward(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& shift, const OptTensor& scale, const OptPlan& plan, const Tensor& h,
    const Tensor& mean, const Tensor& rstd, double eps, const std::string& numerics, bool upcast,
    Optional<double> k, std::array<bool, 7> output_mask) {
  return gate_residual_layernorm_backward_with(detdit::gate_residual_layernorm_backward, detdit::gate_residual_backward,
                                               d_out, d_h, y, gate, weight, bias, shift, scale, plan_of(plan), h, mean,
                                               rstd, eps, numerics, upcast, k, output_mask, false);
}

}  // namespace detdit_torch
