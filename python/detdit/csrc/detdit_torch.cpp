// detdit's PyTorch binding: every detdit op as a torch operator.
//
// Contract:
// - TORCH_LIBRARY(detdit) defines one schema per op forward (`detdit::<op>`,
//   returning the output and the tensors its backward needs) and one per op
//   backward (`detdit::<op>_backward`, with an output mask). Their CPU and CUDA
//   kernels are the same functions: they wrap torch tensors as
//   detdit::TensorView (pointer, dtype, shape, strides, device), allocate every
//   output with at::empty, and call the public C++ API, which validates every
//   argument and dispatches on the tensors' device. CUDA work runs on the
//   current torch stream of the tensors' device.
// - The Autograd kernel of each forward op is a torch::autograd::Function that
//   saves what the backward needs and calls the backward kernel.
// - A non-ok detdit::Status becomes the Python exception of its kind:
//   kType -> TypeError, kValue -> ValueError, kIndex -> IndexError,
//   kRuntime -> RuntimeError, carrying the C++ message unchanged.
// - IndexPlan is the custom class `torch.classes.detdit.IndexPlan`, built once
//   by `detdit::plan` / `detdit::plan_from_rows` and passed to every indexed op.
// - detdit.distributed: a detdit::Communicator whose only transport is a
//   Python callable doing a torch.distributed all-gather of bytes (registered
//   from Python, referred to by an integer handle), the SpPlan custom class,
//   and the tp_adaln_projection / sp_rmsnorm / sp_gate_residual ops.
// The binding does no arithmetic (besides the exact bf16 -> fp32 upcast of a
// linear grad): every bit comes from the detdit library.
// Backward grads are made contiguous (a byte copy) because autograd hands out
// expanded or strided grads and detdit takes contiguous ones.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/version.h>

#include <array>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#ifdef DETDIT_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "detdit/comm.h"
#include "detdit/detdit.h"
#include "detdit/parallel.h"

namespace detdit_torch {

using at::Tensor;
using detdit::DType;
using detdit::ErrorKind;
using detdit::IndexPlan;
using detdit::Numerics;
using detdit::Status;
using detdit::TensorView;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
// c10::optional is its own type in torch 1.x and a deprecated alias of
// std::optional since torch 2.2: name the one this torch's kernels take.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
template <typename T>
using Optional = std::optional<T>;
#else
template <typename T>
using Optional = c10::optional<T>;
#endif
using OptTensor = Optional<Tensor>;
using c10::IValue;

// ---------------------------------------------------------------------------
// Errors, views, devices

// Raise the Python exception of the Status's kind, with its message.
[[noreturn]] void raise(const Status& status) {
  const std::string& message = status.message();
  switch (status.kind()) {
    case ErrorKind::kType:
      C10_THROW_ERROR(TypeError, message);
    case ErrorKind::kValue:
      C10_THROW_ERROR(ValueError, message);
    case ErrorKind::kIndex:
      C10_THROW_ERROR(IndexError, message);
    default:
      C10_THROW_ERROR(Error, message);
  }
}

void check_ok(const Status& status) {
  if (!status.ok()) raise(status);
}

DType dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    default:
      C10_THROW_ERROR(TypeError, std::string(name) + " must be float32, bfloat16, float16, int32 or int64 "
                                                     "(the dtypes detdit takes), got " +
                                     std::string(t.dtype().name()));
  }
}

detdit::Device device_of(const Tensor& t, const char* name) {
  if (t.is_cpu()) return detdit::Device::cpu();
  if (t.is_cuda()) return detdit::Device::cuda(t.get_device());
  C10_THROW_ERROR(ValueError, std::string(name) + " must be a CPU or CUDA tensor, got one on " + t.device().str());
}

// A view of t; an undefined tensor is an absent view.
TensorView view(const Tensor& t, const char* name) {
  TensorView v;
  if (!t.defined()) return v;
  if (t.dim() < 1 || t.dim() > detdit::kMaxRank)
    C10_THROW_ERROR(ValueError, std::string(name) + " must have 1 to " + std::to_string(detdit::kMaxRank) +
                                    " dimensions, got a " + std::to_string(t.dim()) + "-D tensor");
  v.dtype = dtype_of(t, name);
  v.device = device_of(t, name);
  v.data = t.data_ptr();
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  return v;
}

TensorView view(const OptTensor& t, const char* name) { return t.has_value() ? view(*t, name) : TensorView(); }

// Size of dim i of t, or 0 when t lacks that dim: outputs are allocated from
// the inputs' shapes before detdit validates them, so a malformed input gives
// an empty output and detdit's error about the input, never a torch error.
int64_t dim_or_zero(const Tensor& t, int64_t i) {
  if (!t.defined()) return 0;
  if (i < 0) i += t.dim();
  return (i >= 0 && i < t.dim()) ? t.size(i) : 0;
}

// Rows of a (..., H) tensor: the product of every dim but the last.
int64_t leading_rows(const Tensor& t) {
  if (!t.defined() || t.dim() < 2) return 0;
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) rows *= t.size(i);
  return rows;
}

Numerics parse_numerics(const std::string& numerics) {
  if (numerics == "portable") return Numerics::kPortable;
  if (numerics == "torch") return Numerics::kTorch;
  C10_THROW_ERROR(ValueError, "numerics must be 'portable' or 'torch', got '" + numerics + "'");
}

detdit::Activation parse_activation(const std::string& activation) {
  if (activation == "none") return detdit::Activation::kNone;
  if (activation == "silu") return detdit::Activation::kSilu;
  C10_THROW_ERROR(ValueError, "activation must be 'none' or 'silu', got '" + activation + "'");
}

// The device context of a call: on CUDA, the tensor's device is made current
// and the call runs on torch's current stream of that device.
class DeviceScope {
 public:
  explicit DeviceScope(const Tensor& t) {
#ifdef DETDIT_TORCH_CUDA
    if (t.defined() && t.is_cuda()) {
      guard_.emplace(t.device());
      stream_ = c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
    }
#else
    (void)t;
#endif
  }
  detdit::Stream stream() const { return stream_; }

 private:
#ifdef DETDIT_TORCH_CUDA
  Optional<c10::cuda::CUDAGuard> guard_;
#endif
  detdit::Stream stream_ = nullptr;
};

// An output of `shape` and `dtype` on like's device (the CPU for an undefined like).
Tensor empty_like_shape(const Tensor& like, at::IntArrayRef shape, at::ScalarType dtype) {
  return at::empty(shape, at::TensorOptions().dtype(dtype).device(like.defined() ? like.device() : at::Device(at::kCPU)));
}

// An output only when `wanted`, else undefined (absent view).
Tensor maybe_empty(bool wanted, const Tensor& like, at::IntArrayRef shape, at::ScalarType dtype) {
  return wanted ? empty_like_shape(like, shape, dtype) : Tensor();
}

// An output with t's shape, dtype and device when `wanted`; undefined when
// not wanted or when t is (detdit then reports t).
Tensor output_like(const Tensor& t, bool wanted = true) {
  return wanted && t.defined() ? at::empty(t.sizes(), t.options()) : Tensor();
}

// The (rows, cols) of a 2-D tensor, 0 for a dim it lacks (see dim_or_zero).
std::array<int64_t, 2> matrix_shape(const Tensor& t) { return {dim_or_zero(t, 0), dim_or_zero(t, 1)}; }

// ---------------------------------------------------------------------------
// IndexPlan custom class

struct PlanHolder : torch::CustomClassHolder {
  IndexPlan plan;

  explicit PlanHolder(IndexPlan p) : plan(std::move(p)) {}

  int64_t seq_len() const { return plan.seq_len(); }
  int64_t batch() const { return plan.batch(); }
  int64_t num_rows() const { return plan.num_rows(); }
  int64_t positions() const { return plan.positions(); }
  int64_t num_chunks() const { return plan.num_chunks(); }
  int64_t num_segments() const { return plan.num_segments(); }
  std::string device() const { return plan.device().to_string(); }
  // The validated (S,) table row of every sequence position, int32 on the CPU.
  Tensor row_index() const {
    Tensor rows = at::empty({plan.seq_len()}, at::TensorOptions().dtype(at::kInt));
    std::copy_n(plan.host_tables().row_of_seq, plan.seq_len(), rows.data_ptr<int32_t>());
    return rows;
  }

