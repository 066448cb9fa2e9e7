// Public entry points of combined_timestep_embedding
// (include/detdit/timestep.h): each MLP is the two-layer MLP of
// src/common/mlp.h (numerics 5.3, 6.3); the combined embedding sums them with
// the backends' add (numerics 5.3). Every MLP is validated and every scratch
// tensor taken before the first write, so nothing is written on error.
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/backends.h"
#include "common/mlp.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/timestep.h"

namespace detdit {
namespace {

using Named = std::pair<TensorView, std::string>;

mlp::Operands operands(const TensorView& x, const MlpWeights& w) { return {x, w.w1, w.b1, w.w2, w.b2}; }
mlp::Gradients gradients(const MlpSaved& saved, const TensorView& grad, const MlpGrads& d) {
  return {saved.pre, saved.hidden, grad, d.d_x, d.d_w1, d.d_b1, d.d_w2, d.d_b2};
}

const mlp::Names kTimestep{"timestep_features", "temb", "timestep."};
const mlp::Names kGuidance{"guidance_features", "temb", "guidance."};
const mlp::Names kText{"pooled", "temb", "text."};

// No output overlaps an input or another output (each MLP's validation
// checks its own; these are the pairs across the MLPs).
Status check_no_overlap(const std::vector<Named>& outputs, const std::vector<Named>& inputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (const auto& [t, name] : inputs)
      DETDIT_RETURN_IF_ERROR(check::no_alias(outputs[i].first, outputs[i].second.c_str(), t, name.c_str()));
    for (std::size_t j = i + 1; j < outputs.size(); ++j)
      DETDIT_RETURN_IF_ERROR(check::no_alias(outputs[i].first, outputs[i].second.c_str(), outputs[j].first,
                                             outputs[j].second.c_str()));
  }
  return Status();
}

std::vector<Named> weight_list(const MlpWeights& w, const std::string& prefix) {
  return {{w.w1, prefix + "w1"}, {w.b1, prefix + "b1"}, {w.w2, prefix + "w2"}, {w.b2, prefix + "b2"}};
}

// Without guidance_features, nothing of the guidance embedder may be given.
Status check_guidance_absent(const CombinedTimestepEmbeddingInputs& in, const std::vector<Named>& extra) {
  if (in.guidance_features.present()) return Status();
  std::vector<Named> given = weight_list(in.guidance, "guidance.");
  given.insert(given.end(), extra.begin(), extra.end());
  for (const auto& [t, name] : given)
    if (t.present())
      return Status::value_error(name + " is given without guidance_features (no guidance embedder: leave it absent)");
  return Status();
}

std::vector<Named> combined_inputs(const CombinedTimestepEmbeddingInputs& in) {
  std::vector<Named> inputs{{in.timestep_features, "timestep_features"},
                            {in.guidance_features, "guidance_features"},
                            {in.pooled, "pooled"}};
  for (const auto& [w, prefix] : {std::pair<const MlpWeights*, const char*>{&in.timestep, "timestep."},
                                  {&in.guidance, "guidance."},
                                  {&in.text, "text."}}) {
    const std::vector<Named> list = weight_list(*w, prefix);
    inputs.insert(inputs.end(), list.begin(), list.end());
  }
  return inputs;
}

std::vector<Named> saved_list(const CombinedTimestepEmbeddingParams& p) {
  return {{p.timestep_saved.pre, "timestep.pre"}, {p.timestep_saved.hidden, "timestep.hidden"},
          {p.guidance_saved.pre, "guidance.pre"}, {p.guidance_saved.hidden, "guidance.hidden"},
          {p.text_saved.pre, "text.pre"},         {p.text_saved.hidden, "text.hidden"}};
}

Status validate_combined(const CombinedTimestepEmbeddingParams& p) {
  const CombinedTimestepEmbeddingInputs& in = p.in;
  const std::vector<Named> saved = saved_list(p);
  DETDIT_RETURN_IF_ERROR(check_guidance_absent(in, {saved[2], saved[3]}));
  // temb is each MLP's out: one (B, D) shape, dtype and device for all three.
  DETDIT_RETURN_IF_ERROR(mlp::validate_forward(operands(in.timestep_features, in.timestep),
                                               {p.temb, p.timestep_saved.pre, p.timestep_saved.hidden}, in.numerics,
                                               kTimestep));
  if (in.guidance_features.present())
    DETDIT_RETURN_IF_ERROR(mlp::validate_forward(operands(in.guidance_features, in.guidance),
                                                 {p.temb, p.guidance_saved.pre, p.guidance_saved.hidden},
                                                 in.numerics, kGuidance));
  DETDIT_RETURN_IF_ERROR(mlp::validate_forward(operands(in.pooled, in.text),
                                               {p.temb, p.text_saved.pre, p.text_saved.hidden}, in.numerics, kText));
  std::vector<Named> outputs{{p.temb, "temb"}};
  outputs.insert(outputs.end(), saved.begin(), saved.end());
  return check_no_overlap(outputs, combined_inputs(in));
}

Status validate_combined_backward(const CombinedTimestepEmbeddingBackwardParams& p) {
  const CombinedTimestepEmbeddingInputs& in = p.in;
  const std::vector<Named> guidance_grads{{p.guidance_grads.d_x, "d_guidance_features"},
                                          {p.guidance_grads.d_w1, "d_guidance.w1"},
                                          {p.guidance_grads.d_b1, "d_guidance.b1"},
                                          {p.guidance_grads.d_w2, "d_guidance.w2"},
                                          {p.guidance_grads.d_b2, "d_guidance.b2"}};
  std::vector<Named> absent{{p.guidance_saved.pre, "guidance.pre"}, {p.guidance_saved.hidden, "guidance.hidden"}};
  absent.insert(absent.end(), guidance_grads.begin(), guidance_grads.end());
  DETDIT_RETURN_IF_ERROR(check_guidance_absent(in, absent));
  DETDIT_RETURN_IF_ERROR(mlp::validate_backward(operands(in.timestep_features, in.timestep),
                                                gradients(p.timestep_saved, p.grad_temb, p.timestep_grads),
                                                in.numerics, kTimestep));
  if (in.guidance_features.present())
    DETDIT_RETURN_IF_ERROR(mlp::validate_backward(operands(in.guidance_features, in.guidance),
                                                  gradients(p.guidance_saved, p.grad_temb, p.guidance_grads),
                                                  in.numerics, kGuidance));
  DETDIT_RETURN_IF_ERROR(mlp::validate_backward(operands(in.pooled, in.text),
                                                gradients(p.text_saved, p.grad_temb, p.text_grads), in.numerics,
                                                kText));
  // The three MLPs share grad_temb's (B, D) and must share one dtype.
  for (const auto& [t, name] : {Named{in.pooled, "pooled"}, Named{in.guidance_features, "guidance_features"}})
    if (t.present()) DETDIT_RETURN_IF_ERROR(check::same_dtype(t, name.c_str(), in.timestep_features, "timestep_features"));
  std::vector<Named> outputs{{p.timestep_grads.d_x, "d_timestep_features"}, {p.timestep_grads.d_w1, "d_timestep.w1"},
                             {p.timestep_grads.d_b1, "d_timestep.b1"},       {p.timestep_grads.d_w2, "d_timestep.w2"},
                             {p.timestep_grads.d_b2, "d_timestep.b2"},       {p.text_grads.d_x, "d_pooled"},
                             {p.text_grads.d_w1, "d_text.w1"},               {p.text_grads.d_b1, "d_text.b1"},
                             {p.text_grads.d_w2, "d_text.w2"},               {p.text_grads.d_b2, "d_text.b2"}};
  outputs.insert(outputs.end(), guidance_grads.begin(), guidance_grads.end());
  std::vector<Named> inputs = combined_inputs(in);
  const std::vector<Named> more{{p.timestep_saved.pre, "timestep.pre"}, {p.timestep_saved.hidden, "timestep.hidden"},
                                {p.guidance_saved.pre, "guidance.pre"}, {p.guidance_saved.hidden, "guidance.hidden"},
                                {p.text_saved.pre, "text.pre"},         {p.text_saved.hidden, "text.hidden"},
                                {p.grad_temb, "grad_temb"}};
  inputs.insert(inputs.end(), more.begin(), more.end());
  return check_no_overlap(outputs, inputs);
}

}  // namespace

