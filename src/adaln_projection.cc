// Public entry points of adaln_projection, adaln_table_chunk and the AdaLN
// chunk orders (include/detdit/adaln.h), and the projection helper shared with
// adaln_modulation and final_adaln_out (src/common/projection.h).
// The projection is composed from the backends' silu_cast and the public
// linear ops, so its arithmetic is exactly numerics 5.4 / 6.4.
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "common/backends.h"
#include "common/projection.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/adaln.h"
#include "detdit/linear.h"

namespace detdit {
namespace {

using Named = std::pair<TensorView, const char*>;
using NamedList = std::initializer_list<Named>;

constexpr int64_t kTableColumnsPerHidden = 3 * kAdalnChunks;  // 3 modalities x 6 chunks

// temb (T, D) fp32, T >= 1, contiguous. A family's projection
// (temb_in_weight_dtype) checks the dtype after the weight's
// (check_family_temb): it may also be the weight's.
Status check_temb(const TensorView& temb, bool temb_in_weight_dtype) {
  DETDIT_RETURN_IF_ERROR(check::present(temb, "temb"));
  if (!temb_in_weight_dtype && temb.dtype != DType::kF32)
    return Status::type_error(std::string("temb must be float32 (the SiLU runs before the cast), got ") +
                              dtype_name(temb.dtype));
  if (temb.rank != 2 || temb.shape[0] < 1)
    return Status::value_error("temb must be a non-empty (T, D) matrix, got " + temb.describe());
  return check::contiguous(temb, "temb");
}

Status check_family_temb(const TensorView& temb, const TensorView& weight) {
  if (temb.dtype == DType::kF32 || temb.dtype == weight.dtype) return Status();
  return Status::type_error(std::string("temb must be float32 or weight's dtype (") + dtype_name(weight.dtype) +
                            "), got " + dtype_name(temb.dtype));
}

// A bf16 temb's exact FP32 copy in scratch (the SiLU and its VJP read FP32);
// an FP32 temb as it is.
Status fp32_temb(const TensorView& temb, Stream stream, std::shared_ptr<void>* owner, TensorView* out) {
  if (temb.dtype == DType::kF32) {
    *out = temb;
    return Status();
  }
  DETDIT_RETURN_IF_ERROR(scratch_tensor(temb.device, DType::kF32, {temb.shape[0], temb.shape[1]}, stream, owner, out));
  return backend::upcast_to_f32(temb.device, temb, *out, stream);
}

// weight (N, D) bf16/fp32, contiguous, 16-byte aligned, D a multiple of the vector width.
Status check_weight(const TensorView& weight, const TensorView& temb) {
  DETDIT_RETURN_IF_ERROR(check::present(weight, "weight"));
  DETDIT_RETURN_IF_ERROR(check::same_device(weight, "weight", temb, "temb"));
  DETDIT_RETURN_IF_ERROR(check::dtype(weight, "weight", {DType::kBF16, DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check::shape(weight, "weight", {-1, temb.shape[1]}, "(N, D) with temb's D"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(weight, "weight"));
  DETDIT_RETURN_IF_ERROR(check::aligned(weight, "weight", 16, "its rows are read as 16-byte vectors"));
  const int64_t width = 16 / static_cast<int64_t>(dtype_size(weight.dtype));
  if (weight.shape[1] % width != 0)
    return Status::value_error("D = " + std::to_string(weight.shape[1]) + " must be a multiple of " +
                               std::to_string(width) + " (" + dtype_name(weight.dtype) +
                               " elements per 16-byte vector load)");
  return Status();
}

// An optional tensor of `dims` in weight's dtype (or fp32 where fp32_ok), contiguous.
Status check_like_weight(const TensorView& t, const char* name, const TensorView& weight,
                         std::initializer_list<int64_t> dims, const char* layout, bool fp32_ok) {
  if (!t.present()) return Status();
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, weight, "weight"));
  if (!(fp32_ok && t.dtype == DType::kF32)) DETDIT_RETURN_IF_ERROR(check::same_dtype(t, name, weight, "weight"));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, dims, layout));
  return check::contiguous(t, name);
}

// chunks 0: H3's (18H, D); chunks > 0: a family's (chunks * H, D).
Status check_table_rows(const TensorView& weight, int chunks) {
  if (chunks < 0)
    return Status::value_error("chunks must be 0 (H3's projection) or a family's positive chunk count, got " +
                               std::to_string(chunks));
  if (chunks == 0) {
    if (weight.shape[0] > 0 && weight.shape[0] % kTableColumnsPerHidden == 0) return Status();
    return Status::value_error("AdaLN weight must be (6 * H * 3, D); got " + weight.shape_string() +
                               ", whose first dim is not a positive multiple of 18");
  }
  if (weight.shape[0] > 0 && weight.shape[0] % chunks == 0) return Status();
  return Status::value_error("AdaLN weight must be (" + std::to_string(chunks) + " * H, D) for " +
                             std::to_string(chunks) + " chunks; got " + weight.shape_string() +
                             ", whose first dim is not a positive multiple of " + std::to_string(chunks));
}

int64_t chunk_count(int64_t out_features) { return (out_features + kLinearChunkRows - 1) / kLinearChunkRows; }

}  // namespace

