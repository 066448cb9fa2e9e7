// Public entry points of timestep_sinusoid and timestep_mlp
// (include/detdit/timestep.h): validate every argument, then dispatch on the
// tensors' device. timestep_mlp is the two-layer MLP of src/common/mlp.h,
// composed from the public linear ops (numerics 5.3, 6.3).
// Nothing is written on error: every check, including the timestep range
// check and scratch allocation, runs before the first write.
#include "detdit/timestep.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/backends.h"
#include "common/mlp.h"
#include "common/out_of_memory.h"
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

// Every value finite and in [0, 1]; a CUDA tensor is read on the host once.
Status check_timestep_values_unguarded(const TensorView& t, Stream stream) {
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
      if (v >= 0.0f && v <= 1.0f) continue;
      std::ostringstream os;
      os << "timestep must be finite and lie in [0, 1]: detdit consumes t = 1 - sigma unscaled (got timesteps["
         << i << "] = " << v << ")";
      return Status::value_error(os.str());
    }
    return Status();
  });
}

// The host copy of the values may not fit: a RuntimeError, not an exception.
Status check_timestep_values(const TensorView& t, Stream stream) {
  return out_of_memory_is_an_error(
      [&] {
        return "out of memory: the " + std::to_string(t.nbytes()) + "-byte host copy of timesteps for their range check";
      },
      [&] { return check_timestep_values_unguarded(t, stream); });
}

Status check_max_period(float max_period) {
  if (std::isfinite(max_period) && max_period >= 1.0f) return Status();
  std::ostringstream os;
  os << "max_period must be finite and >= 1, got " << max_period;
  return Status::value_error(os.str());
}

// (T, C) fp32 contiguous with C positive and even.
Status check_channels(const TensorView& t, const char* name, int64_t num_timesteps) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::rank(t, name, 2, "(T, C)"));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {num_timesteps, -1}, "(T, C)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  const int64_t channels = t.shape[1];
  if (channels > 0 && channels % 2 == 0) return Status();
  return Status::value_error(std::string(name) + ".shape[1] (num_channels) must be a positive even number, got " +
                             std::to_string(channels));
}

Status validate_sinusoid(const TimestepSinusoidParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_timestep_tensor(p.in.timesteps));
  DETDIT_RETURN_IF_ERROR(check::present(p.features, "features"));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.features, "features", p.in.timesteps, "timesteps"));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.in.numerics, p.in.timesteps.device));
  DETDIT_RETURN_IF_ERROR(check_channels(p.features, "features", p.in.timesteps.shape[0]));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.features, "features", p.in.timesteps, "timesteps"));
  DETDIT_RETURN_IF_ERROR(check_max_period(p.in.max_period));
  return p.in.check_range ? check_timestep_values(p.in.timesteps, stream) : Status();
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
  DETDIT_RETURN_IF_ERROR(check_max_period(p.in.max_period));
  return p.in.check_range ? check_timestep_values(p.in.timesteps, stream) : Status();
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