  // The same index with batch 1, for the backward of ops whose output has no
  // batch dim (adaln_row_gather, adaln_modulation: (6, S, H)): autograd hands
  // them a (6, S, H) grad, already summed over the batch by whatever broadcast
  // the output. Built on first use from the plan's validated row index (on
  // CUDA this one build copies the index to the host once).
  const IndexPlan& single_batch(detdit::Stream stream) {
    if (plan.batch() == 1) return plan;
    std::lock_guard<std::mutex> lock(mutex_);
    if (!single_batch_.valid()) {
      TensorView rows = TensorView::contiguous(const_cast<int32_t*>(plan.device_tables().row_of_seq), DType::kI32,
                                               {plan.seq_len()}, plan.device());
      check_ok(IndexPlan::from_row_index(rows, plan.num_rows(), 1, &single_batch_, stream));
    }
    return single_batch_;
  }

 private:
  std::mutex mutex_;
  IndexPlan single_batch_;
};

using PlanPtr = c10::intrusive_ptr<PlanHolder>;
using OptPlan = Optional<PlanPtr>;

const IndexPlan& plan_of(const OptPlan& plan) {
  static const IndexPlan kAbsent;
  return plan.has_value() && *plan ? (*plan)->plan : kAbsent;
}

// A plan argument that the op requires: None is a ValueError naming it.
PlanPtr required_plan(const PlanPtr& plan, const char* op) {
  if (!plan) C10_THROW_ERROR(ValueError, std::string(op) + " needs an IndexPlan (detdit.plan(...)), got None");
  return plan;
}

PlanPtr make_plan(const Tensor& timestep_indices, const Tensor& token_tags, int64_t num_timesteps, int64_t batch) {
  DeviceScope scope(timestep_indices);
  IndexPlan plan;
  check_ok(IndexPlan::from_timesteps_and_tags(view(timestep_indices, "timestep_indices"),
                                              view(token_tags, "token_tags"), num_timesteps, batch, &plan,
                                              scope.stream()));
  return c10::make_intrusive<PlanHolder>(std::move(plan));
}

PlanPtr make_plan_from_rows(const Tensor& row_index, int64_t num_rows, int64_t batch) {
  DeviceScope scope(row_index);
  IndexPlan plan;
  check_ok(IndexPlan::from_row_index(view(row_index, "row_index"), num_rows, batch, &plan, scope.stream()));
  return c10::make_intrusive<PlanHolder>(std::move(plan));
}

// ---------------------------------------------------------------------------
// Kernels (CPU and CUDA alike: detdit dispatches on the tensors' device)
//
// Each kernel allocates its outputs, fills the op's Params (the inputs' views
// before the outputs', so that a bad input is reported before an output
// derived from it) and calls detdit. The ops that detdit.distributed also
// runs sharded (adaln_projection, rmsnorm, gate_residual) do so in one
// <op>_with function that takes the detdit call to make, shared with their
// tp_/sp_ kernels.

// The detdit call of an <op>_with: the op's entry point, or a lambda adding
// the communicator and SpPlan of the tp_/sp_ entry point.
template <typename Params>
using Call = std::function<Status(const Params&, detdit::Stream)>;

// timestep_sinusoid: (T,) -> (T, C) fp32.
// check_range = false: the caller guarantees finite t in [0, 1]; the op then
// never reads the timesteps on the host (no sync: CUDA-graph capturable).
Tensor timestep_sinusoid(const Tensor& timesteps, int64_t num_channels, double max_period,
                         const std::string& numerics, bool check_range) {
  if (num_channels < 1)
    C10_THROW_ERROR(ValueError, "num_channels must be a positive even number, got " + std::to_string(num_channels));
  DeviceScope scope(timesteps);
  Tensor features = empty_like_shape(timesteps, {dim_or_zero(timesteps, 0), num_channels}, at::kFloat);
  detdit::TimestepSinusoidParams p;
  p.in.timesteps = view(timesteps, "timesteps");
  p.features = view(features, "features");
  p.in.max_period = static_cast<float>(max_period);
  p.in.numerics = parse_numerics(numerics);
  p.in.check_range = check_range;
  check_ok(detdit::timestep_sinusoid_forward(p, scope.stream()));
  return features;
}

// d_timesteps (T,) in the timesteps' dtype.
Tensor timestep_sinusoid_backward(const Tensor& grad_features, const Tensor& timesteps, double max_period,
                                  const std::string& numerics, bool check_range) {
  DeviceScope scope(timesteps);
  Tensor d_timesteps = empty_like_shape(timesteps, {dim_or_zero(timesteps, 0)}, timesteps.scalar_type());
  detdit::TimestepSinusoidBackwardParams p;
  p.in.timesteps = view(timesteps, "timesteps");
  p.grad_features = view(grad_features, "grad_features");
  p.d_timesteps = view(d_timesteps, "d_timesteps");
  p.in.max_period = static_cast<float>(max_period);
  p.in.numerics = parse_numerics(numerics);
  p.in.check_range = check_range;
  check_ok(detdit::timestep_sinusoid_backward(p, scope.stream()));
  return d_timesteps;
}

// linear: out (T, N) in x's dtype; pre (T, N) fp32 (x W^T + b before the
// activation) when the activation is silu, else an empty tensor.
std::tuple<Tensor, Tensor> linear(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                  const std::string& activation, const std::string& numerics) {
  DeviceScope scope(x);
  const detdit::Activation act = parse_activation(activation);
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

// (d_x, d_weight, d_bias); grad is upcast to fp32 (exact), through the SiLU
// VJP first when the activation is silu.
std::tuple<Tensor, Tensor, Tensor> linear_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                                                   const Tensor& pre, const std::string& activation,
                                                   const std::string& numerics, std::array<bool, 3> output_mask) {
  DeviceScope scope(x);
  const detdit::Activation act = parse_activation(activation);
  const Numerics profile = parse_numerics(numerics);
  Tensor g = grad.defined() ? grad.to(at::kFloat).contiguous() : grad;
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

// timestep_mlp: (temb (T, D), pre (T, Hm), hidden (T, Hm)), all fp32.
std::tuple<Tensor, Tensor, Tensor> timestep_mlp(const Tensor& features, const Tensor& w1, const Tensor& b1,
                                                const Tensor& w2, const Tensor& b2, const std::string& numerics) {
  DeviceScope scope(features);
  const int64_t rows = dim_or_zero(features, 0), hidden_dim = dim_or_zero(w1, 0);
  Tensor temb = empty_like_shape(features, {rows, dim_or_zero(w2, 0)}, at::kFloat);
  Tensor pre = empty_like_shape(features, {rows, hidden_dim}, at::kFloat);
  Tensor hidden = empty_like_shape(features, {rows, hidden_dim}, at::kFloat);
  detdit::TimestepMlpParams p;
  p.in.features = view(features, "features");
  p.in.w1 = view(w1, "w1");
  p.in.b1 = view(b1, "b1");
  p.in.w2 = view(w2, "w2");
  p.in.b2 = view(b2, "b2");
  p.temb = view(temb, "temb");
  p.pre = view(pre, "pre");
  p.hidden = view(hidden, "hidden");
  p.in.numerics = parse_numerics(numerics);
  check_ok(detdit::timestep_mlp_forward(p, scope.stream()));
  return {temb, pre, hidden};
}

// (d_features, d_w1, d_b1, d_w2, d_b2), fp32.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> timestep_mlp_backward(
    const Tensor& grad_temb, const Tensor& features, const Tensor& w1, const Tensor& w2, const Tensor& pre,
    const Tensor& hidden, const std::string& numerics, std::array<bool, 5> output_mask) {
  DeviceScope scope(features);
  Tensor d_features = maybe_empty(output_mask[0], features, matrix_shape(features), at::kFloat);
  Tensor d_w1 = maybe_empty(output_mask[1], features, matrix_shape(w1), at::kFloat);
  Tensor d_b1 = maybe_empty(output_mask[2], features, {dim_or_zero(w1, 0)}, at::kFloat);
  Tensor d_w2 = maybe_empty(output_mask[3], features, matrix_shape(w2), at::kFloat);
  Tensor d_b2 = maybe_empty(output_mask[4], features, {dim_or_zero(w2, 0)}, at::kFloat);
  detdit::TimestepMlpBackwardParams p;
  p.in.features = view(features, "features");
  p.in.w1 = view(w1, "w1");
  p.in.w2 = view(w2, "w2");
  p.pre = view(pre, "pre");
  p.hidden = view(hidden, "hidden");
  p.grad_temb = view(grad_temb, "grad_temb");
  p.d_features = view(d_features, "d_features");
  p.d_w1 = view(d_w1, "d_w1");
  p.d_b1 = view(d_b1, "d_b1");
  p.d_w2 = view(d_w2, "d_w2");
  p.d_b2 = view(d_b2, "d_b2");
  p.in.numerics = parse_numerics(numerics);
  check_ok(detdit::timestep_mlp_backward(p, scope.stream()));
  return {d_features, d_w1, d_b1, d_w2, d_b2};
}

