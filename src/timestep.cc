// Public entry points of timestep_sinusoid and timestep_mlp
// (include/detdit/timestep.h): validate every argument, then dispatch on the
// tensors' device. timestep_mlp is composed from the public linear ops and
// silu_backward, so its arithmetic is exactly linear's (numerics 5.3, 6.3).
// Nothing is written on error: every check, including the timestep range
// check and scratch allocation, runs before the first write.
#include "detdit/timestep.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/backends.h"
#include "common/out_of_memory.h"
#include "common/scalar_math.h"
#include "common/scratch.h"
#include "common/storage.h"
#include "common/validate.h"
#include "detdit/linear.h"

namespace detdit {
namespace {

using Named = std::pair<TensorView, const char*>;
using NamedList = std::initializer_list<Named>;

// timesteps (T,) fp32/bf16/fp16, contiguous, T >= 1.
Status check_timestep_tensor(const TensorView& t) {
  DETDIT_RETURN_IF_ERROR(check::present(t, "timesteps"));
  if (t.rank != 1) return Status::value_error("timesteps must be 1-D (num_timesteps,), got " + t.describe());
  if (t.shape[0] < 1) return Status::value_error("timesteps must hold at least one timestep, got " + t.describe());
  DETDIT_RETURN_IF_ERROR(check::dtype(t, "timesteps", {DType::kF32, DType::kBF16, DType::kF16}));
  return check::contiguous(t, "timesteps");
}

// An argument in a message: an integer below 2^53 in full, else the shortest
// decimal that reads back as the same float.
std::string float_text(float v) {
  char text[48];
  if (std::fabs(v) < 0x1p53f && std::nearbyint(v) == v) {
    std::snprintf(text, sizeof text, "%.0f", static_cast<double>(v));
    return text;
  }
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, static_cast<double>(v));
    if (std::strtof(text, nullptr) == v) break;
  }
  return text;
}

// Every value finite and in [0, t_max]; a CUDA tensor is read on the host once.
Status check_timestep_values_unguarded(const TensorView& t, float t_max, Stream stream) {
  std::vector<char> raw(t.nbytes());
  if (t.device.is_cuda()) {
    DETDIT_RETURN_IF_ERROR(cuda::copy_to_host(t.data, raw.data(), raw.size(), t.device, stream));
  } else {
    std::copy_n(static_cast<const char*>(t.data), raw.size(), raw.data());
  }
  TensorView host = t;
  host.data = raw.data();
  return dispatch_float_dtype(t.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const T* values = host.ptr<T>();
    for (int64_t i = 0; i < t.shape[0]; ++i) {
      const float v = to_float(values[i]);
      // NaN fails both comparisons; +-inf fails one.
      if (v >= 0.0f && v <= t_max) continue;
      std::ostringstream os;
      // H3's default keeps its own words: the t*1000 convention fails closed unless asked for.
      if (t_max == 1.0f)
        os << "timestep must be finite and lie in [0, 1]: detdit consumes t = 1 - sigma unscaled unless t_max "
              "says otherwise (t_max = 1000 for sigma * 1000)";
      else
        os << "timestep must be finite and lie in [0, t_max] = [0, " << float_text(t_max) << "]";
      os << " (got timesteps[" << i << "] = " << v << ")";
      return Status::value_error(os.str());
    }
    return Status();
  });
}

// The host copy of the values may not fit: a RuntimeError, not an exception.
Status check_timestep_values(const TensorView& t, float t_max, Stream stream) {
  return out_of_memory_is_an_error(
      [&] {
        return "out of memory: the " + std::to_string(t.nbytes()) + "-byte host copy of timesteps for their range check";
      },
      [&] { return check_timestep_values_unguarded(t, t_max, stream); });
}

