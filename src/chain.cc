// The conditioning chain (include/detdit/chain.h): the public ops composed in
// the order of the H3 model, forward then backward, on the tensors of one
// device. Between the ops only the internal elementwise helpers touch the
// data (add, copy_tensor, fill_zero: src/common/backends.h), so the same
// code runs on CPU and CUDA tensors and every step on CUDA is queued on the
// caller's stream.
#include "detdit/chain.h"

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/storage.h"
#include "common/validate.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/rmsnorm.h"
#include "detdit/timestep.h"
#include "rowwise/checks.h"

namespace detdit {
namespace {

// Scratch tensors of one call on the call's device and stream; all freed when
// the call returns (on CUDA stream-ordered, after the queued kernels).
class Scratch {
 public:
  Scratch(Device device, Stream stream) : device_(device), stream_(stream) {}
  Status make(DType dtype, std::initializer_list<int64_t> shape, TensorView* view) {
    owners_.emplace_back();
    return scratch_tensor(device_, dtype, shape, stream_, &owners_.back(), view);
  }

 private:
  Device device_;
  Stream stream_;
  std::vector<std::shared_ptr<void>> owners_;
};

// sum = R_T(rn(sum + term)) (numerics 5.10): the accumulation of two gradient
// paths (autograd's sum, one rounding).
Status accumulate(const TensorView& sum, const TensorView& term, Stream stream) {
  return backend::add(sum.device, sum, term, sum, stream);
}

// Row k of a (2L, M, H) stand-in tensor, as an (M, H) view.
TensorView sublayer(const TensorView& t, int64_t k) {
  TensorView v = t.narrow(0, k, 1);
  return TensorView::contiguous(v.data, v.dtype, {t.shape[1], t.shape[2]}, t.device);
}

using NamedTensor = std::pair<const TensorView*, std::string>;

// Every tensor of the call with its name, for the one-device check.
std::vector<NamedTensor> named_tensors(const ChainParams& p) {
  const ChainWeights& w = p.weights;
  const ChainGrads& g = p.grads;
  std::vector<NamedTensor> all = {
      {&p.timesteps, "timesteps"}, {&p.sublayer_out, "sublayer_out"}, {&p.sublayer_grad, "sublayer_grad"},
      {&p.grad_out, "grad_out"}, {&p.out, "out"}, {&w.mlp_w1, "weights.mlp_w1"}, {&w.mlp_b1, "weights.mlp_b1"},
      {&w.mlp_w2, "weights.mlp_w2"}, {&w.mlp_b2, "weights.mlp_b2"}, {&w.norm_out_weight, "weights.norm_out_weight"},
      {&w.out_weight, "weights.out_weight"}, {&w.out_bias, "weights.out_bias"}, {&g.d_timesteps, "grads.d_timesteps"},
      {&g.d_mlp_w1, "grads.d_mlp_w1"}, {&g.d_mlp_b1, "grads.d_mlp_b1"}, {&g.d_mlp_w2, "grads.d_mlp_w2"},
      {&g.d_mlp_b2, "grads.d_mlp_b2"}, {&g.d_norm_out_weight, "grads.d_norm_out_weight"},
      {&g.d_out_weight, "grads.d_out_weight"}, {&g.d_out_bias, "grads.d_out_bias"}, {&g.dx, "grads.dx"}};
  for (int64_t l = 0; l < w.num_blocks; ++l) {
    const std::string b = "weights.blocks[" + std::to_string(l) + "].", d = "grads.blocks[" + std::to_string(l) + "].";
    const ChainBlockWeights& bw = w.blocks[l];
    for (const auto& [t, name] : {NamedTensor{&bw.adaln_weight, "adaln_weight"}, NamedTensor{&bw.adaln_bias, "adaln_bias"},
                                  NamedTensor{&bw.norm1_weight, "norm1_weight"}, NamedTensor{&bw.norm2_weight, "norm2_weight"}})
      all.emplace_back(t, b + name);
    if (g.blocks == nullptr) continue;
    const ChainBlockGrads& bg = g.blocks[l];
    for (const auto& [t, name] : {NamedTensor{&bg.d_adaln_weight, "d_adaln_weight"}, NamedTensor{&bg.d_adaln_bias, "d_adaln_bias"},
                                  NamedTensor{&bg.d_norm1_weight, "d_norm1_weight"}, NamedTensor{&bg.d_norm2_weight, "d_norm2_weight"}})
      all.emplace_back(t, d + name);
  }
  return all;
}

// A present gradient output: its weight's shape, a dtype in `allowed`. Checked
// before the forward runs, because the op that writes it runs after others
// have written outputs. (An absent weight is reported by the forward op that
// reads it, before anything is written.)
Status check_grad(const TensorView& grad, const std::string& name, const TensorView& weight,
                  std::initializer_list<DType> allowed) {
  if (!grad.present() || !weight.present()) return Status();
  DETDIT_RETURN_IF_ERROR(check::dtype(grad, name.c_str(), allowed));
  bool same_shape = grad.rank == weight.rank;
  for (int d = 0; same_shape && d < grad.rank; ++d) same_shape = grad.shape[d] == weight.shape[d];
  if (!same_shape) return Status::value_error(name + " must be shaped like its weight " + weight.describe() + ", got " + grad.describe());
  return check::contiguous(grad, name.c_str());
}

Status check_grads(const ChainParams& p) {
  const ChainWeights& w = p.weights;
  const ChainGrads& g = p.grads;
  const DType x_dtype = p.x.dtype, f32 = DType::kF32;
  DETDIT_RETURN_IF_ERROR(check_grad(g.d_timesteps, "grads.d_timesteps", p.timesteps, {p.timesteps.dtype}));
  DETDIT_RETURN_IF_ERROR(check_grad(g.d_mlp_w1, "grads.d_mlp_w1", w.mlp_w1, {f32}));
  DETDIT_RETURN_IF_ERROR(check_grad(g.d_mlp_b1, "grads.d_mlp_b1", w.mlp_b1, {f32}));
  DETDIT_RETURN_IF_ERROR(check_grad(g.d_mlp_w2, "grads.d_mlp_w2", w.mlp_w2, {f32}));
  DETDIT_RETURN_IF_ERROR(check_grad(g.d_mlp_b2, "grads.d_mlp_b2", w.mlp_b2, {f32}));
  DETDIT_RETURN_IF_ERROR(check_grad(g.d_norm_out_weight, "grads.d_norm_out_weight", w.norm_out_weight, {x_dtype, f32}));
  DETDIT_RETURN_IF_ERROR(check_grad(g.d_out_weight, "grads.d_out_weight", w.out_weight, {w.out_weight.dtype}));
  DETDIT_RETURN_IF_ERROR(check_grad(g.d_out_bias, "grads.d_out_bias", w.out_bias, {w.out_weight.dtype}));
  for (int64_t l = 0; g.blocks != nullptr && l < w.num_blocks; ++l) {
    const ChainBlockWeights& bw = w.blocks[l];
    const ChainBlockGrads& bg = g.blocks[l];
    const std::string d = "grads.blocks[" + std::to_string(l) + "].";
    DETDIT_RETURN_IF_ERROR(check_grad(bg.d_adaln_weight, d + "d_adaln_weight", bw.adaln_weight, {bw.adaln_weight.dtype}));
    DETDIT_RETURN_IF_ERROR(check_grad(bg.d_adaln_bias, d + "d_adaln_bias", bw.adaln_bias, {bw.adaln_weight.dtype}));
    DETDIT_RETURN_IF_ERROR(check_grad(bg.d_norm1_weight, d + "d_norm1_weight", bw.norm1_weight, {x_dtype, f32}));
    DETDIT_RETURN_IF_ERROR(check_grad(bg.d_norm2_weight, d + "d_norm2_weight", bw.norm2_weight, {x_dtype, f32}));
  }
  return Status();
}

Status validate(const ChainParams& p, int64_t* hidden) {
  DETDIT_RETURN_IF_ERROR(check::present(p.x, "x"));
  const ChainWeights& w = p.weights;
  if (w.num_blocks < 0 || (w.num_blocks > 0 && w.blocks == nullptr))
    return Status::value_error("weights.blocks must hold num_blocks = " + std::to_string(w.num_blocks) + " blocks");
  // One device for everything: the ops in between would otherwise fail after
  // earlier ops have written outputs.
  for (const auto& [t, name] : named_tensors(p))
    if (t->present() && t->device != p.x.device)
      return Status::value_error("chain_forward_backward runs on CPU tensors or on CUDA tensors of one device, got x on " +
                                 p.x.device.to_string() + " and " + name + " on " + t->device.to_string());
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.numerics, p.x.device));
  DETDIT_RETURN_IF_ERROR(check::plan_on(p.adaln_plan, "adaln_plan", p.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::plan_on(p.timestep_plan, "timestep_plan", p.x, "x"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_rows(p.x, "x", &p.adaln_plan, hidden));
  if (p.timestep_plan.seq_len() != p.adaln_plan.seq_len() || p.timestep_plan.batch() != p.adaln_plan.batch() ||
      p.adaln_plan.num_rows() != 3 * p.timestep_plan.num_rows())
    return Status::value_error("timestep_plan must index the same (B, S) as adaln_plan with R = adaln R / 3, got (B, S, R) = (" +
                               std::to_string(p.timestep_plan.batch()) + ", " + std::to_string(p.timestep_plan.seq_len()) +
                               ", " + std::to_string(p.timestep_plan.num_rows()) + ") vs adaln (" +
                               std::to_string(p.adaln_plan.batch()) + ", " + std::to_string(p.adaln_plan.seq_len()) + ", " +
                               std::to_string(p.adaln_plan.num_rows()) + ")");
  const int64_t rows = p.x.numel() / *hidden;
  for (const auto& [t, name] : {std::make_pair(&p.sublayer_out, "sublayer_out"), std::make_pair(&p.sublayer_grad, "sublayer_grad")}) {
    DETDIT_RETURN_IF_ERROR(check::present(*t, name));
    DETDIT_RETURN_IF_ERROR(check::same_dtype(*t, name, p.x, "x"));
    DETDIT_RETURN_IF_ERROR(check::same_device(*t, name, p.x, "x"));
    DETDIT_RETURN_IF_ERROR(check::shape(*t, name, {2 * w.num_blocks, rows, *hidden}, "(2L, B*S, H)"));
    DETDIT_RETURN_IF_ERROR(check::contiguous(*t, name));
  }
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.grad_out, "grad_out", p.x, "x"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.out, "out", p.x, "x"));
  if (p.grads.dx.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.grads.dx, "grads.dx", p.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::present(w.mlp_w1, "weights.mlp_w1"));
  DETDIT_RETURN_IF_ERROR(check::rank(w.mlp_w1, "weights.mlp_w1", 2, "(Ht, F)"));
  DETDIT_RETURN_IF_ERROR(check::present(w.mlp_w2, "weights.mlp_w2"));
  DETDIT_RETURN_IF_ERROR(check::rank(w.mlp_w2, "weights.mlp_w2", 2, "(D, Ht)"));
  DETDIT_RETURN_IF_ERROR(check::present(p.timesteps, "timesteps"));
  if (p.timesteps.rank != 1 || p.timesteps.shape[0] != p.timestep_plan.num_rows())
    return Status::value_error("timesteps must be (T,) with T = timestep_plan.num_rows() = " +
                               std::to_string(p.timestep_plan.num_rows()) + ", got " + p.timesteps.describe());
  return check_grads(p);
}

}  // namespace