// adaln_projection and tp_adaln_projection: (table (T, shards * N), act
// (T, D)) in weight's dtype, for an (N, D) weight: tp's table holds every
// rank's shard (shards = the world size), else shards = 1.
std::tuple<Tensor, Tensor> adaln_projection_with(const Call<detdit::AdalnProjectionParams>& call, int64_t shards,
                                                 const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                 const std::string& numerics) {
  DeviceScope scope(temb);
  Tensor table =
      empty_like_shape(temb, {dim_or_zero(temb, 0), shards * dim_or_zero(weight, 0)}, weight.scalar_type());
  Tensor act = empty_like_shape(temb, matrix_shape(temb), weight.scalar_type());
  detdit::AdalnProjectionParams p;
  p.in.temb = view(temb, "temb");
  p.in.weight = view(weight, "weight");
  p.in.bias = view(bias, "bias");
  p.table = view(table, "table");
  p.act = view(act, "act");
  p.in.numerics = parse_numerics(numerics);
  check_ok(call(p, scope.stream()));
  return {table, act};
}

// (d_temb fp32, d_weight, d_bias in weight's dtype).
std::tuple<Tensor, Tensor, Tensor> adaln_projection_backward_with(
    const Call<detdit::AdalnProjectionBackwardParams>& call, const Tensor& grad_table, const Tensor& temb,
    const Tensor& weight, const Tensor& act, const std::string& numerics, std::array<bool, 3> output_mask) {
  DeviceScope scope(temb);
  Tensor d_temb = maybe_empty(output_mask[0], temb, matrix_shape(temb), at::kFloat);
  Tensor d_weight = maybe_empty(output_mask[1], temb, matrix_shape(weight), weight.scalar_type());
  Tensor d_bias = maybe_empty(output_mask[2], temb, {dim_or_zero(weight, 0)}, weight.scalar_type());
  detdit::AdalnProjectionBackwardParams p;
  p.in.temb = view(temb, "temb");
  p.in.weight = view(weight, "weight");
  p.act = view(act, "act");
  p.grad_table = view(grad_table, "grad_table");
  p.d_temb = view(d_temb, "d_temb");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  p.in.numerics = parse_numerics(numerics);
  check_ok(call(p, scope.stream()));
  return {d_temb, d_weight, d_bias};
}

std::tuple<Tensor, Tensor> adaln_projection(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                            const std::string& numerics) {
  return adaln_projection_with(detdit::adaln_projection_forward, 1, temb, weight, bias, numerics);
}

std::tuple<Tensor, Tensor, Tensor> adaln_projection_backward(const Tensor& grad_table, const Tensor& temb,
                                                             const Tensor& weight, const Tensor& act,
                                                             const std::string& numerics,
                                                             std::array<bool, 3> output_mask) {
  return adaln_projection_backward_with(detdit::adaln_projection_backward, grad_table, temb, weight, act, numerics,
                                        output_mask);
}

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

// adaln_row_gather: out (6, S, H) in rows' dtype.
Tensor adaln_row_gather(const Tensor& rows, const PlanPtr& plan) {
  DeviceScope scope(rows);
  const IndexPlan& index = required_plan(plan, "adaln_row_gather")->plan;
  const int64_t hidden = hidden_of(dim_or_zero(rows, 1), detdit::kAdalnChunks, "rows", "(R, 6H)");
  Tensor out = empty_like_shape(rows, {detdit::kAdalnChunks, index.seq_len(), hidden}, rows.scalar_type());
  detdit::AdalnRowGatherParams p;
  p.rows = view(rows, "rows");
  p.plan = index;
  p.out = view(out, "out");
  check_ok(detdit::adaln_row_gather_forward(p, scope.stream()));
  return out;
}

// d_rows (R, 6H) in grad's dtype. grad (6, S, H) (batch summed) or
// (6, B*S, H) / (6, B, S, H) with B = plan.batch().
Tensor adaln_row_gather_backward(const Tensor& grad, const PlanPtr& plan) {
  DeviceScope scope(grad);
  PlanPtr holder = required_plan(plan, "adaln_row_gather_backward");
  Tensor d_rows = empty_like_shape(
      grad, {holder->plan.num_rows(), detdit::kAdalnChunks * dim_or_zero(grad, -1)}, grad.scalar_type());
  detdit::AdalnRowGatherBackwardParams p;
  p.grad = view(grad, "grad");
  p.plan = gather_backward_plan(*holder, grad, scope.stream());
  p.d_rows = view(d_rows, "d_rows");
  check_ok(detdit::adaln_row_gather_backward(p, scope.stream()));
  return d_rows;
}

// rmsnorm and sp_rmsnorm: (out like x, rstd (M,) fp32).
std::tuple<Tensor, Tensor> rmsnorm_with(const Call<detdit::RmsnormParams>& call, const Tensor& x,
                                        const Tensor& weight, const OptTensor& shift, const OptTensor& scale,
                                        const IndexPlan& plan, double eps, const std::string& numerics) {
  DeviceScope scope(x);
  Tensor out = output_like(x);
  Tensor rstd = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  detdit::RmsnormParams p;
  p.in.x = view(x, "x");
  p.in.weight = view(weight, "weight");
  p.in.shift = view(shift, "shift");
  p.in.scale = view(scale, "scale");
  p.in.plan = plan;
  p.out = view(out, "out");
  p.rstd = view(rstd, "rstd");
  p.in.eps = static_cast<float>(eps);
  p.in.numerics = parse_numerics(numerics);
  check_ok(call(p, scope.stream()));
  return {out, rstd};
}

