// CPU reference of the SiLU steps (docs/numerics.md 5.4 and 6.2), portable
// profile (the public layer rejects numerics=torch for CPU tensors):
//   silu_cast:     act[i] = R_act(silu_P(temb[i])), one rounding to act's dtype
//   silu_backward: d_pre[i] = silu_vjp(grad[i], pre[i]), all FP32
// Elementwise, so parallel_for over elements changes no bit. No tensor here
// has an alignment rule (temb, silu_backward's three): cpu::load / cpu::store.
#include "common/backends.h"
#include "common/pointwise_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/unaligned.h"

namespace detdit {
namespace cpu {

// The bases are captured by value (unaligned.h).
Status silu_cast(const TensorView& temb, const TensorView& act, Numerics, Stream) {
  const void* in = temb.data;
  void* out = act.data;
  dispatch_float_dtype(act.dtype, [&](auto tag) {
    using Out = decltype(tag);
    parallel_for(0, temb.numel(), [in, out](int64_t i) {
      store(out, i, from_float<Out>(silu_value(load<float>(in, i), PortableExp{})));
    });
  });
  return Status();
}

Status silu_backward(const SiluBackwardParams& p, Stream) {
  const void *grad = p.grad.data, *pre = p.pre.data;
  void* d_pre = p.d_pre.data;
  parallel_for(0, p.grad.numel(), [grad, pre, d_pre](int64_t i) {
    store(d_pre, i, silu_vjp(load<float>(grad, i), load<float>(pre, i), PortableExp{}));
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
