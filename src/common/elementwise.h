// Internal elementwise helpers of composite ops: the conditioning chain's
// residual-stream arithmetic (docs/numerics.md 5.10 add) and the device-local
// byte copies and zero fills around it. Not part of the public API: callers
// pass validated tensors (contiguous, of one device; add: one float dtype and
// equal numel). Every function is stream-ordered on CUDA and never
// synchronises the host, so a composite op stays CUDA-graph capturable.
#pragma once

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

#define DETDIT_ELEMENTWISE_OPS(ns)                                                             \
  namespace ns {                                                                               \
  /* out[i] = R_T(rn(a[i] + b[i])), T = the tensors' dtype; out may be a or b (in place) */    \
  Status add(const TensorView& a, const TensorView& b, const TensorView& out, Stream stream);  \
  /* dst = src, a byte copy of dst.nbytes() bytes (CUDA: cudaMemcpyAsync device to device) */  \
  Status copy_tensor(const TensorView& src, const TensorView& dst, Stream stream);             \
  /* every byte of t = 0 (+0.0 in every float dtype) */                                        \
  Status fill_zero(const TensorView& t, Stream stream);                                        \
  }

DETDIT_ELEMENTWISE_OPS(cpu)
DETDIT_ELEMENTWISE_OPS(cuda)

#undef DETDIT_ELEMENTWISE_OPS

// The backend of the tensors' device (out's, dst's, t's).
Status add(const TensorView& a, const TensorView& b, const TensorView& out, Stream stream);
Status copy_tensor(const TensorView& src, const TensorView& dst, Stream stream);
Status fill_zero(const TensorView& t, Stream stream);

}  // namespace detdit