// (dx like x, d_weight in weight's dtype, d_shift / d_scale in the table's
// dtype; none for an absent table).
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_backward_with(
    const Call<detdit::RmsnormBackwardParams>& call, const Tensor& grad, const Tensor& x, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const IndexPlan& plan, const Tensor& rstd, double eps,
    const std::string& numerics, std::array<bool, 4> output_mask) {
  DeviceScope scope(x);
  Tensor dx = output_like(x, output_mask[0]);
  Tensor d_weight = maybe_empty(output_mask[1], x, {dim_or_zero(weight, 0)}, weight.scalar_type());
  auto table_grad = [&](bool wanted, const OptTensor& table) {
    return wanted && table.has_value() ? empty_like_shape(x, matrix_shape(*table), table->scalar_type()) : Tensor();
  };
  Tensor d_shift = table_grad(output_mask[2], shift);
  Tensor d_scale = table_grad(output_mask[3], scale);
  detdit::RmsnormBackwardParams p;
  p.in.x = view(x, "x");
  p.in.weight = view(weight, "weight");
  p.in.shift = view(shift, "shift");
  p.in.scale = view(scale, "scale");
  p.in.plan = plan;
  p.rstd = view(rstd, "rstd");
  p.grad = view(grad, "grad");
  p.dx = view(dx, "dx");
  p.d_weight = view(d_weight, "d_weight");
  p.d_shift = view(d_shift, "d_shift");
  p.d_scale = view(d_scale, "d_scale");
  p.in.eps = static_cast<float>(eps);
  p.in.numerics = parse_numerics(numerics);
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

// gate_residual and sp_gate_residual: out like residual.
Tensor gate_residual_with(const Call<detdit::GateResidualParams>& call, const Tensor& residual, const Tensor& y,
                          const Tensor& gate, const IndexPlan& plan) {
  DeviceScope scope(residual);
  Tensor out = output_like(residual);
  detdit::GateResidualParams p;
  p.in.residual = view(residual, "residual");
  p.in.y = view(y, "y");
  p.in.gate = view(gate, "gate");
  p.in.plan = plan;
  p.out = view(out, "out");
  check_ok(call(p, scope.stream()));
  return out;
}

// (d_residual, d_y like y, d_gate in gate's dtype).
std::tuple<Tensor, Tensor, Tensor> gate_residual_backward_with(const Call<detdit::GateResidualBackwardParams>& call,
                                                               const Tensor& grad, const Tensor& y,
                                                               const Tensor& gate, const IndexPlan& plan,
                                                               std::array<bool, 3> output_mask) {
  DeviceScope scope(y);
  Tensor d_residual = output_like(y, output_mask[0]);
  Tensor d_y = output_like(y, output_mask[1]);
  Tensor d_gate = maybe_empty(output_mask[2], y, matrix_shape(gate), gate.scalar_type());
  detdit::GateResidualBackwardParams p;
  p.grad = view(grad, "grad");
  p.in.y = view(y, "y");
  p.in.gate = view(gate, "gate");
  p.in.plan = plan;
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

// final_adaln_out: (out like x, table (T, 2H), act (T, D) in weight's dtype, rstd (M,) fp32).
std::tuple<Tensor, Tensor, Tensor, Tensor> final_adaln_out(const Tensor& x, const Tensor& norm_weight,
                                                           const Tensor& temb, const Tensor& weight,
                                                           const Tensor& bias, const PlanPtr& plan, double eps,
                                                           const std::string& numerics) {
  DeviceScope scope(x);
  const IndexPlan& index = required_plan(plan, "final_adaln_out")->plan;
  Tensor out = output_like(x);
  Tensor table = empty_like_shape(x, {dim_or_zero(temb, 0), dim_or_zero(weight, 0)}, weight.scalar_type());
  Tensor act = empty_like_shape(x, matrix_shape(temb), weight.scalar_type());
  Tensor rstd = empty_like_shape(x, {leading_rows(x)}, at::kFloat);
  detdit::FinalAdalnOutParams p;
  p.in.x = view(x, "x");
  p.in.norm_weight = view(norm_weight, "norm_weight");
  p.in.temb = view(temb, "temb");
  p.in.weight = view(weight, "weight");
  p.in.bias = view(bias, "bias");
  p.in.plan = index;
  p.out = view(out, "out");
  p.table = view(table, "table");
  p.act = view(act, "act");
  p.rstd = view(rstd, "rstd");
  p.in.eps = static_cast<float>(eps);
  p.in.numerics = parse_numerics(numerics);
  check_ok(detdit::final_adaln_out_forward(p, scope.stream()));
  return {out, table, act, rstd};
}

// (dx like x, d_norm_weight, d_temb fp32, d_weight, d_bias in weight's dtype).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> final_adaln_out_backward(
    const Tensor& grad, const Tensor& x, const Tensor& norm_weight, const Tensor& temb, const Tensor& weight,
    const Tensor& table, const Tensor& act, const Tensor& rstd, const PlanPtr& plan, double eps,
    const std::string& numerics, std::array<bool, 5> output_mask) {
  DeviceScope scope(x);
  const IndexPlan& index = required_plan(plan, "final_adaln_out_backward")->plan;
  Tensor dx = output_like(x, output_mask[0]);
  Tensor d_norm_weight = maybe_empty(output_mask[1], x, {dim_or_zero(norm_weight, 0)}, norm_weight.scalar_type());
  Tensor d_temb = maybe_empty(output_mask[2], x, matrix_shape(temb), at::kFloat);
  Tensor d_weight = maybe_empty(output_mask[3], x, matrix_shape(weight), weight.scalar_type());
  Tensor d_bias = maybe_empty(output_mask[4], x, {dim_or_zero(weight, 0)}, weight.scalar_type());
  detdit::FinalAdalnOutBackwardParams p;
  p.in.x = view(x, "x");
  p.in.norm_weight = view(norm_weight, "norm_weight");
  p.in.temb = view(temb, "temb");
  p.in.weight = view(weight, "weight");
  p.table = view(table, "table");
  p.act = view(act, "act");
  p.rstd = view(rstd, "rstd");
  p.in.plan = index;
  p.grad = view(grad, "grad");
  p.dx = view(dx, "dx");
  p.d_norm_weight = view(d_norm_weight, "d_norm_weight");
  p.d_temb = view(d_temb, "d_temb");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  p.in.eps = static_cast<float>(eps);
  p.in.numerics = parse_numerics(numerics);
  check_ok(detdit::final_adaln_out_backward(p, scope.stream()));
  return {dx, d_norm_weight, d_temb, d_weight, d_bias};
}

// adaln_modulation: (out (6, S, H), table (T, 18H), act (T, D)), weight's dtype.
std::tuple<Tensor, Tensor, Tensor> adaln_modulation(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                    const PlanPtr& plan, const std::string& numerics) {
  DeviceScope scope(temb);
  const IndexPlan& index = required_plan(plan, "adaln_modulation")->plan;
  const int64_t outputs = dim_or_zero(weight, 0);
  const int64_t hidden = hidden_of(outputs, detdit::kNumModalities * detdit::kAdalnChunks, "weight", "(18H, D)");
  Tensor out = empty_like_shape(temb, {detdit::kAdalnChunks, index.seq_len(), hidden}, weight.scalar_type());
  Tensor table = empty_like_shape(temb, {dim_or_zero(temb, 0), outputs}, weight.scalar_type());
  Tensor act = empty_like_shape(temb, matrix_shape(temb), weight.scalar_type());
  detdit::AdalnModulationParams p;
  p.in.temb = view(temb, "temb");
  p.in.weight = view(weight, "weight");
  p.in.bias = view(bias, "bias");
  p.in.plan = index;
  p.table = view(table, "table");
  p.act = view(act, "act");
  p.out = view(out, "out");
  p.in.numerics = parse_numerics(numerics);
  check_ok(detdit::adaln_modulation_forward(p, scope.stream()));
  return {out, table, act};
}

// (d_temb fp32, d_weight, d_bias in weight's dtype); grad as in
// adaln_row_gather_backward.
std::tuple<Tensor, Tensor, Tensor> adaln_modulation_backward(const Tensor& grad, const Tensor& temb,
                                                             const Tensor& weight, const Tensor& act,
                                                             const PlanPtr& plan, const std::string& numerics,
                                                             std::array<bool, 3> output_mask) {
  DeviceScope scope(temb);
  PlanPtr holder = required_plan(plan, "adaln_modulation_backward");
  Tensor d_temb = maybe_empty(output_mask[0], temb, matrix_shape(temb), at::kFloat);
  Tensor d_weight = maybe_empty(output_mask[1], temb, matrix_shape(weight), weight.scalar_type());
  Tensor d_bias = maybe_empty(output_mask[2], temb, {dim_or_zero(weight, 0)}, weight.scalar_type());
  detdit::AdalnModulationBackwardParams p;
  p.in.temb = view(temb, "temb");
  p.in.weight = view(weight, "weight");
  p.act = view(act, "act");
  p.in.plan = gather_backward_plan(*holder, grad, scope.stream());
  p.grad = view(grad, "grad");
  p.d_temb = view(d_temb, "d_temb");
  p.d_weight = view(d_weight, "d_weight");
  p.d_bias = view(d_bias, "d_bias");
  p.in.numerics = parse_numerics(numerics);
  check_ok(detdit::adaln_modulation_backward(p, scope.stream()));
  return {d_temb, d_weight, d_bias};
}

// ---------------------------------------------------------------------------
// Autograd: one Function per op. Each saves what its backward kernel reads
// and returns one grad per forward argument (undefined for non-tensors and
// for inputs that do not require grad).

// Backward grads arrive expanded or strided; detdit takes contiguous ones.
Tensor contiguous_grad(const Tensor& grad) { return grad.defined() ? grad.contiguous() : grad; }

bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
bool requires_grad(const OptTensor& t) { return t.has_value() && requires_grad(*t); }

// detdit's backward kernels are not differentiable: a double backward
// (create_graph=True) fails instead of treating first-order grads as constants.
void check_first_order() {
  if (at::GradMode::is_enabled())
    C10_THROW_ERROR(Error, "detdit ops support first-order gradients only: backward with create_graph=True "
                           "(double backward) is not implemented");
}

// The backward's output mask: which of the forward's tensor inputs require grad.
void save_needs(AutogradContext* ctx, std::initializer_list<bool> needs) {
  ctx->saved_data["needs"] = c10::List<bool>(needs);
}

template <size_t N>
std::array<bool, N> saved_needs(AutogradContext* ctx) {
  const c10::List<bool> needs = ctx->saved_data["needs"].toBoolList();
  std::array<bool, N> mask{};
  for (size_t i = 0; i < N; ++i) mask[i] = needs.get(i);
  return mask;
}

// An optional input saved as a tensor (undefined when absent), restored.
OptTensor saved_optional(const Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); }

PlanPtr saved_plan(AutogradContext* ctx) { return ctx->saved_data["plan"].toCustomClass<PlanHolder>(); }

IValue plan_ivalue(const OptPlan& plan) { return plan.has_value() ? IValue(*plan) : IValue(); }
OptPlan plan_from_ivalue(const IValue& value) {
  if (value.isNone()) return OptPlan();
  return value.toCustomClass<PlanHolder>();
}

