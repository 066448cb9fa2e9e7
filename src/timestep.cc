// Public entry points of timestep_sinusoid and timestep_mlp
// (include/detdit/timestep.h): validate every argument, then dispatch on the
// tensors' device. timestep_mlp is the two-layer MLP of src/common/mlp.h,
// composed from the public linear ops (numerics 5.3, 6.3).
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
#include "common/mlp.h"
#include "common/out_of_memory.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "common/validate.h"

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
  const mlp::Operands in{params.in.features, params.in.w1, params.in.b1, params.in.w2, params.in.b2};
  const mlp::Outputs out{params.temb, params.pre, params.hidden};
  DETDIT_RETURN_IF_ERROR(mlp::validate_forward(in, out, params.in.numerics, mlp::Names{}));
  return mlp::forward(in, out, params.in.numerics, stream);
}

Status timestep_mlp_backward(const TimestepMlpBackwardParams& params, Stream stream) {
  const mlp::Operands in{params.in.features, params.in.w1, params.in.b1, params.in.w2, params.in.b2};
  const mlp::Gradients g{params.pre,  params.hidden, params.grad_temb, params.d_features,
                         params.d_w1, params.d_b1,   params.d_w2,      params.d_b2};
  DETDIT_RETURN_IF_ERROR(mlp::validate_backward(in, g, params.in.numerics, mlp::Names{}));
  return mlp::backward(in, g, params.in.numerics, stream);
}

}  // namespace detdit
