// CPU reference of the SiLU steps (docs/numerics.md 5.4 and 6.2), portable
// profile (the public layer rejects numerics=torch for CPU tensors):
//   silu_cast:     act[i] = R_act(silu_P(temb[i])), one rounding to act's dtype
//   silu_backward: d_pre[i] = silu_vjp(grad[i], pre[i]), all FP32
// Elementwise, so parallel_for over elements changes no bit.
#include "common/backends.h"
#include "common/pointwise_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"

namespace detdit {
namespace cpu {

Status silu_cast(const TensorView& temb, const TensorView& act, Numerics, Stream) {
  const float* in = temb.ptr<float>();
  dispatch_float_dtype(act.dtype, [&](auto tag) {
    using Out = decltype(tag);
    Out* out = act.ptr<Out>();
    parallel_for(0, temb.numel(), [&](int64_t i) { out[i] = from_float<Out>(silu_value(in[i], PortableExp{})); });
  });
  return Status();
}

Status silu_backward(const SiluBackwardParams& p, Stream) {
  const float* grad = p.grad.ptr<float>();
  const float* pre = p.pre.ptr<float>();
  float* d_pre = p.d_pre.ptr<float>();
  parallel_for(0, p.grad.numel(), [&](int64_t i) { d_pre[i] = silu_vjp(grad[i], pre[i], PortableExp{}); });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