struct TimestepSinusoidFunction : torch::autograd::Function<TimestepSinusoidFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& timesteps, int64_t num_channels, double max_period,
                        const std::string& numerics, bool check_range) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({timesteps});
    ctx->saved_data["max_period"] = max_period;
    ctx->saved_data["numerics"] = numerics;
    ctx->saved_data["check_range"] = check_range;
    return timestep_sinusoid(timesteps, num_channels, max_period, numerics, check_range);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    const Tensor timesteps = ctx->get_saved_variables()[0];
    Tensor d_t = timestep_sinusoid_backward(contiguous_grad(grads[0]), timesteps,
                                            ctx->saved_data["max_period"].toDouble(),
                                            ctx->saved_data["numerics"].toStringRef(),
                                            ctx->saved_data["check_range"].toBool());
    return {d_t, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               const std::string& activation, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, pre] = linear(x, weight, bias, activation, numerics);
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
        linear_backward(grads[0], s[0], s[1], s[2], ctx->saved_data["activation"].toStringRef(),
                        ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx));
    return {d_x, d_weight, d_bias, Tensor(), Tensor()};
  }
};

struct TimestepMlpFunction : torch::autograd::Function<TimestepMlpFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& features, const Tensor& w1, const Tensor& b1,
                               const Tensor& w2, const Tensor& b2, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [temb, pre, hidden] = timestep_mlp(features, w1, b1, w2, b2, numerics);
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
        timestep_mlp_backward(contiguous_grad(grads[0]), s[0], s[1], s[2], s[3], s[4],
                              ctx->saved_data["numerics"].toStringRef(), saved_needs<5>(ctx));
    return {d_f, d_w1, d_b1, d_w2, d_b2, Tensor()};
  }
};

struct AdalnProjectionFunction : torch::autograd::Function<AdalnProjectionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& temb, const Tensor& weight, const Tensor& bias,
                               const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [table, act] = adaln_projection(temb, weight, bias, numerics);
    ctx->save_for_backward({temb, weight, act});
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(temb), requires_grad(weight), requires_grad(bias)});
    ctx->mark_non_differentiable({act});
    return {table, act};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_temb, d_weight, d_bias] = adaln_projection_backward(
        contiguous_grad(grads[0]), s[0], s[1], s[2], ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx));
    return {d_temb, d_weight, d_bias, Tensor()};
  }
};

struct AdalnRowGatherFunction : torch::autograd::Function<AdalnRowGatherFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& rows, const PlanPtr& plan) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["plan"] = plan;
    return adaln_row_gather(rows, plan);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    return {adaln_row_gather_backward(contiguous_grad(grads[0]), saved_plan(ctx)), Tensor()};
  }
};

struct RmsnormFunction : torch::autograd::Function<RmsnormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& shift,
                               const OptTensor& scale, const OptPlan& plan, double eps,
                               const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = rmsnorm(x, weight, shift, scale, plan, eps, numerics);
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
    auto [dx, d_weight, d_shift, d_scale] = rmsnorm_backward(
        contiguous_grad(grads[0]), s[0], s[1], saved_optional(s[2]), saved_optional(s[3]),
        plan_from_ivalue(ctx->saved_data["plan"]), s[4], ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["numerics"].toStringRef(), saved_needs<4>(ctx));
    return {dx, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor()};
  }
};

struct GateResidualFunction : torch::autograd::Function<GateResidualFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const Tensor& gate,
                        const PlanPtr& plan) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = gate_residual(residual, y, gate, plan);
    ctx->save_for_backward({y, gate});
    ctx->saved_data["plan"] = plan;
    save_needs(ctx, {requires_grad(residual), requires_grad(y), requires_grad(gate)});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_residual, d_y, d_gate] =
        gate_residual_backward(contiguous_grad(grads[0]), s[0], s[1], saved_plan(ctx), saved_needs<3>(ctx));
    return {d_residual, d_y, d_gate, Tensor()};
  }
};

struct FinalAdalnOutFunction : torch::autograd::Function<FinalAdalnOutFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& norm_weight, const Tensor& temb,
                               const Tensor& weight, const Tensor& bias, const PlanPtr& plan, double eps,
                               const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, table, act, rstd] = final_adaln_out(x, norm_weight, temb, weight, bias, plan, eps, numerics);
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
    auto [dx, d_norm_weight, d_temb, d_weight, d_bias] = final_adaln_out_backward(
        contiguous_grad(grads[0]), s[0], s[1], s[2], s[3], s[4], s[5], s[6], saved_plan(ctx),
        ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef(), saved_needs<5>(ctx));
    return {dx, d_norm_weight, d_temb, d_weight, d_bias, Tensor(), Tensor(), Tensor()};
  }
};

struct AdalnModulationFunction : torch::autograd::Function<AdalnModulationFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& temb, const Tensor& weight, const Tensor& bias,
                               const PlanPtr& plan, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, table, act] = adaln_modulation(temb, weight, bias, plan, numerics);
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
        adaln_modulation_backward(contiguous_grad(grads[0]), s[0], s[1], s[2], saved_plan(ctx),
                                  ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx));
    return {d_temb, d_weight, d_bias, Tensor(), Tensor()};
  }
};