Status validate_projection_forward(const TensorView& temb, const TensorView& weight, const TensorView& bias,
                                   const TensorView& table, const TensorView& act, Numerics numerics,
                                   bool temb_in_weight_dtype) {
  DETDIT_RETURN_IF_ERROR(check_temb(temb, temb_in_weight_dtype));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(numerics, temb.device));
  DETDIT_RETURN_IF_ERROR(check_weight(weight, temb));
  if (temb_in_weight_dtype) DETDIT_RETURN_IF_ERROR(check_family_temb(temb, weight));
  const int64_t rows = temb.shape[0], in_features = temb.shape[1], out_features = weight.shape[0];
  // Every AdaLN projection of H3 has a bias (adaln.h): an absent one is a
  // caller's mistake, not a zero bias.
  DETDIT_RETURN_IF_ERROR(check::present(bias, "bias"));
  if (bias.dtype != weight.dtype)
    return Status::type_error(std::string("weight/bias must share a dtype (bfloat16 or float32), got ") +
                              dtype_name(weight.dtype) + "/" + dtype_name(bias.dtype));
  DETDIT_RETURN_IF_ERROR(check_like_weight(bias, "bias", weight, {out_features}, "(N,)", false));
  DETDIT_RETURN_IF_ERROR(check::present(table, "table"));
  DETDIT_RETURN_IF_ERROR(check_like_weight(table, "table", weight, {rows, out_features}, "(T, N)", false));
  DETDIT_RETURN_IF_ERROR(check_like_weight(act, "act", weight, {rows, in_features}, "(T, D)", false));
  // act is linear's x: its rows are read as 16-byte vectors.
  if (act.present()) DETDIT_RETURN_IF_ERROR(check::aligned(act, "act", 16, "its rows are read as 16-byte vectors"));
  for (auto [in, in_name] : NamedList{{temb, "temb"}, {weight, "weight"}, {bias, "bias"}}) {
    DETDIT_RETURN_IF_ERROR(check::no_alias(table, "table", in, in_name));
    DETDIT_RETURN_IF_ERROR(check::no_alias(act, "act", in, in_name));
  }
  return check::no_alias(act, "act", table, "table");
}

