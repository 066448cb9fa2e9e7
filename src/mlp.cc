// The two-layer SiLU MLP (src/common/mlp.h): validation and the sequence of
// public linear ops, the backends' upcast and silu_cast, and silu_backward.
// Nothing is written on error: validation never reads device memory, and the
// run functions take every scratch tensor before their first write.
#include "common/mlp.h"

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/linear.h"

namespace detdit {
namespace mlp {
namespace {

using Named = std::pair<TensorView, std::string>;
using NamedList = std::initializer_list<Named>;

// x's dtype is the MLP's: fp32 or bf16, the dtypes linear reads.
Status check_mlp_dtype(const TensorView& x, const std::string& name) {
  if (x.dtype == DType::kF32 || x.dtype == DType::kBF16) return Status();
  return Status::type_error(name + " must be float32 or bfloat16 (the dtypes linear computes in), got " +
                            dtype_name(x.dtype));
}

// An operand in `dtype` (x's, or fp32 where the op allows it), contiguous,
// 16-byte aligned (they feed linear), on x's device.
Status check_operand(const TensorView& t, const std::string& name, const TensorView& x, const std::string& x_name,
                     std::initializer_list<DType> dtypes, std::initializer_list<int64_t> dims, const char* layout) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name.c_str()));
  bool allowed = false;
  for (DType d : dtypes) allowed = allowed || t.dtype == d;
  if (!allowed) {
    const std::string either = dtypes.size() > 1 && x.dtype != DType::kF32 ? "float32 or " : "";
    return Status::type_error(name + " must be " + either + dtype_name(x.dtype) + " like " + x_name +
                              " (one MLP runs in one dtype), got " + dtype_name(t.dtype));
  }
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name.c_str(), x, x_name.c_str()));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name.c_str(), dims, layout));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name.c_str()));
  return check::aligned(t, name.c_str(), 16, "linear reads its rows as 16-byte vectors");
}

Status check_optional(const TensorView& t, const std::string& name, const TensorView& x, const std::string& x_name,
                      std::initializer_list<DType> dtypes, std::initializer_list<int64_t> dims, const char* layout) {
  return t.present() ? check_operand(t, name, x, x_name, dtypes, dims, layout) : Status();
}

// x (R, K) with R >= 1 and K, H multiples of the 16-byte vector width.
Status check_sizes(const TensorView& x, const TensorView& w1, const Names& names) {
  if (x.rank != 2 || x.shape[0] < 1)
    return Status::value_error(names.x + " must be a non-empty (T, K) matrix, got " + x.describe());
  const int64_t width = 16 / static_cast<int64_t>(dtype_size(x.dtype));
  for (auto [size, name] : {std::pair<int64_t, std::string>{x.shape[1], "K = " + names.x + ".shape[1]"},
                            {w1.shape[0], "H = " + names("w1") + ".shape[0]"}})
    if (size % width != 0)
      return Status::value_error(name + " = " + std::to_string(size) + " must be a multiple of " +
                                 std::to_string(width) + " (" + dtype_name(x.dtype) +
                                 " elements per 16-byte vector load)");
  return Status();
}

// The start both validations share: x, w1, w2 present; x (R, K) in an MLP
// dtype and w1 (H, K) well formed; the numerics available on x's device.
Status check_input(const Operands& in, Numerics numerics, const Names& names) {
  DETDIT_RETURN_IF_ERROR(check::present(in.x, names.x.c_str()));
  DETDIT_RETURN_IF_ERROR(check::present(in.w1, names("w1").c_str()));
  DETDIT_RETURN_IF_ERROR(check::present(in.w2, names("w2").c_str()));
  DETDIT_RETURN_IF_ERROR(check_mlp_dtype(in.x, names.x));
  DETDIT_RETURN_IF_ERROR(check_operand(in.x, names.x, in.x, names.x, {in.x.dtype}, {-1, -1}, "(T, K)"));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(numerics, in.x.device));
  return check_operand(in.w1, names("w1"), in.x, names.x, {in.x.dtype}, {-1, in.x.shape[1]}, "(H, K)");
}

}  // namespace