// The op's scalars (numerics 5.1): max_period finite and >= 1 (so the
// exponents are <= 0 and every freq <= 1); half - downscale_freq_shift
// positive (the exponent's divisor, when there is a frequency); scale finite;
// t_max positive and finite. Then |arg| <= rn(|scale| * t_max) for every t in
// [0, t_max], which must stay in the portable sin/cos range (numerics 4).
Status check_sinusoid_scalars(const TimestepSinusoidInputs& in, int64_t channels) {
  std::ostringstream os;
  const int64_t half = channels / 2;
  const double denom = static_cast<double>(half) - static_cast<double>(in.downscale_freq_shift);
  if (!(std::isfinite(in.max_period) && in.max_period >= 1.0f)) {
    os << "max_period must be finite and >= 1, got " << in.max_period;
  } else if (!std::isfinite(in.downscale_freq_shift) || (half > 0 && !(static_cast<float>(denom) > 0.0f))) {
    os << "downscale_freq_shift must be finite and less than half = num_channels // 2 = " << half << ", got "
       << float_text(in.downscale_freq_shift);
  } else if (!std::isfinite(in.scale)) {
    os << "scale must be finite, got " << in.scale;
  } else if (!(std::isfinite(in.t_max) && in.t_max > 0.0f)) {
    os << "t_max (the timesteps' upper bound) must be finite and positive, got " << in.t_max;
  } else if (!(std::fabs(num::mul32(in.scale, in.t_max)) <= num::kPortableTrigMaxArg)) {
    os << "|scale| * t_max = " << float_text(std::fabs(num::mul32(in.scale, in.t_max)))
       << " exceeds 1e6, the largest sinusoid argument the portable sin/cos evaluate exactly (scale = "
       << float_text(in.scale) << ", t_max = " << float_text(in.t_max) << ")";
  } else {
    return Status();
  }
  return Status::value_error(os.str());
}

// (T, C) fp32 contiguous with C positive (odd C: diffusers' zero pad column).
Status check_channels(const TensorView& t, const char* name, int64_t num_timesteps) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::rank(t, name, 2, "(T, C)"));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {num_timesteps, -1}, "(T, C)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  const int64_t channels = t.shape[1];
  if (channels > 0) return Status();
  return Status::value_error(std::string(name) + ".shape[1] (num_channels) must be positive, got " +
                             std::to_string(channels));
}

Status validate_sinusoid(const TimestepSinusoidParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_timestep_tensor(p.in.timesteps));
  DETDIT_RETURN_IF_ERROR(check::present(p.features, "features"));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.features, "features", p.in.timesteps, "timesteps"));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.in.numerics, p.in.timesteps.device));
  DETDIT_RETURN_IF_ERROR(check_channels(p.features, "features", p.in.timesteps.shape[0]));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.features, "features", p.in.timesteps, "timesteps"));
  DETDIT_RETURN_IF_ERROR(check_sinusoid_scalars(p.in, p.features.shape[1]));
  return p.in.check_range ? check_timestep_values(p.in.timesteps, p.in.t_max, stream) : Status();
}

Status validate_sinusoid_backward(const TimestepSinusoidBackwardParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_timestep_tensor(p.in.timesteps));
  for (auto [t, name] : NamedList{{p.grad_features, "grad_features"}, {p.d_timesteps, "d_timesteps"}}) {
    DETDIT_RETURN_IF_ERROR(check::present(t, name));
    DETDIT_RETURN_IF_ERROR(check::same_device(t, name, p.in.timesteps, "timesteps"));
  }
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.in.numerics, p.in.timesteps.device));
  DETDIT_RETURN_IF_ERROR(check_channels(p.grad_features, "grad_features", p.in.timesteps.shape[0]));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(p.d_timesteps, "d_timesteps", p.in.timesteps, "timesteps"));
  DETDIT_RETURN_IF_ERROR(check::shape(p.d_timesteps, "d_timesteps", {p.in.timesteps.shape[0]}, "(T,)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_timesteps, "d_timesteps"));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.d_timesteps, "d_timesteps", p.in.timesteps, "timesteps"));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.d_timesteps, "d_timesteps", p.grad_features, "grad_features"));
  DETDIT_RETURN_IF_ERROR(check_sinusoid_scalars(p.in, p.grad_features.shape[1]));
  return p.in.check_range ? check_timestep_values(p.in.timesteps, p.in.t_max, stream) : Status();
}

// The H3 time embedder is an FP32 module: every operand fp32, contiguous,
// 16-byte aligned (they feed linear), on features' device.
Status check_mlp_operand(const TensorView& t, const char* name, const TensorView& features,
                         std::initializer_list<int64_t> dims, const char* layout) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  if (t.dtype != DType::kF32)
    return Status::type_error(std::string(name) + " must be float32: the H3 time_embedder is an FP32 module (got " +
                              dtype_name(t.dtype) + ")");
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, features, "features"));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, dims, layout));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  return check::aligned(t, name, 16, "linear reads its rows as 16-byte vectors");
}