Status chain_forward_backward(const ChainParams& p, Stream stream) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(validate(p, &hidden));
  const ChainWeights& w = p.weights;
  const int64_t blocks = w.num_blocks, rows = p.x.numel() / hidden;
  const int64_t num_timesteps = p.timesteps.shape[0], frequencies = w.mlp_w1.shape[1];
  const int64_t mlp_hidden = w.mlp_w1.shape[0], embed = w.mlp_w2.shape[0];
  const DType dtype = p.x.dtype;
  Scratch scratch(p.x.device, stream);

  // ---- forward -----------------------------------------------------------
  TensorView features, temb, pre, mlp_act;
  DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {num_timesteps, frequencies}, &features));
  DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {num_timesteps, embed}, &temb));
  DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {num_timesteps, mlp_hidden}, &pre));
  DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {num_timesteps, mlp_hidden}, &mlp_act));
  // The range check (if asked for) happens here, before any output is written;
  // the backward reads the same timesteps and skips it.
  const TimestepSinusoidInputs sinusoid{p.timesteps, p.max_period, p.numerics, p.check_range};
  DETDIT_RETURN_IF_ERROR(timestep_sinusoid_forward({sinusoid, features}, stream));
  const TimestepMlpInputs mlp{features, w.mlp_w1, w.mlp_b1, w.mlp_w2, w.mlp_b2, p.numerics};
  DETDIT_RETURN_IF_ERROR(timestep_mlp_forward({mlp, temb, pre, mlp_act}, stream));

  // per block: x_l (x_0 = x), x' (between the halves), rstd of both norms, table and act
  std::vector<TensorView> x_in(blocks + 1), x_mid(blocks), rstd1(blocks), rstd2(blocks), table(blocks), act(blocks);
  std::vector<std::vector<TensorView>> chunks(blocks, std::vector<TensorView>(6));
  // the inputs of each block's ops, read again by their backwards
  std::vector<AdalnProjectionInputs> proj(blocks);
  std::vector<RmsnormInputs> norm1(blocks), norm2(blocks);
  std::vector<GateResidualInputs> gate1(blocks), gate2(blocks);
  x_in[0] = p.x;
  TensorView normed;
  DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {rows, hidden}, &normed));
  for (int64_t l = 0; l < blocks; ++l) {
    const ChainBlockWeights& b = w.blocks[l];
    DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {rows, hidden}, &x_mid[l]));
    DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {rows, hidden}, &x_in[l + 1]));
    DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {rows}, &rstd1[l]));
    DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {rows}, &rstd2[l]));
    DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {num_timesteps, 18 * hidden}, &table[l]));
    DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {num_timesteps, embed}, &act[l]));
    proj[l] = {temb, b.adaln_weight, b.adaln_bias, p.numerics};
    DETDIT_RETURN_IF_ERROR(adaln_projection_forward({proj[l], table[l], act[l]}, stream));
    for (int c = 0; c < 6; ++c) DETDIT_RETURN_IF_ERROR(adaln_table_chunk(table[l], hidden, c, &chunks[l][c]));
    const std::vector<TensorView>& m = chunks[l];  // shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
    norm1[l] = {x_in[l], b.norm1_weight, m[0], m[1], p.adaln_plan, p.eps, p.numerics};
    gate1[l] = {x_in[l], sublayer(p.sublayer_out, 2 * l), m[2], p.adaln_plan};
    norm2[l] = {x_mid[l], b.norm2_weight, m[3], m[4], p.adaln_plan, p.eps, p.numerics};
    gate2[l] = {x_mid[l], sublayer(p.sublayer_out, 2 * l + 1), m[5], p.adaln_plan};
    DETDIT_RETURN_IF_ERROR(rmsnorm_forward({norm1[l], normed, rstd1[l]}, stream));
    DETDIT_RETURN_IF_ERROR(gate_residual_forward({gate1[l], x_mid[l]}, stream));
    DETDIT_RETURN_IF_ERROR(rmsnorm_forward({norm2[l], normed, rstd2[l]}, stream));
    DETDIT_RETURN_IF_ERROR(gate_residual_forward({gate2[l], x_in[l + 1]}, stream));
  }
  TensorView final_table, final_act, final_rstd;
  DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {num_timesteps, 2 * hidden}, &final_table));
  DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {num_timesteps, embed}, &final_act));
  DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {rows}, &final_rstd));
  const FinalAdalnOutInputs final_inputs{x_in[blocks], w.norm_out_weight, temb, w.out_weight,
                                         w.out_bias, p.timestep_plan, p.eps, p.numerics};
  DETDIT_RETURN_IF_ERROR(final_adaln_out_forward({final_inputs, p.out, final_table, final_act, final_rstd}, stream));

  // ---- backward ----------------------------------------------------------
  TensorView grad, norm_dx;  // grad: d(x_l) being accumulated; norm_dx: a norm's dx
  DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {rows, hidden}, &grad));
  DETDIT_RETURN_IF_ERROR(scratch.make(dtype, {rows, hidden}, &norm_dx));
  std::vector<TensorView> d_temb_part(blocks + 1);  // blocks 0..L-1, then the final layer
  for (TensorView& d : d_temb_part) DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {num_timesteps, embed}, &d));
  const FinalAdalnOutBackwardParams final_back{
      final_inputs, final_table, final_act, final_rstd, p.grad_out, grad, p.grads.d_norm_out_weight,
      d_temb_part[blocks], p.grads.d_out_weight, p.grads.d_out_bias};
  DETDIT_RETURN_IF_ERROR(final_adaln_out_backward(final_back, stream));
  TensorView d_table;  // (T, 18H) FP32, one block at a time
  DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {num_timesteps, 18 * hidden}, &d_table));
  std::vector<TensorView> d_chunk(6);
  for (int c = 0; c < 6; ++c) DETDIT_RETURN_IF_ERROR(adaln_table_chunk(d_table, hidden, c, &d_chunk[c]));
  for (int64_t l = blocks - 1; l >= 0; --l) {
    const ChainBlockGrads* g = p.grads.blocks ? &p.grads.blocks[l] : nullptr;
    const TensorView none;
    // second half: x_{l+1} = x' + gate_mlp * ffn(norm2(x'))
    DETDIT_RETURN_IF_ERROR(gate_residual_backward({gate2[l], grad, none, none, d_chunk[5]}, stream));
    DETDIT_RETURN_IF_ERROR(rmsnorm_backward({norm2[l], rstd2[l], sublayer(p.sublayer_grad, 2 * l + 1), norm_dx,
                                             g ? g->d_norm2_weight : none, d_chunk[3], d_chunk[4]},
                                            stream));
    DETDIT_RETURN_IF_ERROR(accumulate(grad, norm_dx, stream));
    // first half: x' = x_l + gate_msa * attn(norm1(x_l))
    DETDIT_RETURN_IF_ERROR(gate_residual_backward({gate1[l], grad, none, none, d_chunk[2]}, stream));
    DETDIT_RETURN_IF_ERROR(rmsnorm_backward({norm1[l], rstd1[l], sublayer(p.sublayer_grad, 2 * l), norm_dx,
                                             g ? g->d_norm1_weight : none, d_chunk[0], d_chunk[1]},
                                            stream));
    DETDIT_RETURN_IF_ERROR(accumulate(grad, norm_dx, stream));
    DETDIT_RETURN_IF_ERROR(adaln_projection_backward({proj[l], act[l], d_table, d_temb_part[l],
                                                      g ? g->d_adaln_weight : none, g ? g->d_adaln_bias : none},
                                                     stream));
  }
  if (p.grads.dx.present()) DETDIT_RETURN_IF_ERROR(backend::copy_tensor(grad.device, grad, p.grads.dx, stream));

  // d_temb: ascending FP32 sum from +0.0 over blocks 0..L-1, then the final layer.
  TensorView d_temb;
  DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {num_timesteps, embed}, &d_temb));
  DETDIT_RETURN_IF_ERROR(backend::fill_zero(d_temb.device, d_temb, stream));
  for (const TensorView& part : d_temb_part) DETDIT_RETURN_IF_ERROR(accumulate(d_temb, part, stream));
  TensorView d_features;
  if (p.grads.d_timesteps.present()) DETDIT_RETURN_IF_ERROR(scratch.make(DType::kF32, {num_timesteps, frequencies}, &d_features));
  const TimestepMlpBackwardParams mlp_back{mlp, pre, mlp_act, d_temb, d_features, p.grads.d_mlp_w1, p.grads.d_mlp_b1,
                                           p.grads.d_mlp_w2, p.grads.d_mlp_b2};
  DETDIT_RETURN_IF_ERROR(timestep_mlp_backward(mlp_back, stream));
  if (!p.grads.d_timesteps.present()) return Status();
  TimestepSinusoidInputs checked = sinusoid;
  checked.check_range = false;  // the forward checked these timesteps
  return timestep_sinusoid_backward({checked, d_features, p.grads.d_timesteps}, stream);
}

