// SiLU on CUDA, elementwise FP32 (numerics 5.4 and 6.2):
//   silu_cast:     act = R_T(rn(z / rn(1 + exp_P(-z))))   (one cast to act's dtype)
//   silu_backward: s = rn(1 / rn(1 + exp_P(-z)));
//                  d = rn(g * rn(s * rn(1 + rn(z * rn(1 - s)))))
// Row-local and order-free: any launch geometry gives the same bytes.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/pointwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/profile_math.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

template <typename Out>
__global__ void silu_cast_kernel(const float* temb, Out* act, int64_t elements, bool torch) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= elements) return;
  act[i] = from_float<Out>(silu_p(temb[i], torch));
}

__global__ void silu_backward_kernel(const float* grad, const float* pre, float* d_pre, int64_t elements,
                                     bool torch) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= elements) return;
  d_pre[i] = silu_vjp(grad[i], pre[i], ProfileExp{torch});
}

}  // namespace

Status silu_cast(const TensorView& temb, const TensorView& act, Numerics numerics, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(temb.device));
  const int64_t elements = temb.numel();
  if (elements == 0) return Status();
  const int threads = launch_tuning().elementwise_threads;
  return dispatch_float_dtype(act.dtype, [&](auto tag) {
    using Out = decltype(tag);
    silu_cast_kernel<Out><<<blocks_for(elements, threads), threads, 0, as_cuda_stream(stream)>>>(
        temb.ptr<const float>(), act.ptr<Out>(), elements, numerics == Numerics::kTorch);
    return launch_status("silu_cast_kernel");
  });
}

Status silu_backward(const SiluBackwardParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.grad.device));
  const int64_t elements = p.grad.numel();
  if (elements == 0) return Status();
  const int threads = launch_tuning().elementwise_threads;
  silu_backward_kernel<<<blocks_for(elements, threads), threads, 0, as_cuda_stream(stream)>>>(
      p.grad.ptr<const float>(), p.pre.ptr<const float>(), p.d_pre.ptr<float>(), elements,
      p.numerics == Numerics::kTorch);
  return launch_status("silu_backward_kernel");
}

}  // namespace cuda
}  // namespace detdit