Status check_optional_mlp_operand(const TensorView& t, const char* name, const TensorView& features,
                                  std::initializer_list<int64_t> dims, const char* layout) {
  return t.present() ? check_mlp_operand(t, name, features, dims, layout) : Status();
}

// features (T, K) with T >= 1 and K, H multiples of 4 (fp32 16-byte vectors).
Status check_mlp_sizes(const TensorView& features, const TensorView& w1) {
  if (features.rank != 2 || features.shape[0] < 1)
    return Status::value_error("features must be a non-empty (T, K) matrix, got " + features.describe());
  for (auto [size, name] : {std::pair<int64_t, const char*>{features.shape[1], "K = features.shape[1]"},
                            {w1.shape[0], "H = w1.shape[0]"}})
    if (size % 4 != 0)
      return Status::value_error(std::string(name) + " = " + std::to_string(size) +
                                 " must be a multiple of 4 (float32 elements per 16-byte vector load)");
  return Status();
}

// The start both MLP validations share: features, w1, w2 present; features
// (T, K) and w1 (H, K) well formed; the numerics available on features' device.
Status check_mlp_input(const TensorView& features, const TensorView& w1, const TensorView& w2, Numerics numerics) {
  DETDIT_RETURN_IF_ERROR(check::present(features, "features"));
  DETDIT_RETURN_IF_ERROR(check::present(w1, "w1"));
  DETDIT_RETURN_IF_ERROR(check::present(w2, "w2"));
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(features, "features", features, {-1, -1}, "(T, K)"));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(numerics, features.device));
  return check_mlp_operand(w1, "w1", features, {-1, features.shape[1]}, "(H, K)");
}

Status validate_mlp(const TimestepMlpParams& p) {
  DETDIT_RETURN_IF_ERROR(check_mlp_input(p.in.features, p.in.w1, p.in.w2, p.in.numerics));
  const int64_t rows = p.in.features.shape[0];
  const int64_t hidden = p.in.w1.shape[0], out_features = p.in.w2.shape[0];
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(p.in.b1, "b1", p.in.features, {hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(p.in.w2, "w2", p.in.features, {-1, hidden}, "(D, H)"));
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(p.in.b2, "b2", p.in.features, {out_features}, "(D,)"));
  DETDIT_RETURN_IF_ERROR(check_mlp_sizes(p.in.features, p.in.w1));
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(p.temb, "temb", p.in.features, {rows, out_features}, "(T, D)"));
  DETDIT_RETURN_IF_ERROR(check_optional_mlp_operand(p.pre, "pre", p.in.features, {rows, hidden}, "(T, H)"));
  DETDIT_RETURN_IF_ERROR(check_optional_mlp_operand(p.hidden, "hidden", p.in.features, {rows, hidden}, "(T, H)"));
  for (auto [out, out_name] : NamedList{{p.temb, "temb"}, {p.pre, "pre"}, {p.hidden, "hidden"}})
    for (auto [in, in_name] : NamedList{{p.in.features, "features"}, {p.in.w1, "w1"}, {p.in.b1, "b1"}, {p.in.w2, "w2"},
                                        {p.in.b2, "b2"}})
      DETDIT_RETURN_IF_ERROR(check::no_alias(out, out_name, in, in_name));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.pre, "pre", p.temb, "temb"));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.hidden, "hidden", p.temb, "temb"));
  return check::no_alias(p.hidden, "hidden", p.pre, "pre");
}