Status combined_timestep_embedding_forward(const CombinedTimestepEmbeddingParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_combined(params));
  const CombinedTimestepEmbeddingInputs& in = params.in;
  const bool guided = in.guidance_features.present();
  const Device device = params.temb.device;
  const int64_t rows = params.temb.shape[0], dim = params.temb.shape[1];
  // Scratch first: g_emb and text_emb (B, D) T, then every MLP's own.
  TensorView guidance_emb, text_emb;
  std::shared_ptr<void> owners[2];
  if (guided)
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, params.temb.dtype, {rows, dim}, stream, &owners[0], &guidance_emb));
  DETDIT_RETURN_IF_ERROR(scratch_tensor(device, params.temb.dtype, {rows, dim}, stream, &owners[1], &text_emb));
  const mlp::Operands timestep = operands(in.timestep_features, in.timestep);
  const mlp::Operands guidance = operands(in.guidance_features, in.guidance);
  const mlp::Operands text = operands(in.pooled, in.text);
  mlp::ForwardScratch scratch[3];
  DETDIT_RETURN_IF_ERROR(mlp::prepare_forward(
      timestep, {params.temb, params.timestep_saved.pre, params.timestep_saved.hidden}, stream, &scratch[0]));
  if (guided)
    DETDIT_RETURN_IF_ERROR(mlp::prepare_forward(
        guidance, {guidance_emb, params.guidance_saved.pre, params.guidance_saved.hidden}, stream, &scratch[1]));
  DETDIT_RETURN_IF_ERROR(
      mlp::prepare_forward(text, {text_emb, params.text_saved.pre, params.text_saved.hidden}, stream, &scratch[2]));
  // temb = (t_emb + g_emb) + text_emb, diffusers' order, each add rounded to T.
  DETDIT_RETURN_IF_ERROR(mlp::run_forward(timestep, scratch[0], in.numerics, stream));
  if (guided) {
    DETDIT_RETURN_IF_ERROR(mlp::run_forward(guidance, scratch[1], in.numerics, stream));
    DETDIT_RETURN_IF_ERROR(backend::add(device, params.temb, guidance_emb, params.temb, stream));
  }
  DETDIT_RETURN_IF_ERROR(mlp::run_forward(text, scratch[2], in.numerics, stream));
  return backend::add(device, params.temb, text_emb, params.temb, stream);
}