Status validate_forward(const Operands& in, const Outputs& out, Numerics numerics, const Names& names) {
  DETDIT_RETURN_IF_ERROR(check_input(in, numerics, names));
  const TensorView& x = in.x;
  const DType dtype = x.dtype;
  const int64_t rows = x.shape[0], hidden = in.w1.shape[0], out_features = in.w2.shape[0];
  DETDIT_RETURN_IF_ERROR(check_operand(in.b1, names("b1"), x, names.x, {dtype}, {hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(check_operand(in.w2, names("w2"), x, names.x, {dtype}, {-1, hidden}, "(D, H)"));
  DETDIT_RETURN_IF_ERROR(check_operand(in.b2, names("b2"), x, names.x, {dtype}, {out_features}, "(D,)"));
  DETDIT_RETURN_IF_ERROR(check_sizes(x, in.w1, names));
  DETDIT_RETURN_IF_ERROR(check_operand(out.out, names.out, x, names.x, {dtype}, {rows, out_features}, "(T, D)"));
  DETDIT_RETURN_IF_ERROR(check_optional(out.pre, names("pre"), x, names.x, {dtype}, {rows, hidden}, "(T, H)"));
  DETDIT_RETURN_IF_ERROR(check_optional(out.hidden, names("hidden"), x, names.x, {dtype}, {rows, hidden}, "(T, H)"));
  const NamedList outputs{{out.out, names.out}, {out.pre, names("pre")}, {out.hidden, names("hidden")}};
  for (const Named* o = outputs.begin(); o != outputs.end(); ++o) {
    for (const auto& [t, name] : NamedList{{in.x, names.x}, {in.w1, names("w1")}, {in.b1, names("b1")},
                                           {in.w2, names("w2")}, {in.b2, names("b2")}})
      DETDIT_RETURN_IF_ERROR(check::no_alias(o->first, o->second.c_str(), t, name.c_str()));
    for (const Named* other = o + 1; other != outputs.end(); ++other)
      DETDIT_RETURN_IF_ERROR(check::no_alias(o->first, o->second.c_str(), other->first, other->second.c_str()));
  }
  return Status();
}

Status validate_backward(const Operands& in, const Gradients& g, Numerics numerics, const Names& names) {
  DETDIT_RETURN_IF_ERROR(check_input(in, numerics, names));
  const TensorView& x = in.x;
  const DType dtype = x.dtype, f32 = DType::kF32;
  const int64_t rows = x.shape[0], in_features = x.shape[1];
  const int64_t hidden = in.w1.shape[0], out_features = in.w2.shape[0];
  const std::string grad_name = "grad_" + names.out, d_x_name = "d_" + names.x;
  DETDIT_RETURN_IF_ERROR(check_operand(in.w2, names("w2"), x, names.x, {dtype}, {-1, hidden}, "(D, H)"));
  DETDIT_RETURN_IF_ERROR(check_sizes(x, in.w1, names));
  DETDIT_RETURN_IF_ERROR(check_operand(g.pre, names("pre"), x, names.x, {dtype}, {rows, hidden}, "(T, H)"));
  DETDIT_RETURN_IF_ERROR(check_operand(g.hidden, names("hidden"), x, names.x, {dtype}, {rows, hidden}, "(T, H)"));
  DETDIT_RETURN_IF_ERROR(check_operand(g.grad_out, grad_name, x, names.x, {f32, dtype}, {rows, out_features}, "(T, D)"));
  DETDIT_RETURN_IF_ERROR(check_optional(g.d_x, d_x_name, x, names.x, {f32, dtype}, {rows, in_features}, "(T, K)"));
  DETDIT_RETURN_IF_ERROR(
      check_optional(g.d_w1, "d_" + names("w1"), x, names.x, {f32, dtype}, {hidden, in_features}, "(H, K)"));
  DETDIT_RETURN_IF_ERROR(check_optional(g.d_b1, "d_" + names("b1"), x, names.x, {f32, dtype}, {hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(
      check_optional(g.d_w2, "d_" + names("w2"), x, names.x, {f32, dtype}, {out_features, hidden}, "(D, H)"));
  DETDIT_RETURN_IF_ERROR(check_optional(g.d_b2, "d_" + names("b2"), x, names.x, {f32, dtype}, {out_features}, "(D,)"));
  const NamedList outputs{{g.d_x, d_x_name},           {g.d_w1, "d_" + names("w1")}, {g.d_b1, "d_" + names("b1")},
                          {g.d_w2, "d_" + names("w2")}, {g.d_b2, "d_" + names("b2")}};
  for (const Named* out = outputs.begin(); out != outputs.end(); ++out) {
    for (const auto& [t, name] : NamedList{{x, names.x}, {in.w1, names("w1")}, {in.w2, names("w2")},
                                           {g.pre, names("pre")}, {g.hidden, names("hidden")}, {g.grad_out, grad_name}})
      DETDIT_RETURN_IF_ERROR(check::no_alias(out->first, out->second.c_str(), t, name.c_str()));
    for (const Named* other = out + 1; other != outputs.end(); ++other)
      DETDIT_RETURN_IF_ERROR(check::no_alias(out->first, out->second.c_str(), other->first, other->second.c_str()));
  }
  return Status();
}

Status prepare_forward(const Operands& in, const Outputs& out, Stream stream, ForwardScratch* scratch) {
  const Device device = in.x.device;
  const DType dtype = in.x.dtype;
  const int64_t rows = in.x.shape[0], hidden_size = in.w1.shape[0];
  // hidden feeds the second linear; in bf16, pre feeds the SiLU and its FP32
  // widening is silu_cast's input.
  scratch->out = out;
  if (!out.hidden.present())
    DETDIT_RETURN_IF_ERROR(
        scratch_tensor(device, dtype, {rows, hidden_size}, stream, &scratch->owners[0], &scratch->out.hidden));
  if (dtype == DType::kF32) return Status();
  if (!out.pre.present())
    DETDIT_RETURN_IF_ERROR(
        scratch_tensor(device, dtype, {rows, hidden_size}, stream, &scratch->owners[1], &scratch->out.pre));
  return scratch_tensor(device, DType::kF32, {rows, hidden_size}, stream, &scratch->owners[2], &scratch->pre_f32);
}

Status run_forward(const Operands& in, const ForwardScratch& scratch, Numerics numerics, Stream stream) {
  const Device device = in.x.device;
  const Outputs& out = scratch.out;
  LinearParams first;
  first.x = in.x;
  first.weight = in.w1;
  first.bias = in.b1;
  first.numerics = numerics;
  if (in.x.dtype == DType::kF32) {
    // Every R is the identity: the SiLU epilogue of the same linear gives the same bits.
    first.out = out.hidden;
    first.pre_activation = out.pre;
    first.activation = Activation::kSilu;
    DETDIT_RETURN_IF_ERROR(linear_forward(first, stream));
  } else {
    // Eager rounds the linear's result before the SiLU reads it.
    first.out = out.pre;
    DETDIT_RETURN_IF_ERROR(linear_forward(first, stream));
    DETDIT_RETURN_IF_ERROR(backend::upcast_to_f32(device, out.pre, scratch.pre_f32, stream));
    DETDIT_RETURN_IF_ERROR(backend::silu_cast(device, scratch.pre_f32, out.hidden, numerics, stream));
  }
  LinearParams second;
  second.x = out.hidden;
  second.weight = in.w2;
  second.bias = in.b2;
  second.out = out.out;
  second.numerics = numerics;
  return linear_forward(second, stream);
}

Status forward(const Operands& in, const Outputs& out, Numerics numerics, Stream stream) {
  ForwardScratch scratch;
  DETDIT_RETURN_IF_ERROR(prepare_forward(in, out, stream, &scratch));
  return run_forward(in, scratch, numerics, stream);
}

Status prepare_backward(const Operands& in, const Gradients& g, Stream stream, BackwardScratch* s) {
  const Device device = in.x.device;
  const DType f32 = DType::kF32;
  const int64_t rows = in.x.shape[0], in_features = in.x.shape[1];
  const int64_t hidden_size = in.w1.shape[0], out_features = in.w2.shape[0];
  const bool need_d_pre = g.d_x.present() || g.d_w1.present() || g.d_b1.present();
  s->g = g;
  if (!need_d_pre && !g.d_w2.present() && !g.d_b2.present()) return Status();
  // The FP32 widenings of a bf16 grad_out and pre; d_hidden, d_pre (T, H)
  // FP32; the d_x chunk partials of both linears.
  if (g.grad_out.dtype != f32)
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, f32, {rows, out_features}, stream, &s->owners[0], &s->grad_f32));
  if (!need_d_pre) return Status();
  const int64_t hidden_chunks = (out_features + kLinearChunkRows - 1) / kLinearChunkRows;
  if (g.pre.dtype != f32)
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, f32, {rows, hidden_size}, stream, &s->owners[1], &s->pre_f32));
  DETDIT_RETURN_IF_ERROR(scratch_tensor(device, f32, {rows, hidden_size}, stream, &s->owners[2], &s->d_hidden));
  DETDIT_RETURN_IF_ERROR(scratch_tensor(device, f32, {rows, hidden_size}, stream, &s->owners[3], &s->d_pre));
  DETDIT_RETURN_IF_ERROR(scratch_tensor(device, f32, {hidden_chunks, rows, hidden_size}, stream, &s->owners[4],
                                        &s->hidden_partials));
  if (!g.d_x.present()) return Status();
  const int64_t x_chunks = (hidden_size + kLinearChunkRows - 1) / kLinearChunkRows;
  return scratch_tensor(device, f32, {x_chunks, rows, in_features}, stream, &s->owners[5], &s->x_partials);
}

Status run_backward(const Operands& in, const BackwardScratch& s, Numerics numerics, Stream stream) {
  const Device device = in.x.device;
  const Gradients& g = s.g;
  const bool need_d_pre = g.d_x.present() || g.d_w1.present() || g.d_b1.present();
  if (!need_d_pre && !g.d_w2.present() && !g.d_b2.present()) return Status();
  TensorView grad = g.grad_out;
  if (s.grad_f32.present()) {
    DETDIT_RETURN_IF_ERROR(backend::upcast_to_f32(device, g.grad_out, s.grad_f32, stream));
    grad = s.grad_f32;
  }
  // 1. dW2, db2 = linear d_W / d_b (g, hidden)
  LinearBackwardWeightParams second_weight;
  second_weight.grad = grad;
  second_weight.x = g.hidden;
  second_weight.d_weight = g.d_w2;
  second_weight.d_bias = g.d_b2;
  if (!need_d_pre) return linear_backward_weight(second_weight, stream);
  // 2. d_hidden = linear d_x (g, W2), FP32 (with step 1: one read of W2 on CUDA)
  LinearBackwardInputParams second_input;
  second_input.grad = grad;
  second_input.weight = in.w2;
  second_input.partials = s.hidden_partials;
  second_input.d_x = s.d_hidden;
  DETDIT_RETURN_IF_ERROR(linear_backward_weight_and_input(second_weight, second_input, stream));
  // 3. d_pre = silu_backward(d_hidden, pre), at the pre the SiLU read (the rounded one in bf16)
  TensorView pre = g.pre;
  if (s.pre_f32.present()) {
    DETDIT_RETURN_IF_ERROR(backend::upcast_to_f32(device, g.pre, s.pre_f32, stream));
    pre = s.pre_f32;
  }
  SiluBackwardParams silu;
  silu.grad = s.d_hidden;
  silu.pre = pre;
  silu.d_pre = s.d_pre;
  silu.numerics = numerics;
  DETDIT_RETURN_IF_ERROR(silu_backward(silu, stream));
  // 4. dW1, db1 = linear d_W / d_b (d_pre, x)
  LinearBackwardWeightParams first_weight;
  first_weight.grad = s.d_pre;
  first_weight.x = in.x;
  first_weight.d_weight = g.d_w1;
  first_weight.d_bias = g.d_b1;
  if (!g.d_x.present()) return linear_backward_weight(first_weight, stream);
  // 5. d_x = linear d_x (d_pre, W1) (with step 4: one read of W1 on CUDA)
  LinearBackwardInputParams first_input;
  first_input.grad = s.d_pre;
  first_input.weight = in.w1;
  first_input.partials = s.x_partials;
  first_input.d_x = g.d_x;
  return linear_backward_weight_and_input(first_weight, first_input, stream);
}

Status backward(const Operands& in, const Gradients& g, Numerics numerics, Stream stream) {
  BackwardScratch scratch;
  DETDIT_RETURN_IF_ERROR(prepare_backward(in, g, stream, &scratch));
  return run_backward(in, scratch, numerics, stream);
}

}  // namespace mlp
}  // namespace detdit