Status validate_mlp_backward(const TimestepMlpBackwardParams& p) {
  DETDIT_RETURN_IF_ERROR(check_mlp_input(p.in.features, p.in.w1, p.in.w2, p.in.numerics));
  const int64_t rows = p.in.features.shape[0], in_features = p.in.features.shape[1];
  const int64_t hidden = p.in.w1.shape[0], out_features = p.in.w2.shape[0];
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(p.in.w2, "w2", p.in.features, {-1, hidden}, "(D, H)"));
  DETDIT_RETURN_IF_ERROR(check_mlp_sizes(p.in.features, p.in.w1));
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(p.pre, "pre", p.in.features, {rows, hidden}, "(T, H)"));
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(p.hidden, "hidden", p.in.features, {rows, hidden}, "(T, H)"));
  DETDIT_RETURN_IF_ERROR(check_mlp_operand(p.grad_temb, "grad_temb", p.in.features, {rows, out_features}, "(T, D)"));
  DETDIT_RETURN_IF_ERROR(
      check_optional_mlp_operand(p.d_features, "d_features", p.in.features, {rows, in_features}, "(T, K)"));
  DETDIT_RETURN_IF_ERROR(check_optional_mlp_operand(p.d_w1, "d_w1", p.in.features, {hidden, in_features}, "(H, K)"));
  DETDIT_RETURN_IF_ERROR(check_optional_mlp_operand(p.d_b1, "d_b1", p.in.features, {hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(check_optional_mlp_operand(p.d_w2, "d_w2", p.in.features, {out_features, hidden}, "(D, H)"));
  DETDIT_RETURN_IF_ERROR(check_optional_mlp_operand(p.d_b2, "d_b2", p.in.features, {out_features}, "(D,)"));
  const NamedList outputs{{p.d_features, "d_features"}, {p.d_w1, "d_w1"}, {p.d_b1, "d_b1"}, {p.d_w2, "d_w2"},
                          {p.d_b2, "d_b2"}};
  for (const Named* out = outputs.begin(); out != outputs.end(); ++out) {
    for (auto [in, in_name] : NamedList{{p.in.features, "features"}, {p.in.w1, "w1"}, {p.in.w2, "w2"}, {p.pre, "pre"},
                                        {p.hidden, "hidden"}, {p.grad_temb, "grad_temb"}})
      DETDIT_RETURN_IF_ERROR(check::no_alias(out->first, out->second, in, in_name));
    for (const Named* other = out + 1; other != outputs.end(); ++other)
      DETDIT_RETURN_IF_ERROR(check::no_alias(out->first, out->second, other->first, other->second));
  }
  return Status();
}

}  // namespace

Status timestep_sinusoid_forward(const TimestepSinusoidParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_sinusoid(params, stream));
  return backend::timestep_sinusoid_forward(params.in.timesteps.device, params, stream);
}

Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_sinusoid_backward(params, stream));
  return backend::timestep_sinusoid_backward(params.in.timesteps.device, params, stream);
}