Status projection_forward(const TensorView& temb, const TensorView& weight, const TensorView& bias,
                          const TensorView& table, const TensorView& act, Numerics numerics, Stream stream) {
  const Device device = temb.device;
  TensorView activation = act, temb32;
  std::shared_ptr<void> scratch, temb_owner;
  if (!activation.present())
    DETDIT_RETURN_IF_ERROR(
        scratch_tensor(device, weight.dtype, {temb.shape[0], temb.shape[1]}, stream, &scratch, &activation));
  DETDIT_RETURN_IF_ERROR(fp32_temb(temb, stream, &temb_owner, &temb32));
  // act = R_W(silu_P(temb)): FP32 SiLU, then one cast (the declared boundary).
  DETDIT_RETURN_IF_ERROR(backend::silu_cast(device, temb32, activation, numerics, stream));
  LinearParams linear;
  linear.x = activation;
  linear.weight = weight;
  linear.bias = bias;
  linear.out = table;
  linear.numerics = numerics;
  return linear_forward(linear, stream);
}

Status validate_projection_backward(const TensorView& temb, const TensorView& weight, const TensorView& act,
                                    const TensorView& grad_table, const TensorView& d_temb,
                                    const TensorView& d_weight, const TensorView& d_bias, Numerics numerics,
                                    bool temb_in_weight_dtype) {
  DETDIT_RETURN_IF_ERROR(check_temb(temb, temb_in_weight_dtype));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(numerics, temb.device));
  DETDIT_RETURN_IF_ERROR(check_weight(weight, temb));
  if (temb_in_weight_dtype) DETDIT_RETURN_IF_ERROR(check_family_temb(temb, weight));
  const int64_t rows = temb.shape[0], in_features = temb.shape[1], out_features = weight.shape[0];
  DETDIT_RETURN_IF_ERROR(check::present(act, "act"));
  DETDIT_RETURN_IF_ERROR(check_like_weight(act, "act", weight, {rows, in_features}, "(T, D)", false));
  // Absent: the fused ops' own FP32 (T, N) scratch (check_like_weight passes it).
  DETDIT_RETURN_IF_ERROR(
      check_like_weight(grad_table, "grad_table", weight, {rows, out_features}, "(T, N)", true));
  if (d_temb.present()) {
    DETDIT_RETURN_IF_ERROR(check::same_device(d_temb, "d_temb", temb, "temb"));
    DETDIT_RETURN_IF_ERROR(check::dtype(d_temb, "d_temb", {DType::kF32}));
    DETDIT_RETURN_IF_ERROR(check::shape(d_temb, "d_temb", {rows, in_features}, "(T, D)"));
    DETDIT_RETURN_IF_ERROR(check::contiguous(d_temb, "d_temb"));
  }
  DETDIT_RETURN_IF_ERROR(check_like_weight(d_weight, "d_weight", weight, {out_features, in_features}, "(N, D)", false));
  DETDIT_RETURN_IF_ERROR(check_like_weight(d_bias, "d_bias", weight, {out_features}, "(N,)", false));
  const NamedList outputs{{d_temb, "d_temb"}, {d_weight, "d_weight"}, {d_bias, "d_bias"}};
  for (const Named* out = outputs.begin(); out != outputs.end(); ++out) {
    for (auto [in, in_name] : NamedList{{temb, "temb"}, {weight, "weight"}, {act, "act"}, {grad_table, "grad_table"}})
      DETDIT_RETURN_IF_ERROR(check::no_alias(out->first, out->second, in, in_name));
    for (const Named* other = out + 1; other != outputs.end(); ++other)
      DETDIT_RETURN_IF_ERROR(check::no_alias(out->first, out->second, other->first, other->second));
  }
  return Status();
}

