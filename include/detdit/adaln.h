// detdit/adaln.h: the AdaLN conditioning ops.
//
// Conventions (MiniMax-H3): modality tags 0 video, 1 text, 2 audio; six AdaLN
// chunks in the order shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp,
// gate_mlp. The projection's (T, 18H) table has output channel
// o = m*6H + c*H + h; viewed as (3T, 6H), row ti*3 + m holds timestep ti and
// modality m, and chunk c is the (3T, H) column block [c*H, (c+1)*H) (row
// stride 6H, unit column stride).
//
// adaln_projection:  act = bf16(silu_fp32(temb)) (one cast, after the SiLU);
//                    table = linear(act, W, b). temb is FP32: a bf16 temb is a
//                    TypeError (the SiLU runs before the cast).
// adaln_row_gather:  out[c, s, :] = rows[row(s), c*H:(c+1)*H], a byte copy
//                    (bitwise equal to six index_selects); backward d_rows by
//                    the canonical reduction (plan.h), unreferenced rows zero.
// adaln_modulation:  projection + gather fused; table gradients stay FP32 from
//                    the gather backward into the projection backward.
// final_adaln_out:   H3's norm_out: table = linear(bf16(silu(temb)), W (2H, D), b),
//                    shift = table[:, :H], scale = table[:, H:] (shift first),
//                    out = rmsnorm_modulated(x, w, shift, scale) indexed by the
//                    timestep index (plan with R = T). Table gradients stay FP32.
#pragma once

#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

constexpr int kAdalnChunks = 6;

// The (3T, H) view of chunk c of a (T, 18H) table (or of a (3T, 6H) rows view).
Status adaln_table_chunk(const TensorView& table, int64_t hidden, int chunk, TensorView* view);

// What the forward and the backward both read (bias only feeds the forward).
struct AdalnProjectionInputs {
  TensorView temb;    // (T, D) fp32
  TensorView weight;  // (N, D) bf16 or fp32, N a multiple of 18 (18H for H3)
  TensorView bias;    // (N,) weight's dtype (forward only)
  Numerics numerics = Numerics::kPortable;
};

struct AdalnProjectionParams {
  AdalnProjectionInputs in;
  TensorView table;   // (T, N) weight's dtype, output
  TensorView act;     // (T, D) weight's dtype, saved bf16(silu(temb)), or absent
};
Status adaln_projection_forward(const AdalnProjectionParams& params, Stream stream = nullptr);

struct AdalnProjectionBackwardParams {
  AdalnProjectionInputs in;  // as in the forward
  TensorView act;            // (T, D) saved by the forward
  TensorView grad_table;     // (T, N) fp32 or weight's dtype
  TensorView d_temb;         // (T, D) fp32, or absent
  TensorView d_weight;       // (N, D) weight's dtype, or absent
  TensorView d_bias;         // (N,) weight's dtype, or absent
};
Status adaln_projection_backward(const AdalnProjectionBackwardParams& params, Stream stream = nullptr);

struct AdalnRowGatherParams {
  TensorView rows;    // (R, 6H) fp32/bf16/fp16, unit column stride, any row stride
  IndexPlan plan;     // R rows, seq_len S (plan.batch() is not used by the forward)
  TensorView out;     // (6, S, H) rows' dtype, contiguous
};
Status adaln_row_gather_forward(const AdalnRowGatherParams& params, Stream stream = nullptr);

struct AdalnRowGatherBackwardParams {
  TensorView grad;    // (6, B*S, H) (or (6, B, S, H)) rows' dtype, contiguous; B = plan.batch()
  IndexPlan plan;
  TensorView d_rows;  // (R, 6H) fp32 or grad's dtype, contiguous
};
Status adaln_row_gather_backward(const AdalnRowGatherBackwardParams& params, Stream stream = nullptr);

// What the forward and the backward both read (bias only feeds the forward).
struct AdalnModulationInputs {
  TensorView temb;    // (T, D) fp32
  TensorView weight;  // (18H, D) bf16 or fp32
  TensorView bias;    // (18H,) (forward only)
  IndexPlan plan;     // R = 3T
  Numerics numerics = Numerics::kPortable;
};

struct AdalnModulationParams {
  AdalnModulationInputs in;
  TensorView table;   // (T, 18H) weight's dtype, saved (required)
  TensorView act;     // (T, D) weight's dtype, saved (required)
  TensorView out;     // (6, S, H) weight's dtype
};
Status adaln_modulation_forward(const AdalnModulationParams& params, Stream stream = nullptr);

struct AdalnModulationBackwardParams {
  AdalnModulationInputs in;  // as in the forward
  TensorView act;            // (T, D) saved by the forward
  TensorView grad;           // (6, B*S, H) weight's dtype
  TensorView d_temb;         // (T, D) fp32, or absent
  TensorView d_weight;       // (18H, D) weight's dtype, or absent
  TensorView d_bias;         // (18H,) weight's dtype, or absent
};
Status adaln_modulation_backward(const AdalnModulationBackwardParams& params, Stream stream = nullptr);

// What the forward and the backward both read (bias only feeds the forward).
struct FinalAdalnOutInputs {
  TensorView x;            // (B*S, H) or (B, S, H) activations, bf16/fp16/fp32
  TensorView norm_weight;  // (H,) x's dtype
  TensorView temb;         // (T, D) fp32
  TensorView weight;       // (2H, D) x's dtype
  TensorView bias;         // (2H,) x's dtype (forward only)
  IndexPlan plan;          // timestep index, R = T
  float eps = 1e-5f;
  Numerics numerics = Numerics::kPortable;
};

struct FinalAdalnOutParams {
  FinalAdalnOutInputs in;
  TensorView out;          // like x
  TensorView table;        // (T, 2H) saved (required)
  TensorView act;          // (T, D) saved (required)
  TensorView rstd;         // (B*S,) fp32 saved (required)
};
Status final_adaln_out_forward(const FinalAdalnOutParams& params, Stream stream = nullptr);

struct FinalAdalnOutBackwardParams {
  FinalAdalnOutInputs in;      // as in the forward
  TensorView table, act, rstd; // saved by the forward
  TensorView grad;             // like x
  TensorView dx;               // like x, or absent
  TensorView d_norm_weight;    // (H,) x's dtype or fp32, or absent
  TensorView d_temb;           // (T, D) fp32, or absent
  TensorView d_weight;         // (2H, D) weight's dtype, or absent
  TensorView d_bias;           // (2H,) weight's dtype, or absent
};
Status final_adaln_out_backward(const FinalAdalnOutBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
