// The AdaLN projection sequence, shared by adaln_projection, adaln_modulation
// and final_adaln_out (docs/numerics.md 5.4 and 6.4). Internal.
//
// Forward:  act   = R_W(silu_P(temb))            (T, D), W = weight's dtype
//           table = R_W(linear(act, W, b))       (T, N)
// Backward: g     = fp32(grad_table)             (exact upcast when bf16)
//           dW, db = linear d_W / d_b (g, act), rounded once to their dtypes
//           d_act = linear d_x (g, W)            FP32, never rounded through
//                                                the cast (its VJP is the identity)
//           d_temb = silu_backward(d_act, temb)  FP32
//
// Use: call validate_projection_forward / _backward (or equivalent checks)
// first, then projection_forward / _backward, so that nothing is written on an
// error. The run functions compose the public linear ops and the backends'
// silu_cast, dispatch on the tensors' device, and take scratch memory for the
// absent or intermediate tensors (src/common/scratch.h).
#pragma once

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// temb (T, D) fp32 (temb_in_weight_dtype: or weight's dtype, widened exactly
// into FP32 scratch before the SiLU and its VJP), T >= 1; weight (N, D) bf16 or fp32, contiguous, 16-byte
// aligned, D a multiple of the 16-byte vector width; bias (N,) weight's dtype
// (required); table (T, N) weight's dtype; act (T, D) weight's dtype or absent;
// one device; numerics valid on it; outputs overlap no input.
Status validate_projection_forward(const TensorView& temb, const TensorView& weight, const TensorView& bias,
                                   const TensorView& table, const TensorView& act, Numerics numerics,
                                   bool temb_in_weight_dtype = false);
Status projection_forward(const TensorView& temb, const TensorView& weight, const TensorView& bias,
                          const TensorView& table, const TensorView& act, Numerics numerics, Stream stream);

// temb (T, D) fp32; weight (N, D) as above; act (T, D) weight's dtype (saved
// by the forward); grad_table (T, N) fp32 or weight's dtype, or absent for a
// fused op whose FP32 (T, N) scratch it is (taken after every check passed);
// d_temb (T, D) fp32, d_weight (N, D) and d_bias (N,) weight's dtype, each may
// be absent.
Status validate_projection_backward(const TensorView& temb, const TensorView& weight, const TensorView& act,
                                    const TensorView& grad_table, const TensorView& d_temb,
                                    const TensorView& d_weight, const TensorView& d_bias, Numerics numerics,
                                    bool temb_in_weight_dtype = false);
Status projection_backward(const TensorView& temb, const TensorView& weight, const TensorView& act,
                           const TensorView& grad_table, const TensorView& d_temb, const TensorView& d_weight,
                           const TensorView& d_bias, Numerics numerics, Stream stream);

}  // namespace detdit