Status projection_backward(const TensorView& temb, const TensorView& weight, const TensorView& act,
                           const TensorView& grad_table, const TensorView& d_temb, const TensorView& d_weight,
                           const TensorView& d_bias, Numerics numerics, Stream stream) {
  const Device device = temb.device;
  const int64_t rows = temb.shape[0], in_features = temb.shape[1], out_features = weight.shape[0];
  // Scratch first, so an allocation failure writes nothing: the FP32 copy of a
  // bf16 grad_table, the d_x chunk partials, d_act (T, D) FP32 and a bf16
  // temb's FP32 copy.
  TensorView grad = grad_table, partials, d_act, temb32 = temb;
  std::shared_ptr<void> owners[4];
  if (grad_table.dtype != DType::kF32)
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {rows, out_features}, stream, &owners[0], &grad));
  if (d_temb.present()) {
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {chunk_count(out_features), rows, in_features},
                                          stream, &owners[1], &partials));
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {rows, in_features}, stream, &owners[2], &d_act));
    DETDIT_RETURN_IF_ERROR(fp32_temb(temb, stream, &owners[3], &temb32));
  }
  // g = fp32(grad_table): exact widening.
  if (grad_table.dtype != DType::kF32)
    DETDIT_RETURN_IF_ERROR(backend::upcast_to_f32(device, grad_table, grad, stream));
  LinearBackwardWeightParams weight_grads;
  weight_grads.grad = grad;
  weight_grads.x = act;
  weight_grads.d_weight = d_weight;
  weight_grads.d_bias = d_bias;
  if (!d_temb.present()) return linear_backward_weight(weight_grads, stream);
  // d_act stays FP32: the cast's VJP is the identity.
  LinearBackwardInputParams input_grad;
  input_grad.grad = grad;
  input_grad.weight = weight;
  input_grad.partials = partials;
  input_grad.d_x = d_act;
  DETDIT_RETURN_IF_ERROR(linear_backward_weight_and_input(weight_grads, input_grad, stream));
  SiluBackwardParams silu;
  silu.grad = d_act;
  silu.pre = temb32;
  silu.d_pre = d_temb;
  silu.numerics = numerics;
  return silu_backward(silu, stream);
}