Status combined_timestep_embedding_backward(const CombinedTimestepEmbeddingBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_combined_backward(params));
  const CombinedTimestepEmbeddingInputs& in = params.in;
  const bool guided = in.guidance_features.present();
  const mlp::Operands timestep = operands(in.timestep_features, in.timestep);
  const mlp::Operands guidance = operands(in.guidance_features, in.guidance);
  const mlp::Operands text = operands(in.pooled, in.text);
  // Each add passes grad_temb to both of its operands unchanged.
  mlp::BackwardScratch scratch[3];
  DETDIT_RETURN_IF_ERROR(mlp::prepare_backward(
      timestep, gradients(params.timestep_saved, params.grad_temb, params.timestep_grads), stream, &scratch[0]));
  if (guided)
    DETDIT_RETURN_IF_ERROR(mlp::prepare_backward(
        guidance, gradients(params.guidance_saved, params.grad_temb, params.guidance_grads), stream, &scratch[1]));
  DETDIT_RETURN_IF_ERROR(mlp::prepare_backward(
      text, gradients(params.text_saved, params.grad_temb, params.text_grads), stream, &scratch[2]));
  DETDIT_RETURN_IF_ERROR(mlp::run_backward(timestep, scratch[0], in.numerics, stream));
  if (guided) DETDIT_RETURN_IF_ERROR(mlp::run_backward(guidance, scratch[1], in.numerics, stream));
  return mlp::run_backward(text, scratch[2], in.numerics, stream);
}

}  // namespace detdit
