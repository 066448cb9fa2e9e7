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
//
// The other DiT families (diffusers' AdaLayerNorm* modules and the tables of
// Wan and LTX-Video):
// adaln_projection with chunks > 0: the same act and table for a weight of any
//                    N that is a positive multiple of the caller's chunk count,
//                    temb FP32 or the weight's dtype (a bf16 temb is widened
//                    exactly, so act = R_W(silu_P(temb)) is eager's
//                    linear(silu(temb)) on a bf16 temb); T rows are whatever
//                    the caller feeds: samples (T = B) or tokens (T = B*S).
// AdalnChunkOrder:   each family's chunk names in table column order;
//                    adaln_table_chunk(table, H, chunks, c) is chunk c's view.
// adaln_table_add:   out (T, K, H) = table (K, H) + proj (T, K, H) or (T, 1, H)
//                    (broadcast over K), one rounded add in the promoted dtype
//                    (Wan: FP32 table + bf16 projection -> FP32; LTX: bf16);
//                    d_proj the gradient cast (summed over K when broadcast),
//                    d_table the canonical cross-row reduction over T.
#pragma once

#include <string>

#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

constexpr int kAdalnChunks = 6;

// The (3T, H) view of chunk c of a (T, 18H) table (or of a (3T, 6H) rows view).
Status adaln_table_chunk(const TensorView& table, int64_t hidden, int chunk, TensorView* view);

// One family's modulation chunks in the order its table holds them (chunk c
// is columns [c*H, (c+1)*H) of each K*H-wide row). kAdalnChunkOrders lists
// every order detdit knows, by name:
//   h3                          shift_msa scale_msa gate_msa shift_mlp scale_mlp gate_mlp
//                               (rows ti*3 + modality of the (T, 18H) table)
//   ada_layer_norm_zero         the same six (SD3, Flux and HunyuanVideo double
//                               blocks, Qwen-Image, LTX-Video blocks)
//   sd35_ada_layer_norm_zero_x  the six, then shift_msa2 scale_msa2 gate_msa2
//   ada_layer_norm_zero_single  shift scale gate
//   ada_layer_norm_continuous   scale shift (SD3, Flux, HunyuanVideo, Qwen-Image norm_out)
//   ada_layer_norm              shift scale (CogVideoX's norm_out, chunk_dim 1)
//   cogvideox_layer_norm_zero   shift scale gate enc_shift enc_scale enc_gate
//   wan_block                   shift scale gate c_shift c_scale c_gate
//   scale_shift_table_final     shift scale (Wan's and LTX-Video's final table)
constexpr int kMaxAdalnChunks = 9;
struct AdalnChunkOrder {
  const char* name;
  int count;
  const char* chunks[kMaxAdalnChunks];
};
extern const AdalnChunkOrder kAdalnChunkOrders[];
extern const int kNumAdalnChunkOrders;
// The order called `name`; a ValueError listing the known names otherwise.
Status adaln_chunk_order(const std::string& name, const AdalnChunkOrder** order);
// The index of chunk `chunk_name` in `order`; an IndexError otherwise.
Status adaln_chunk_index(const AdalnChunkOrder& order, const std::string& chunk_name, int* chunk);

// Chunk c of a table of `chunks` chunks per row: table (rows, W) contiguous,
// W a positive multiple of chunks * hidden, viewed as (rows * W / (chunks*H),
// chunks*H) -> the (rows * W / (chunks*H), H) column block c (row stride
// chunks*H, unit column stride). A (T, K*H) projection gives (T, H) views; H3's
// (T, 18H) table with chunks 6 gives the (3T, H) views of the overload above.
Status adaln_table_chunk(const TensorView& table, int64_t hidden, int chunks, int chunk, TensorView* view);

// What the forward and the backward both read (bias only feeds the forward).
struct AdalnProjectionInputs {
  TensorView temb;    // (T, D) fp32 (chunks > 0: or weight's dtype)
  TensorView weight;  // (N, D) bf16 or fp32, N a multiple of 18 (18H for H3); chunks > 0: of chunks
  TensorView bias;    // (N,) weight's dtype (forward only)
  Numerics numerics = Numerics::kPortable;
  // 0: H3's projection (N a positive multiple of 18, temb fp32). > 0: a
  // family's projection of `chunks` chunks (its AdalnChunkOrder's count),
  // N a positive multiple of it, temb fp32 or weight's dtype.
  int chunks = 0;
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
  TensorView d_temb;         // (T, D) fp32 (also for a bf16 temb), or absent
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

// adaln_table_add: Wan's and LTX-Video's modulation, a learned table plus the
// projection of the time embedding, as eager computes `table + proj` with
// broadcasting: out[t, k, h] = R_out(rn(table[k, h] + proj[t, k', h])), k' = k
// (proj (T, K, H)) or 0 (proj (T, 1, H): the final layers' time embedding
// broadcast over the K chunks). out's dtype is torch's promotion of table's
// and proj's: their dtype when they share it, else fp32.
struct AdalnTableAddParams {
  TensorView table;  // (K, H) fp32/bf16/fp16, contiguous
  TensorView proj;   // (T, K, H) or (T, 1, H) fp32/bf16/fp16, contiguous (a (T, K*H) projection viewed so)
  TensorView out;    // (T, K, H) the promoted dtype, contiguous
};
Status adaln_table_add_forward(const AdalnTableAddParams& params, Stream stream = nullptr);

// d_proj[t, k', h] = R_proj(g) with g = grad[t, k, h] (proj (T, K, H)) or the
// ascending chain from +0.0 over k of grad[t, k, h] (proj (T, 1, H));
// d_table[k, h] = the canonical cross-row reduction (numerics 6.5, one chunk
// partial per 256 rows, no index) over t of grad[t, k, h], rounded once.
struct AdalnTableAddBackwardParams {
  TensorView grad;     // (T, K, H) fp32/bf16/fp16 (out's dtype), contiguous
  TensorView d_table;  // (K, H) fp32 or the table's dtype, contiguous, or absent
  TensorView d_proj;   // (T, K, H) or (T, 1, H) the proj's dtype, contiguous, or absent
};
Status adaln_table_add_backward(const AdalnTableAddBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