Status adaln_table_chunk(const TensorView& table, int64_t hidden, int chunk, TensorView* view) {
  if (view == nullptr) return Status::value_error("view must be a non-null output pointer");
  DETDIT_RETURN_IF_ERROR(check::present(table, "table"));
  DETDIT_RETURN_IF_ERROR(check::rank(table, "table", 2, "(T, 18H) or (3T, 6H)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(table, "table"));
  if (hidden < 1) return Status::value_error("hidden must be positive, got " + std::to_string(hidden));
  if (chunk < 0 || chunk >= kAdalnChunks)
    return Status::index_error("chunk must be in [0, 6) (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, "
                               "gate_mlp), got " + std::to_string(chunk));
  const int64_t row_width = kAdalnChunks * hidden;  // one (timestep, modality) row: 6H
  const int64_t columns = table.shape[1];
  if (columns != 3 * row_width && columns != row_width)
    return Status::value_error("table must be (T, 18H) = (*, " + std::to_string(3 * row_width) + ") or (3T, 6H) = (*, " +
                               std::to_string(row_width) + ") for H = " + std::to_string(hidden) + ", got " +
                               table.describe());
  const int64_t rows = table.shape[0] * columns / row_width;  // 3T
  TensorView chunk_view = TensorView::strided(table.data, table.dtype, {rows, hidden}, {row_width, 1}, table.device);
  chunk_view.data = static_cast<char*>(table.data) + chunk * hidden * static_cast<int64_t>(dtype_size(table.dtype));
  *view = chunk_view;
  return Status();
}

// The chunk orders read from each family's modules (adaln.h lists them).
const AdalnChunkOrder kAdalnChunkOrders[] = {
    {"h3", 6, {"shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp"}},
    {"ada_layer_norm_zero", 6, {"shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp"}},
    {"sd35_ada_layer_norm_zero_x", 9,
     {"shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp", "shift_msa2", "scale_msa2",
      "gate_msa2"}},
    {"ada_layer_norm_zero_single", 3, {"shift", "scale", "gate"}},
    {"ada_layer_norm_continuous", 2, {"scale", "shift"}},
    {"ada_layer_norm", 2, {"shift", "scale"}},
    {"cogvideox_layer_norm_zero", 6, {"shift", "scale", "gate", "enc_shift", "enc_scale", "enc_gate"}},
    {"wan_block", 6, {"shift", "scale", "gate", "c_shift", "c_scale", "c_gate"}},
    {"scale_shift_table_final", 2, {"shift", "scale"}},
};
const int kNumAdalnChunkOrders = static_cast<int>(sizeof(kAdalnChunkOrders) / sizeof(kAdalnChunkOrders[0]));

Status adaln_chunk_order(const std::string& name, const AdalnChunkOrder** order) {
  if (order == nullptr) return Status::value_error("order must be a non-null output pointer");
  std::string known;
  for (const AdalnChunkOrder& o : kAdalnChunkOrders) {
    if (name == o.name) {
      *order = &o;
      return Status();
    }
    known += std::string(known.empty() ? "" : ", ") + o.name;
  }
  return Status::value_error("unknown AdaLN chunk order '" + name + "'; known: " + known);
}

Status adaln_chunk_index(const AdalnChunkOrder& order, const std::string& chunk_name, int* chunk) {
  if (chunk == nullptr) return Status::value_error("chunk must be a non-null output pointer");
  std::string known;
  for (int c = 0; c < order.count; ++c) {
    if (chunk_name == order.chunks[c]) {
      *chunk = c;
      return Status();
    }
    known += std::string(c ? ", " : "") + order.chunks[c];
  }
  return Status::index_error("the " + std::string(order.name) + " order has no chunk '" + chunk_name + "' (" + known +
                             ")");
}

Status adaln_table_chunk(const TensorView& table, int64_t hidden, int chunks, int chunk, TensorView* view) {
  if (view == nullptr) return Status::value_error("view must be a non-null output pointer");
  DETDIT_RETURN_IF_ERROR(check::present(table, "table"));
  DETDIT_RETURN_IF_ERROR(check::rank(table, "table", 2, "(rows, W), W a multiple of chunks * H"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(table, "table"));
  if (hidden < 1) return Status::value_error("hidden must be positive, got " + std::to_string(hidden));
  if (chunks < 1) return Status::value_error("chunks must be positive, got " + std::to_string(chunks));
  if (chunk < 0 || chunk >= chunks)
    return Status::index_error("chunk must be in [0, " + std::to_string(chunks) + "), got " + std::to_string(chunk));
  const int64_t row_width = chunks * hidden;  // one row of the family's chunks: K*H
  const int64_t columns = table.shape[1];
  if (columns < 1 || columns % row_width != 0)
    return Status::value_error("table's width must be a positive multiple of chunks * H = " +
                               std::to_string(row_width) + ", got " + table.describe());
  const int64_t rows = table.shape[0] * (columns / row_width);
  TensorView chunk_view = TensorView::strided(table.data, table.dtype, {rows, hidden}, {row_width, 1}, table.device);
  chunk_view.data = static_cast<char*>(table.data) + chunk * hidden * static_cast<int64_t>(dtype_size(table.dtype));
  *view = chunk_view;
  return Status();
}

Status adaln_projection_forward(const AdalnProjectionParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_projection_forward(params.in.temb, params.in.weight, params.in.bias, params.table,
                                                     params.act, params.in.numerics, params.in.chunks != 0));
  DETDIT_RETURN_IF_ERROR(check_table_rows(params.in.weight, params.in.chunks));
  return projection_forward(params.in.temb, params.in.weight, params.in.bias, params.table, params.act, params.in.numerics,
                            stream);
}

Status adaln_projection_backward(const AdalnProjectionBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check::present(params.grad_table, "grad_table"));
  DETDIT_RETURN_IF_ERROR(validate_projection_backward(params.in.temb, params.in.weight, params.act, params.grad_table,
                                                      params.d_temb, params.d_weight, params.d_bias,
                                                      params.in.numerics, params.in.chunks != 0));
  DETDIT_RETURN_IF_ERROR(check_table_rows(params.in.weight, params.in.chunks));
  return projection_backward(params.in.temb, params.in.weight, params.act, params.grad_table, params.d_temb,
                             params.d_weight, params.d_bias, params.in.numerics, stream);
}

}  // namespace detdit