// Autograd kernels: same signatures as the forward kernels.
Tensor timestep_sinusoid_autograd(const Tensor& timesteps, int64_t num_channels, double max_period,
                                  const std::string& numerics, bool check_range) {
  return TimestepSinusoidFunction::apply(timesteps, num_channels, max_period, numerics, check_range);
}
std::tuple<Tensor, Tensor> linear_autograd(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                           const std::string& activation, const std::string& numerics) {
  auto out = LinearFunction::apply(x, weight, bias, activation, numerics);
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor, Tensor> timestep_mlp_autograd(const Tensor& features, const Tensor& w1, const Tensor& b1,
                                                         const Tensor& w2, const Tensor& b2,
                                                         const std::string& numerics) {
  auto out = TimestepMlpFunction::apply(features, w1, b1, w2, b2, numerics);
  return {out[0], out[1], out[2]};
}
std::tuple<Tensor, Tensor> adaln_projection_autograd(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                                     const std::string& numerics) {
  auto out = AdalnProjectionFunction::apply(temb, weight, bias, numerics);
  return {out[0], out[1]};
}
Tensor adaln_row_gather_autograd(const Tensor& rows, const PlanPtr& plan) {
  return AdalnRowGatherFunction::apply(rows, plan);
}
std::tuple<Tensor, Tensor> rmsnorm_autograd(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                            const OptTensor& scale, const OptPlan& plan, double eps,
                                            const std::string& numerics) {
  auto out = RmsnormFunction::apply(x, weight, shift, scale, plan, eps, numerics);
  return {out[0], out[1]};
}
Tensor gate_residual_autograd(const Tensor& residual, const Tensor& y, const Tensor& gate, const PlanPtr& plan) {
  return GateResidualFunction::apply(residual, y, gate, plan);
}
std::tuple<Tensor, Tensor, Tensor, Tensor> final_adaln_out_autograd(const Tensor& x, const Tensor& norm_weight,
                                                                    const Tensor& temb, const Tensor& weight,
                                                                    const Tensor& bias, const PlanPtr& plan,
                                                                    double eps, const std::string& numerics) {
  auto out = FinalAdalnOutFunction::apply(x, norm_weight, temb, weight, bias, plan, eps, numerics);
  return {out[0], out[1], out[2], out[3]};
}
std::tuple<Tensor, Tensor, Tensor> adaln_modulation_autograd(const Tensor& temb, const Tensor& weight,
                                                             const Tensor& bias, const PlanPtr& plan,
                                                             const std::string& numerics) {
  auto out = AdalnModulationFunction::apply(temb, weight, bias, plan, numerics);
  return {out[0], out[1], out[2]};
}

// ---------------------------------------------------------------------------
// detdit.distributed: a Communicator over torch.distributed

// Ranks over a torch.distributed group. The transport is a Python callable
// gather(send, recv) that all-gathers the uint8 tensor `send` into `recv`
// (world * send.numel() bytes, rank-ordered); it is the only thing that moves
// bytes, and it never reduces. On top of it, as comm.h requires, every
// all_gather first exchanges a fixed-size header {call number, bytes, dtype}
// so that mismatched calls fail with the same ValueError on every rank, and
// agree() exchanges each rank's validation Status.
class TorchDistCommunicator : public detdit::Communicator {
 public:
  TorchDistCommunicator(PyObject* gather, int rank, int world, detdit::Device device)
      : gather_(gather), rank_(rank), world_(world), device_(device) {
    Py_INCREF(gather_);
  }
  ~TorchDistCommunicator() override {
    // A communicator still registered at exit dies after the interpreter:
    // its callable is gone with it and must not be touched.
    if (!Py_IsInitialized()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(gather_);
    PyGILState_Release(gil);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  detdit::Device device() const override { return device_; }
  const char* backend_id() const override { return "torch.distributed"; }

  Status all_gather(const void* send, std::size_t bytes, void* recv, DType dtype, detdit::Stream) override {
    const Header mine{call_++, static_cast<int64_t>(bytes), static_cast<int64_t>(dtype)};
    std::vector<Header> all(static_cast<std::size_t>(world_));
    DETDIT_RETURN_IF_ERROR(transport(&mine, sizeof(Header), all.data(), /*host=*/true));
    for (int r = 0; r < world_; ++r) {
      const Header& h = all[static_cast<std::size_t>(r)];
      if (h.call != all[0].call || h.bytes != all[0].bytes || h.dtype != all[0].dtype)
        return Status::value_error("mismatched all_gather calls across ranks: rank 0 sent call " +
                                   std::to_string(all[0].call) + " with " + std::to_string(all[0].bytes) + " bytes of " +
                                   detdit::dtype_name(static_cast<DType>(all[0].dtype)) + ", rank " + std::to_string(r) +
                                   " call " + std::to_string(h.call) + " with " + std::to_string(h.bytes) + " bytes of " +
                                   detdit::dtype_name(static_cast<DType>(h.dtype)));
    }
    if (bytes % detdit::dtype_size(dtype) != 0)
      return Status::value_error("all_gather of " + std::to_string(bytes) + " bytes is not a whole number of " +
                                 detdit::dtype_name(dtype) + " elements");
    return transport(send, bytes, recv, device_.kind == detdit::DeviceKind::kCpu);
  }

  // Both forms of comm.h's validation handshake are defined without
  // `override`, so this compiles against either Communicator interface
  // (agree(local) alone, or agree(local, signature) plus a forwarding agree(local)).
  Status agree(const Status& local) { return agree(local, std::string()); }
  Status agree(const Status& local, const std::string& signature) {
    Verdict mine{};
    mine.kind = static_cast<int32_t>(local.kind());
    mine.signature_hash = std::hash<std::string>()(signature);
    std::strncpy(mine.message, local.message().c_str(), sizeof(mine.message) - 1);
    std::strncpy(mine.signature, signature.c_str(), sizeof(mine.signature) - 1);
    std::vector<Verdict> all(static_cast<std::size_t>(world_));
    DETDIT_RETURN_IF_ERROR(transport(&mine, sizeof(Verdict), all.data(), /*host=*/true));
    if (!local.ok()) return local;
    for (int r = 0; r < world_; ++r) {
      const Verdict& v = all[static_cast<std::size_t>(r)];
      if (v.kind != 0)
        return Status(static_cast<ErrorKind>(v.kind), "rank " + std::to_string(r) + " failed: " + v.message);
    }
    for (int r = 1; r < world_; ++r) {
      const Verdict& v = all[static_cast<std::size_t>(r)];
      if (v.signature_hash != all[0].signature_hash)
        return Status::value_error("ranks disagree on the call: rank 0 calls '" + std::string(all[0].signature) +
                                   "', rank " + std::to_string(r) + " calls '" + v.signature + "'");
    }
    return Status();
  }

 private:
  struct Header {
    int64_t call, bytes, dtype;
  };
  struct Verdict {
    int32_t kind;
    uint64_t signature_hash;  // of the whole signature; the text below may be cut
    char message[1024];
    char signature[512];
  };

  // Calls gather(send, recv) under the GIL; a Python exception becomes a RuntimeError.
  Status transport(const void* send, std::size_t bytes, void* recv, bool host) {
    if (bytes == 0) return Status();
    const at::Device where = host ? at::Device(at::kCPU) : at::Device(at::kCUDA, device_.index);
    const auto options = at::TensorOptions().dtype(at::kByte).device(where);
    Tensor send_t = at::from_blob(const_cast<void*>(send), {static_cast<int64_t>(bytes)}, options);
    Tensor recv_t = at::from_blob(recv, {static_cast<int64_t>(bytes) * world_}, options);
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* py_send = THPVariable_Wrap(send_t);
    PyObject* py_recv = THPVariable_Wrap(recv_t);
    PyObject* result = PyObject_CallFunctionObjArgs(gather_, py_send, py_recv, nullptr);
    Py_XDECREF(py_send);
    Py_XDECREF(py_recv);
    Status status;
    if (result == nullptr) {
      std::string message = "the torch.distributed all-gather failed";
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);
      if (value != nullptr) {
        PyObject* text = PyObject_Str(value);
        if (text != nullptr && PyUnicode_Check(text)) message += std::string(": ") + PyUnicode_AsUTF8(text);
        Py_XDECREF(text);
      }
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(traceback);
      status = Status::runtime_error(message);
    }
    Py_XDECREF(result);
    PyGILState_Release(gil);
    return status;
  }

  PyObject* gather_;
  int rank_, world_;
  detdit::Device device_;
  int64_t call_ = 0;
};

// Communicators by handle: Python registers one per group and passes the
// handle to the ops (a schema cannot carry a Python callable).
std::mutex communicators_mutex;
std::map<int64_t, std::shared_ptr<detdit::Communicator>> communicators;
int64_t next_communicator = 1;

std::shared_ptr<detdit::Communicator> communicator(int64_t handle) {
  std::lock_guard<std::mutex> lock(communicators_mutex);
  auto found = communicators.find(handle);
  if (found == communicators.end())
    C10_THROW_ERROR(ValueError, "communicator handle " + std::to_string(handle) +
                                    " is not registered (use detdit.distributed.Communicator(group))");
  return found->second;
}

struct SpPlanHolder : torch::CustomClassHolder {
  detdit::SpPlan sp;
  explicit SpPlanHolder(detdit::SpPlan s) : sp(std::move(s)) {}
  int64_t world() const { return sp.world(); }
  int64_t rank() const { return sp.rank(); }
  int64_t local_begin() const { return sp.local_begin(); }
  int64_t local_end() const { return sp.local_end(); }
  int64_t local_seq_len() const { return sp.local_seq_len(); }
  int64_t max_send() const { return sp.max_send(); }
};
using SpPlanPtr = c10::intrusive_ptr<SpPlanHolder>;

SpPlanPtr make_sp_plan(const PlanPtr& plan, int64_t world, int64_t rank) {
  const IndexPlan& index = required_plan(plan, "sp_plan")->plan;
  detdit::Stream stream = nullptr;
#ifdef DETDIT_TORCH_CUDA
  if (index.device().is_cuda()) stream = c10::cuda::getCurrentCUDAStream(index.device().index).stream();
#endif
  detdit::SpPlan sp;
  check_ok(detdit::SpPlan::create(index, static_cast<int>(world), static_cast<int>(rank), &sp, stream));
  return c10::make_intrusive<SpPlanHolder>(std::move(sp));
}


// tp_adaln_projection: (table (T, N) full, act (T, D)); weight/bias are this rank's shard.
std::tuple<Tensor, Tensor> tp_adaln_projection(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                               int64_t comm, const std::string& numerics) {
  auto group = communicator(comm);
  auto call = [&](const detdit::AdalnProjectionParams& p, detdit::Stream stream) {
    return detdit::tp_adaln_projection_forward(*group, p, stream);
  };
  return adaln_projection_with(call, group->world_size(), temb, weight, bias, numerics);
}

// (d_temb fp32 replicated, d_weight, d_bias of the shard).
std::tuple<Tensor, Tensor, Tensor> tp_adaln_projection_backward(const Tensor& grad_table, const Tensor& temb,
                                                                const Tensor& weight, const Tensor& act,
                                                                int64_t comm, const std::string& numerics,
                                                                std::array<bool, 3> output_mask) {
  auto group = communicator(comm);
  auto call = [&](const detdit::AdalnProjectionBackwardParams& p, detdit::Stream stream) {
    return detdit::tp_adaln_projection_backward(*group, p, stream);
  };
  // every rank takes part in the collectives, so d_temb is always computed
  auto [d_temb, d_weight, d_bias] = adaln_projection_backward_with(call, grad_table, temb, weight, act, numerics,
                                                                   {true, output_mask[1], output_mask[2]});
  return {output_mask[0] ? d_temb : Tensor(), d_weight, d_bias};
}

// sp_rmsnorm: the local rows (B, S_local, H); (out, rstd).
std::tuple<Tensor, Tensor> sp_rmsnorm(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                      const OptTensor& scale, const SpPlanPtr& sp, double eps,
                                      const std::string& numerics) {
  auto call = [&](const detdit::RmsnormParams& p, detdit::Stream stream) {
    return detdit::sp_rmsnorm_forward(sp->sp, p, stream);
  };
  return rmsnorm_with(call, x, weight, shift, scale, sp->sp.global_plan(), eps, numerics);
}

// (dx local, d_weight, d_shift, d_scale replicated). The collectives need every
// replicated output on every rank, so they are always computed.
std::tuple<Tensor, Tensor, Tensor, Tensor> sp_rmsnorm_backward(const Tensor& grad, const Tensor& x,
                                                               const Tensor& weight, const OptTensor& shift,
                                                               const OptTensor& scale, const SpPlanPtr& sp,
                                                               const Tensor& rstd, int64_t comm, double eps,
                                                               const std::string& numerics) {
  auto group = communicator(comm);
  auto call = [&](const detdit::RmsnormBackwardParams& p, detdit::Stream stream) {
    return detdit::sp_rmsnorm_backward(*group, sp->sp, p, stream);
  };
  return rmsnorm_backward_with(call, grad, x, weight, shift, scale, sp->sp.global_plan(), rstd, eps, numerics,
                               {true, true, true, true});
}

Tensor sp_gate_residual(const Tensor& residual, const Tensor& y, const Tensor& gate, const SpPlanPtr& sp) {
  auto call = [&](const detdit::GateResidualParams& p, detdit::Stream stream) {
    return detdit::sp_gate_residual_forward(sp->sp, p, stream);
  };
  return gate_residual_with(call, residual, y, gate, sp->sp.global_plan());
}

// (d_residual, d_y local, d_gate replicated), always computed (as sp_rmsnorm_backward).
std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_backward(const Tensor& grad, const Tensor& y, const Tensor& gate,
                                                             const SpPlanPtr& sp, int64_t comm) {
  auto group = communicator(comm);
  auto call = [&](const detdit::GateResidualBackwardParams& p, detdit::Stream stream) {
    return detdit::sp_gate_residual_backward(*group, sp->sp, p, stream);
  };
  return gate_residual_backward_with(call, grad, y, gate, sp->sp.global_plan(), {true, true, true});
}

struct TpAdalnProjectionFunction : torch::autograd::Function<TpAdalnProjectionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& temb, const Tensor& weight, const Tensor& bias,
                               int64_t comm, const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [table, act] = tp_adaln_projection(temb, weight, bias, comm, numerics);
    ctx->save_for_backward({temb, weight, act});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["numerics"] = numerics;
    save_needs(ctx, {requires_grad(temb), requires_grad(weight), requires_grad(bias)});
    ctx->mark_non_differentiable({act});
    return {table, act};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_temb, d_weight, d_bias] = tp_adaln_projection_backward(
        contiguous_grad(grads[0]), s[0], s[1], s[2], ctx->saved_data["comm"].toInt(),
        ctx->saved_data["numerics"].toStringRef(), saved_needs<3>(ctx));
    return {d_temb, d_weight, d_bias, Tensor(), Tensor()};
  }
};