Status timestep_mlp_forward(const TimestepMlpParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_mlp(params));
  const Device device = params.in.features.device;
  const int64_t rows = params.in.features.shape[0], hidden_size = params.in.w1.shape[0];
  // hidden = silu(pre) feeds the second linear: scratch when the caller does not keep it.
  TensorView hidden = params.hidden;
  std::shared_ptr<void> scratch;
  if (!hidden.present())
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {rows, hidden_size}, stream, &scratch, &hidden));
  LinearParams first;
  first.x = params.in.features;
  first.weight = params.in.w1;
  first.bias = params.in.b1;
  first.out = hidden;
  first.pre_activation = params.pre;
  first.activation = Activation::kSilu;
  first.numerics = params.in.numerics;
  DETDIT_RETURN_IF_ERROR(linear_forward(first, stream));
  LinearParams second;
  second.x = hidden;
  second.weight = params.in.w2;
  second.bias = params.in.b2;
  second.out = params.temb;
  second.numerics = params.in.numerics;
  return linear_forward(second, stream);
}

Status timestep_mlp_backward(const TimestepMlpBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_mlp_backward(params));
  const Device device = params.in.features.device;
  const int64_t rows = params.in.features.shape[0], in_features = params.in.features.shape[1];
  const int64_t hidden_size = params.in.w1.shape[0], out_features = params.in.w2.shape[0];
  const bool need_d_pre = params.d_features.present() || params.d_w1.present() || params.d_b1.present();
  // Scratch first, so an allocation failure writes nothing:
  // d_hidden, d_pre (T, H) FP32; the d_x chunk partials of both linears.
  TensorView d_hidden, d_pre, hidden_partials, feature_partials;
  std::shared_ptr<void> owners[4];
  if (need_d_pre) {
    const int64_t hidden_chunks = (out_features + kLinearChunkRows - 1) / kLinearChunkRows;
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {rows, hidden_size}, stream, &owners[0], &d_hidden));
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {rows, hidden_size}, stream, &owners[1], &d_pre));
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {hidden_chunks, rows, hidden_size}, stream,
                                          &owners[2], &hidden_partials));
  }
  if (params.d_features.present()) {
    const int64_t feature_chunks = (hidden_size + kLinearChunkRows - 1) / kLinearChunkRows;
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {feature_chunks, rows, in_features}, stream,
                                          &owners[3], &feature_partials));
  }
  // 1. dW2, db2 = linear d_W / d_b (g, hidden)
  LinearBackwardWeightParams second_weight;
  second_weight.grad = params.grad_temb;
  second_weight.x = params.hidden;
  second_weight.d_weight = params.d_w2;
  second_weight.d_bias = params.d_b2;
  if (!need_d_pre) return linear_backward_weight(second_weight, stream);
  // 2. d_hidden = linear d_x (g, W2), FP32 (with step 1: one read of W2 on CUDA)
  LinearBackwardInputParams second_input;
  second_input.grad = params.grad_temb;
  second_input.weight = params.in.w2;
  second_input.partials = hidden_partials;
  second_input.d_x = d_hidden;
  DETDIT_RETURN_IF_ERROR(linear_backward_weight_and_input(second_weight, second_input, stream));
  // 3. d_pre = silu_backward(d_hidden, pre)
  SiluBackwardParams silu;
  silu.grad = d_hidden;
  silu.pre = params.pre;
  silu.d_pre = d_pre;
  silu.numerics = params.in.numerics;
  DETDIT_RETURN_IF_ERROR(silu_backward(silu, stream));
  // 4. dW1, db1 = linear d_W / d_b (d_pre, features)
  LinearBackwardWeightParams first_weight;
  first_weight.grad = d_pre;
  first_weight.x = params.in.features;
  first_weight.d_weight = params.d_w1;
  first_weight.d_bias = params.d_b1;
  if (!params.d_features.present()) return linear_backward_weight(first_weight, stream);
  // 5. d_features = linear d_x (d_pre, W1) (with step 4: one read of W1 on CUDA)
  LinearBackwardInputParams first_input;
  first_input.grad = d_pre;
  first_input.weight = params.in.w1;
  first_input.partials = feature_partials;
  first_input.d_x = params.d_features;
  return linear_backward_weight_and_input(first_weight, first_input, stream);
}

}  // namespace detdit