Status chain_stand_ins(uint64_t seed, const TensorView& sublayer_out, const TensorView& sublayer_grad) {
  for (const auto& [t, name] : {std::make_pair(&sublayer_out, "sublayer_out"), std::make_pair(&sublayer_grad, "sublayer_grad")}) {
    DETDIT_RETURN_IF_ERROR(check::present(*t, name));
    DETDIT_RETURN_IF_ERROR(check::dtype(*t, name, {DType::kF32, DType::kBF16, DType::kF16}));
    DETDIT_RETURN_IF_ERROR(check::contiguous(*t, name));
    if (t->device.is_cuda()) return Status::value_error(std::string(name) + " must be a CPU tensor, got " + t->describe());
  }
  uint64_t state = seed;
  // splitmix64: a counter-based stream, identical on every platform
  auto next_uniform = [&state]() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;  // exact: 53-bit integer times 2^-53
  };
  auto fill = [&](const TensorView& t, double scale) {
    dispatch_float_dtype(t.dtype, [&](auto tag) {
      using T = decltype(tag);
      T* data = static_cast<T*>(t.data);
      for (int64_t i = 0; i < t.numel(); ++i) {
        double z = -6.0;
        for (int k = 0; k < 12; ++k) z += next_uniform();
        data[i] = from_float<T>(static_cast<float>(scale * z));
      }
    });
  };
  fill(sublayer_out, 3.0);
  fill(sublayer_grad, 1.0);
  return Status();
}

}  // namespace detdit