SpPlanPtr saved_sp(AutogradContext* ctx) { return ctx->saved_data["sp"].toCustomClass<SpPlanHolder>(); }

struct SpRmsnormFunction : torch::autograd::Function<SpRmsnormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& shift,
                               const OptTensor& scale, const SpPlanPtr& sp, int64_t comm, double eps,
                               const std::string& numerics) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = sp_rmsnorm(x, weight, shift, scale, sp, eps, numerics);
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
    auto [dx, d_weight, d_shift, d_scale] = sp_rmsnorm_backward(
        contiguous_grad(grads[0]), s[0], s[1], saved_optional(s[2]), saved_optional(s[3]), saved_sp(ctx), s[4],
        ctx->saved_data["comm"].toInt(), ctx->saved_data["eps"].toDouble(), ctx->saved_data["numerics"].toStringRef());
    return {dx, d_weight, d_shift, d_scale, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct SpGateResidualFunction : torch::autograd::Function<SpGateResidualFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& residual, const Tensor& y, const Tensor& gate,
                        const SpPlanPtr& sp, int64_t comm) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = sp_gate_residual(residual, y, gate, sp);
    ctx->save_for_backward({y, gate});
    ctx->saved_data["sp"] = sp;
    ctx->saved_data["comm"] = comm;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order();
    auto s = ctx->get_saved_variables();
    auto [d_residual, d_y, d_gate] = sp_gate_residual_backward(contiguous_grad(grads[0]), s[0], s[1], saved_sp(ctx),
                                                               ctx->saved_data["comm"].toInt());
    return {d_residual, d_y, d_gate, Tensor(), Tensor()};
  }
};
std::tuple<Tensor, Tensor> tp_adaln_projection_autograd(const Tensor& temb, const Tensor& weight,
                                                        const Tensor& bias, int64_t comm,
                                                        const std::string& numerics) {
  auto out = TpAdalnProjectionFunction::apply(temb, weight, bias, comm, numerics);
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor> sp_rmsnorm_autograd(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                               const OptTensor& scale, const SpPlanPtr& sp, int64_t comm,
                                               double eps, const std::string& numerics) {
  auto out = SpRmsnormFunction::apply(x, weight, shift, scale, sp, comm, eps, numerics);
  return {out[0], out[1]};
}
// The forward kernel has no use for the communicator (no communication).
std::tuple<Tensor, Tensor> sp_rmsnorm_kernel(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                             const OptTensor& scale, const SpPlanPtr& sp, int64_t,
                                             double eps, const std::string& numerics) {
  return sp_rmsnorm(x, weight, shift, scale, sp, eps, numerics);
}
Tensor sp_gate_residual_autograd(const Tensor& residual, const Tensor& y, const Tensor& gate, const SpPlanPtr& sp,
                                 int64_t comm) {
  return SpGateResidualFunction::apply(residual, y, gate, sp, comm);
}
Tensor sp_gate_residual_kernel(const Tensor& residual, const Tensor& y, const Tensor& gate, const SpPlanPtr& sp,
                               int64_t) {
  return sp_gate_residual(residual, y, gate, sp);
}

// Python: _C._register_communicator(gather, rank, world, device) -> handle.
PyObject* register_communicator(PyObject*, PyObject* args) {
  PyObject* gather;
  int rank, world;
  const char* device;
  if (!PyArg_ParseTuple(args, "Oiis", &gather, &rank, &world, &device)) return nullptr;
  if (!PyCallable_Check(gather)) {
    PyErr_SetString(PyExc_TypeError, "gather must be callable");
    return nullptr;
  }
  if (world < 1 || rank < 0 || rank >= world) {
    PyErr_Format(PyExc_ValueError, "need 0 <= rank < world, got rank=%d, world=%d", rank, world);
    return nullptr;
  }
  const std::string where(device);
  detdit::Device dev = detdit::Device::cpu();
  if (where.rfind("cuda", 0) == 0) {
    dev = detdit::Device::cuda(where.size() > 5 ? std::stoi(where.substr(5)) : 0);
  } else if (where != "cpu") {
    PyErr_Format(PyExc_ValueError, "device must be 'cpu' or 'cuda:N', got '%s'", device);
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(communicators_mutex);
  const int64_t handle = next_communicator++;
  communicators[handle] = std::make_shared<TorchDistCommunicator>(gather, rank, world, dev);
  return PyLong_FromLongLong(handle);
}

// Python: _C._release_communicator(handle). Ops that captured it keep it alive.
PyObject* release_communicator(PyObject*, PyObject* args) {
  long long handle;
  if (!PyArg_ParseTuple(args, "L", &handle)) return nullptr;
  std::shared_ptr<detdit::Communicator> released;
  {
    std::lock_guard<std::mutex> lock(communicators_mutex);
    auto found = communicators.find(handle);
    if (found != communicators.end()) {
      released = std::move(found->second);
      communicators.erase(found);
    }
  }
  Py_RETURN_NONE;
}

}  // namespace detdit_torch

// ---------------------------------------------------------------------------
// Registration

#define DETDIT_PLAN "__torch__.torch.classes.detdit.IndexPlan"
#define DETDIT_SP_PLAN "__torch__.torch.classes.detdit.SpPlan"

TORCH_LIBRARY(detdit, m) {
  using detdit_torch::PlanHolder;
  m.class_<PlanHolder>("IndexPlan")
      .def("seq_len", &PlanHolder::seq_len)
      .def("batch", &PlanHolder::batch)
      .def("num_rows", &PlanHolder::num_rows)
      .def("positions", &PlanHolder::positions)
      .def("num_chunks", &PlanHolder::num_chunks)
      .def("num_segments", &PlanHolder::num_segments)
      .def("device", &PlanHolder::device)
      .def("row_index", &PlanHolder::row_index);
  m.class_<detdit_torch::SpPlanHolder>("SpPlan")
      .def("world", &detdit_torch::SpPlanHolder::world)
      .def("rank", &detdit_torch::SpPlanHolder::rank)
      .def("local_begin", &detdit_torch::SpPlanHolder::local_begin)
      .def("local_end", &detdit_torch::SpPlanHolder::local_end)
      .def("local_seq_len", &detdit_torch::SpPlanHolder::local_seq_len)
      .def("max_send", &detdit_torch::SpPlanHolder::max_send);
  m.def("plan(Tensor timestep_indices, Tensor token_tags, int num_timesteps, int batch) -> " DETDIT_PLAN,
        &detdit_torch::make_plan);
  m.def("plan_from_rows(Tensor row_index, int num_rows, int batch) -> " DETDIT_PLAN,
        &detdit_torch::make_plan_from_rows);

  m.def("timestep_sinusoid(Tensor timesteps, int num_channels, float max_period, str numerics, "
        "bool check_range=True) -> Tensor");
  m.def("timestep_sinusoid_backward(Tensor grad_features, Tensor timesteps, float max_period, str numerics, "
        "bool check_range=True) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, str activation, str numerics) -> (Tensor, Tensor)");
  m.def("linear_backward(Tensor grad, Tensor x, Tensor weight, Tensor pre, str activation, str numerics, "
        "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def("timestep_mlp(Tensor features, Tensor w1, Tensor b1, Tensor w2, Tensor b2, str numerics) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("timestep_mlp_backward(Tensor grad_temb, Tensor features, Tensor w1, Tensor w2, Tensor pre, "
        "Tensor hidden, str numerics, bool[5] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("adaln_projection(Tensor temb, Tensor weight, Tensor bias, str numerics) -> (Tensor, Tensor)");
  m.def("adaln_projection_backward(Tensor grad_table, Tensor temb, Tensor weight, Tensor act, str numerics, "
        "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def("adaln_row_gather(Tensor rows, " DETDIT_PLAN " plan) -> Tensor");
  m.def("adaln_row_gather_backward(Tensor grad, " DETDIT_PLAN " plan) -> Tensor");
  m.def("rmsnorm(Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_PLAN
        "? plan, float eps, str numerics) -> (Tensor, Tensor)");
  m.def("rmsnorm_backward(Tensor grad, Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_PLAN
        "? plan, Tensor rstd, float eps, str numerics, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gate_residual(Tensor residual, Tensor y, Tensor gate, " DETDIT_PLAN " plan) -> Tensor");
  m.def("gate_residual_backward(Tensor grad, Tensor y, Tensor gate, " DETDIT_PLAN
        " plan, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def("final_adaln_out(Tensor x, Tensor norm_weight, Tensor temb, Tensor weight, Tensor bias, " DETDIT_PLAN
        " plan, float eps, str numerics) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("final_adaln_out_backward(Tensor grad, Tensor x, Tensor norm_weight, Tensor temb, Tensor weight, "
        "Tensor table, Tensor act, Tensor rstd, " DETDIT_PLAN
        " plan, float eps, str numerics, bool[5] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("adaln_modulation(Tensor temb, Tensor weight, Tensor bias, " DETDIT_PLAN
        " plan, str numerics) -> (Tensor, Tensor, Tensor)");
  m.def("adaln_modulation_backward(Tensor grad, Tensor temb, Tensor weight, Tensor act, " DETDIT_PLAN
        " plan, str numerics, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");

  // detdit.distributed: `comm` is a handle from _C._register_communicator.
  m.def("sp_plan(" DETDIT_PLAN " plan, int world, int rank) -> " DETDIT_SP_PLAN, &detdit_torch::make_sp_plan);
  m.def("tp_adaln_projection(Tensor temb, Tensor weight, Tensor bias, int comm, str numerics) -> (Tensor, Tensor)");
  m.def("tp_adaln_projection_backward(Tensor grad_table, Tensor temb, Tensor weight, Tensor act, int comm, "
        "str numerics, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def("sp_rmsnorm(Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN
        " sp, int comm, float eps, str numerics) -> (Tensor, Tensor)");
  m.def("sp_rmsnorm_backward(Tensor grad, Tensor x, Tensor weight, Tensor? shift, Tensor? scale, " DETDIT_SP_PLAN
        " sp, Tensor rstd, int comm, float eps, str numerics) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("sp_gate_residual(Tensor residual, Tensor y, Tensor gate, " DETDIT_SP_PLAN " sp, int comm) -> Tensor");
  m.def("sp_gate_residual_backward(Tensor grad, Tensor y, Tensor gate, " DETDIT_SP_PLAN
        " sp, int comm) -> (Tensor, Tensor, Tensor)");
}

// The device kernels: the same functions for CPU and CUDA tensors.
#define DETDIT_DEVICE_KERNELS(m)                                                   \
  m.impl("timestep_sinusoid", &detdit_torch::timestep_sinusoid);                 \
  m.impl("timestep_sinusoid_backward", &detdit_torch::timestep_sinusoid_backward); \
  m.impl("linear", &detdit_torch::linear);                                       \
  m.impl("linear_backward", &detdit_torch::linear_backward);                     \
  m.impl("timestep_mlp", &detdit_torch::timestep_mlp);                           \
  m.impl("timestep_mlp_backward", &detdit_torch::timestep_mlp_backward);         \
  m.impl("adaln_projection", &detdit_torch::adaln_projection);                   \
  m.impl("adaln_projection_backward", &detdit_torch::adaln_projection_backward); \
  m.impl("adaln_row_gather", &detdit_torch::adaln_row_gather);                   \
  m.impl("adaln_row_gather_backward", &detdit_torch::adaln_row_gather_backward); \
  m.impl("rmsnorm", &detdit_torch::rmsnorm);                                     \
  m.impl("rmsnorm_backward", &detdit_torch::rmsnorm_backward);                   \
  m.impl("gate_residual", &detdit_torch::gate_residual);                         \
  m.impl("gate_residual_backward", &detdit_torch::gate_residual_backward);       \
  m.impl("final_adaln_out", &detdit_torch::final_adaln_out);                     \
  m.impl("final_adaln_out_backward", &detdit_torch::final_adaln_out_backward);   \
  m.impl("adaln_modulation", &detdit_torch::adaln_modulation);                   \
  m.impl("adaln_modulation_backward", &detdit_torch::adaln_modulation_backward);  \
  m.impl("tp_adaln_projection", &detdit_torch::tp_adaln_projection);             \
  m.impl("tp_adaln_projection_backward", &detdit_torch::tp_adaln_projection_backward); \
  m.impl("sp_rmsnorm", &detdit_torch::sp_rmsnorm_kernel);                        \
  m.impl("sp_rmsnorm_backward", &detdit_torch::sp_rmsnorm_backward);             \
  m.impl("sp_gate_residual", &detdit_torch::sp_gate_residual_kernel);            \
  m.impl("sp_gate_residual_backward", &detdit_torch::sp_gate_residual_backward)

TORCH_LIBRARY_IMPL(detdit, CPU, m) { DETDIT_DEVICE_KERNELS(m); }
TORCH_LIBRARY_IMPL(detdit, CUDA, m) { DETDIT_DEVICE_KERNELS(m); }

TORCH_LIBRARY_IMPL(detdit, Autograd, m) {
  m.impl("timestep_sinusoid", &detdit_torch::timestep_sinusoid_autograd);
  m.impl("linear", &detdit_torch::linear_autograd);
  m.impl("timestep_mlp", &detdit_torch::timestep_mlp_autograd);
  m.impl("adaln_projection", &detdit_torch::adaln_projection_autograd);
  m.impl("adaln_row_gather", &detdit_torch::adaln_row_gather_autograd);
  m.impl("rmsnorm", &detdit_torch::rmsnorm_autograd);
  m.impl("gate_residual", &detdit_torch::gate_residual_autograd);
  m.impl("final_adaln_out", &detdit_torch::final_adaln_out_autograd);
  m.impl("adaln_modulation", &detdit_torch::adaln_modulation_autograd);
  m.impl("tp_adaln_projection", &detdit_torch::tp_adaln_projection_autograd);
  m.impl("sp_rmsnorm", &detdit_torch::sp_rmsnorm_autograd);
  m.impl("sp_gate_residual", &detdit_torch::sp_gate_residual_autograd);
}

// `import detdit._C` loads this library, which registers the operators above
// (torch.ops.detdit.*); the module itself holds only the communicator registry.
static PyMethodDef detdit_methods[] = {
    {"_register_communicator", detdit_torch::register_communicator, METH_VARARGS,
     "_register_communicator(gather, rank, world, device) -> handle"},
    {"_release_communicator", detdit_torch::release_communicator, METH_VARARGS, "_release_communicator(handle)"},
    {nullptr, nullptr, 0, nullptr}};

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "detdit._C", nullptr, -1, detdit_methods,
                               nullptr,               nullptr,     nullptr, nullptr};
  return PyModule_Create(&module);
}
