// The DiT families' conditioning paths as chained op cases (model_cases.h).
//
// Each family's facts (docs/models.md) are one ModelPath row below; the path
// every row describes is one block and the final layer:
//   sinusoid(t) -> time embedding (MLP, or diffusers' combined embedding with
//   the pooled text and the guidance) -> the AdaLN projections of the block
//   (both streams, the single-stream block) [+ the block's table: Wan, LTX]
//   -> norm1 (modulated: shift, scale) -> gate_residual_layernorm (x + gate *
//   attention, then the FFN's modulated norm) -> gate_residual (+ gate * FFN)
//   -> the final modulation (AdaLayerNormContinuous's projection, scale first;
//   Wan's and LTX's table + the time embedding; CogVideoX's norm_final then
//   AdaLayerNorm, shift first) -> the final modulated norm -> proj_out.
// Left out: attention and the FFN (stand-ins), Wan's cross-attention norm and
// residual (unmodulated; Wan's self-attention residual here feeds the FFN's
// norm directly), the text stream's and single-stream blocks' norms (their
// projections are sites; their norms are norm1's op on other rows),
// HunyuanVideo's token refiner.
#include "cases/model_cases.h"

#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "cases/case_builders.h"
#include "cases/forms_cases.h"
#include "cases/layernorm_cases.h"

namespace detdit {
namespace cases {
namespace {

enum class FinalStyle {
  kContinuous,   // AdaLayerNormContinuous: linear(silu(temb)) -> scale, shift; LayerNorm; proj_out
  kTable,        // Wan, LTX: table (2, H) + temb -> shift, scale; LayerNorm; proj_out
  kAdaLayerNorm  // CogVideoX: LayerNorm norm_final, AdaLayerNorm (shift, scale; affine LayerNorm); proj_out
};

struct ProjectionSite {
  const char* prefix;  // "<prefix>.weight", "<prefix>.bias"
  int chunks;
  const char* what;
};

struct ModelPath {
  const char* model;
  SinusoidConvention timestep;
  DType timestep_dtype;  // the sinusoid's input (Flux, Qwen-Image: the pipeline's bf16 value)
  const char* time_mlp;  // "<time_mlp>.linear_1.weight", ...
  DType mlp_dtype;       // FP32: Wan's time embedder, its output rounded to bf16 for the projection
  const char* text_mlp;      // the pooled-text projection, or nullptr
  const char* guidance_mlp;  // the guidance embedder, or nullptr
  std::vector<ProjectionSite> projections;  // [0] modulates norm1 and the attention's gate
  int ffn_projection, ffn_chunk;  // the FFN's shift, scale, gate: chunks ffn_chunk.. of that projection
  const char* block_table;        // added to projections[0] (Wan, LTX), or nullptr
  DType table_dtype;
  ModulationForm form;
  bool rms;  // LTX: RMSNorm without affine (detdit's rmsnorm with a weight of ones: the same bytes)
  float eps;
  bool upcast;
  const char* norm1_affine;  // "<prefix>.weight" / ".bias" of norm1's LayerNorm (CogVideoX), or nullptr
  const char* norm2_affine;
  FinalStyle final_style;
  const char* final_source;  // kContinuous, kAdaLayerNorm: the projection; kTable: the table
  const char* pre_final_norm;     // CogVideoX's norm_final (affine), or nullptr
  const char* final_norm_affine;  // CogVideoX's norm_out.norm, or nullptr
  float final_eps;
};

SinusoidConvention sigma1000() {
  SinusoidConvention c{"sigma*1000"};
  c.t_max = 1000.0f;
  return c;
}
SinusoidConvention integer_t() {
  SinusoidConvention c = sigma1000();
  c.name = "integer t";
  c.integer_timesteps = true;
  return c;
}
SinusoidConvention qwen_scale() {
  SinusoidConvention c{"scale=1000"};
  c.scale = 1000.0f;
  return c;
}
SinusoidConvention guidance1000() {  // Flux, HunyuanVideo: guidance * 1000 (guidance scales up to 20)
  SinusoidConvention c{"guidance*1000"};
  c.t_max = 20000.0f;
  return c;
}

const std::vector<ProjectionSite> kJointProjections = {
    {"transformer_blocks.0.norm1.linear", 6, "AdaLayerNormZero (image stream)"},
    {"transformer_blocks.0.norm1_context.linear", 6, "AdaLayerNormZero (text stream)"}};
const std::vector<ProjectionSite> kDoubleSingleProjections = {
    kJointProjections[0], kJointProjections[1],
    {"single_transformer_blocks.0.norm.linear", 3, "AdaLayerNormZeroSingle"}};

ModelPath wan(const char* model, ModulationForm form) {
  return {model, integer_t(), DType::kF32, "condition_embedder.time_embedder", DType::kF32, nullptr, nullptr,
          {{"condition_embedder.time_proj", 6, "time_proj"}}, 0, 3, "blocks.0.scale_shift_table", DType::kF32, form,
          false, 1e-6f, true, nullptr, nullptr, FinalStyle::kTable, "scale_shift_table", nullptr, nullptr, 1e-6f};
}

ModelPath joint(const char* model, DType timestep_dtype, bool guidance, std::vector<ProjectionSite> projections) {
  return {model, sigma1000(), timestep_dtype, "time_text_embed.timestep_embedder", DType::kBF16,
          "time_text_embed.text_embedder", guidance ? "time_text_embed.guidance_embedder" : nullptr, projections, 0, 3,
          nullptr, DType::kBF16, ModulationForm::kPerSample, false, 1e-6f, false, nullptr, nullptr,
          FinalStyle::kContinuous, "norm_out.linear", nullptr, nullptr, 1e-6f};
}

const std::vector<ModelPath>& model_paths() {
  static const std::vector<ModelPath> kPaths = {
      joint("sd35", DType::kF32, false, kJointProjections),
      joint("flux", DType::kBF16, true, kDoubleSingleProjections),
      wan("wan21", ModulationForm::kPerSample),
      wan("wan22_a14b", ModulationForm::kPerSample),
      wan("wan22_ti2v", ModulationForm::kPerToken),
      joint("hunyuan_video", DType::kF32, true, kDoubleSingleProjections),
      {"qwen_image", qwen_scale(), DType::kBF16, "time_text_embed.timestep_embedder", DType::kBF16, nullptr, nullptr,
       {{"transformer_blocks.0.img_mod.1", 6, "img_mod"}, {"transformer_blocks.0.txt_mod.1", 6, "txt_mod"}}, 0, 3,
       nullptr, DType::kBF16, ModulationForm::kPerSample, false, 1e-6f, false, nullptr, nullptr,
       FinalStyle::kContinuous, "norm_out.linear", nullptr, nullptr, 1e-6f},
      {"cogvideox", integer_t(), DType::kF32, "time_embedding", DType::kBF16, nullptr, nullptr,
       {{"transformer_blocks.0.norm1.linear", 6, "CogVideoXLayerNormZero norm1"},
        {"transformer_blocks.0.norm2.linear", 6, "CogVideoXLayerNormZero norm2"}},
       1, 0, nullptr, DType::kBF16, ModulationForm::kPerSample, false, 1e-5f, false, "transformer_blocks.0.norm1.norm",
       "transformer_blocks.0.norm2.norm", FinalStyle::kAdaLayerNorm, "norm_out.linear", "norm_final", "norm_out.norm",
       1e-5f},
      {"ltx_video", sigma1000(), DType::kF32, "time_embed.emb.timestep_embedder", DType::kBF16, nullptr, nullptr,
       {{"time_embed.linear", 6, "AdaLayerNormSingle"}}, 0, 3, "transformer_blocks.0.scale_shift_table", DType::kBF16,
       ModulationForm::kPerSample, true, 1e-6f, false, nullptr, nullptr, FinalStyle::kTable, "scale_shift_table",
       nullptr, nullptr, 1e-6f},
  };
  return kPaths;
}

using Value = std::shared_ptr<const HostTensor>;

void set_fill(OpCase* c, const std::string& name, Fill fill) {
  for (TensorSpec& t : c->tensors) {
    if (t.name == name && !t.output) {
      t.fill = std::move(fill);
      return;
    }
  }
  std::abort();  // a case bug: the builders name every input the path fills
}

// The value's elements (the same count), rounded to the tensor's dtype where
// it differs (the models' casts, e.g. Wan's FP32 temb to bf16).
Fill copy_of(Value value) {
  return [value](HostTensor* t) {
    if (t->dtype() == value->dtype() && t->nbytes() == value->nbytes()) {
      std::memcpy(t->data(), value->data(), t->nbytes());
      return;
    }
    if (t->numel() != value->numel()) std::abort();  // a case bug: the path's shapes agree
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, value->get(i));
  };
}

// One modulation chunk of a table: `chunk` of the (rows, chunks * H) value.
struct Chunk {
  Value table;
  int64_t chunks = 0;
  int chunk = -1;  // -1: zeros (a chunk the site does not read)
};

// The form cases' parent (rows, 6, H): chunk j of row r is chunks[j] of row r.
Fill parent_of(std::vector<Chunk> chunks, int64_t hidden) {
  return [chunks, hidden](HostTensor* t) {
    const int64_t rows = t->numel() / (6 * hidden);
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < 6; ++j)
        for (int64_t h = 0; h < hidden; ++h) {
          const Chunk& c = chunks[static_cast<std::size_t>(j)];
          const double v = c.chunk < 0 ? 0.0 : c.table->get((r * c.chunks + c.chunk) * hidden + h);
          t->set((r * 6 + j) * hidden + h, v);
        }
  };
}

class PathBuilder {
 public:
  PathBuilder(const CaseContext& context, std::vector<ModelSite>* sites) : context_(context), sites_(sites) {}

  // The input `tensor` of c takes the named weight's bytes (its dtype and element count checked).
  Status use_weight(OpCase* c, const std::string& tensor, const std::string& weight) {
    TensorView w;
    DETDIT_RETURN_IF_ERROR(context_.weight(weight, &w));
    const TensorSpec& spec = c->spec(tensor);
    int64_t numel = 1;
    for (int64_t d : spec.shape) numel *= d;
    if (w.dtype != spec.dtype || w.numel() != numel)
      return Status::value_error("the " + context_.model + " weights' " + weight + " is " + dtype_name(w.dtype) +
                                 " with " + std::to_string(w.numel()) + " elements; its site (" + c->op +
                                 ") reads " + dtype_name(spec.dtype) + " with " + std::to_string(numel));
    const std::size_t bytes = w.nbytes();
    const void* data = w.data;
    set_fill(c, tensor, [data, bytes](HostTensor* t) { std::memcpy(t->data(), data, bytes); });
    return Status::ok_status();
  }
  // An MLP's four tensors (case names from `names`) from "<prefix>.linear_{1,2}.{weight,bias}".
  Status use_mlp(OpCase* c, const MlpCaseNames& names, const std::string& prefix) {
    DETDIT_RETURN_IF_ERROR(use_weight(c, names.w1, prefix + ".linear_1.weight"));
    DETDIT_RETURN_IF_ERROR(use_weight(c, names.b1, prefix + ".linear_1.bias"));
    DETDIT_RETURN_IF_ERROR(use_weight(c, names.w2, prefix + ".linear_2.weight"));
    return use_weight(c, names.b2, prefix + ".linear_2.bias");
  }

  // Appends the site and runs its forward on the CPU: its outputs become values.
  Status add(std::string site, OpCase c, std::map<std::string, Value>* outputs = nullptr) {
    c.name = context_.model + " " + c.name;
    if (outputs != nullptr) {
      Instance instance;
      DETDIT_RETURN_IF_ERROR(instantiate(c, Device::cpu(), nullptr, &instance));
      DETDIT_RETURN_IF_ERROR(run(c, Phase::kForward, instance));
      std::map<std::string, HostTensor> host;
      DETDIT_RETURN_IF_ERROR(download_outputs(c, instance, &host));
      for (auto& kv : host) (*outputs)[kv.first] = std::make_shared<const HostTensor>(std::move(kv.second));
    }
    sites_->push_back({std::move(site), std::move(c)});
    return Status::ok_status();
  }

 private:
  const CaseContext& context_;
  std::vector<ModelSite>* sites_;
};

// A form case's batch invariance: sample b alone (a batch of one) gives the
// bytes of slice b. Every tensor of rank >= 2 leads with the batch.
void per_sample(OpCase* c, int64_t batch, std::function<OpCase()> one) {
  auto mark = [](OpCase* k, int64_t b) {
    for (TensorSpec& t : k->tensors)
      if (t.shape.size() >= 2 && t.shape[0] == b) t.position_dim = 0;
  };
  mark(c, batch);
  c->positions = batch;
  c->alone_probes = batch;
  c->alone = [one, mark](int64_t) {
    OpCase k = one();
    mark(&k, 1);
    return k;
  };
}

Status find_path(const CaseContext& ctx, const ModelPath** path) {
  for (const ModelPath& p : model_paths())
    if (ctx.model == p.model) *path = &p;
  if (*path == nullptr) return Status::value_error("no conditioning path for model \"" + ctx.model + "\"");
  return Status::ok_status();
}

// B = 2 samples; S positions each (per token fewer: every position is a timestep row).
int64_t seq_len_of(const ModelPath& path, const CaseContext& ctx) {
  const bool per_token = path.form == ModulationForm::kPerToken;
  return per_token ? (ctx.quick ? 16 : 64) : (ctx.quick ? 256 : 1024);
}

}  // namespace

Status model_tp_shape(const CaseContext& ctx, std::string* site, TpShape* shape) {
  const ModelPath* path = nullptr;
  DETDIT_RETURN_IF_ERROR(find_path(ctx, &path));
  const ProjectionSite& p = path->projections[0];
  const bool per_token = path->form == ModulationForm::kPerToken;
  shape->timesteps = per_token ? 2 * seq_len_of(*path, ctx) : 2;
  shape->out_features = p.chunks * ctx.hidden;
  shape->in_features = ctx.time_embed_dim;
  shape->dtype = DType::kBF16;
  shape->chunks = p.chunks;
  shape->weight = p.prefix;
  *site = std::string("tensor parallel: AdaLN projection, ") + std::to_string(p.chunks) + " chunks (" + p.what + ")";
  return Status::ok_status();
}

Status model_sites(const CaseContext& ctx, std::vector<ModelSite>* sites) {
  sites->clear();
  const ModelPath* path = nullptr;
  DETDIT_RETURN_IF_ERROR(find_path(ctx, &path));
  if (!ctx.weight) return Status::value_error("verify --model " + ctx.model + " needs the model's weights");
  PathBuilder b(ctx, sites);
  const bool per_token = path->form == ModulationForm::kPerToken;
  const int64_t B = 2, S = seq_len_of(*path, ctx);
  const int64_t H = ctx.hidden, D = ctx.time_embed_dim, T = per_token ? B * S : B;
  const std::string form = per_token ? "per token" : "per sample";
  uint64_t seed = 7000;

  // The timestep (per token: one per position) and its sinusoid; the guidance's.
  std::map<std::string, Value> t_out, g_out, emb;
  DETDIT_RETURN_IF_ERROR(b.add("timestep sinusoid (" + path->timestep.name + ")",
                               family_sinusoid_case(path->timestep, path->timestep_dtype, T, ctx.freq_dim, seed += 10),
                               &t_out));
  if (path->guidance_mlp != nullptr)
    DETDIT_RETURN_IF_ERROR(b.add("guidance sinusoid (guidance * 1000)",
                                 family_sinusoid_case(guidance1000(), DType::kF32, T, ctx.freq_dim, seed += 10), &g_out));

  // The time embedding: temb (T, D).
  if (path->text_mlp == nullptr) {
    MlpShape m;
    m.rows = T;
    m.in_features = ctx.freq_dim;
    m.hidden = ctx.time_embed_hidden;
    m.dim = D;
    m.seed = seed += 10;
    m.dtype = path->mlp_dtype;
    m.features = copy_of(t_out.at("features"));  // the model casts the FP32 sinusoid to the MLP's dtype
    OpCase c = timestep_mlp_case(m);
    DETDIT_RETURN_IF_ERROR(b.use_mlp(&c, mlp_case_names("features", "temb", ""), path->time_mlp));
    for (const AccuracyCheck& a : mlp_forward_stage_accuracy(mlp_case_names("features", "temb", ""), true))
      c.accuracy.push_back(a);
    DETDIT_RETURN_IF_ERROR(b.add(std::string("time embedding (TimestepEmbedding, ") +
                                     (path->mlp_dtype == DType::kF32 ? "FP32)" : "bf16)"),
                                 c, &emb));
  } else {
    EmbeddingShape e;
    e.dtype = DType::kBF16;
    e.rows = T;
    e.channels = ctx.freq_dim;
    e.pooled = ctx.pooled_dim;
    e.hidden = H;
    e.guided = path->guidance_mlp != nullptr;
    e.seed = seed += 10;
    OpCase c = combined_timestep_embedding_case(e);
    set_fill(&c, "timestep_features", copy_of(t_out.at("features")));
    DETDIT_RETURN_IF_ERROR(b.use_mlp(&c, mlp_case_names("timestep_features", "temb", "timestep_"), path->time_mlp));
    DETDIT_RETURN_IF_ERROR(b.use_mlp(&c, mlp_case_names("pooled", "temb", "text_"), path->text_mlp));
    set_fill(&c, "pooled", form_values(true, seed + 1, 0.0, 1.0));  // the pooled text: a stand-in
    if (e.guided) {
      set_fill(&c, "guidance_features", copy_of(g_out.at("features")));
      DETDIT_RETURN_IF_ERROR(b.use_mlp(&c, mlp_case_names("guidance_features", "temb", "guidance_"), path->guidance_mlp));
    }
    DETDIT_RETURN_IF_ERROR(
        b.add(e.guided ? "time + guidance + text embedding" : "time + text embedding", std::move(c), &emb));
  }
  const Value temb = emb.at("temb");

  // The AdaLN projections of the block: linear(silu(temb)), bf16.
  auto projection = [&](const char* prefix, int chunks, const std::string& site, std::map<std::string, Value>* out) {
    ProjectionShape p;
    p.dtype = DType::kBF16;
    p.rows = T;
    p.dim = D;
    p.out_features = chunks * H;
    p.chunks = chunks;
    p.temb_dtype = DType::kBF16;
    p.temb = copy_of(temb);  // Wan: its FP32 temb rounded once to bf16 (type_as)
    p.seed = seed += 10;
    OpCase c = adaln_projection_case(p);
    DETDIT_RETURN_IF_ERROR(b.use_weight(&c, "weight", std::string(prefix) + ".weight"));
    DETDIT_RETURN_IF_ERROR(b.use_weight(&c, "bias", std::string(prefix) + ".bias"));
    c.accuracy = projection_forward_accuracy(T * chunks * H);
    return b.add(site, std::move(c), out);
  };
  std::vector<std::map<std::string, Value>> tables(path->projections.size());
  for (std::size_t i = 0; i < path->projections.size(); ++i) {
    const ProjectionSite& p = path->projections[i];
    DETDIT_RETURN_IF_ERROR(projection(p.prefix, p.chunks,
                                      std::string("AdaLN projection, ") + std::to_string(p.chunks) + " chunks (" +
                                          p.what + ")",
                                      &tables[i]));
  }
  // A family's table (chunks, H) + proj: proj (T, chunks * H), or (T, H) broadcast over the chunks.
  auto table_add = [&](const char* table, int chunks, const Value& proj, const std::string& site, Value* sum) {
    TableAddShape a;
    a.table_dtype = path->table_dtype;
    a.proj_dtype = DType::kBF16;
    a.rows = T;
    a.chunks = chunks;
    a.hidden = H;
    a.broadcast = proj->numel() == T * H;
    a.seed = seed += 10;
    OpCase c = adaln_table_add_case(a);
    DETDIT_RETURN_IF_ERROR(b.use_weight(&c, "table", table));
    set_fill(&c, "proj", copy_of(proj));
    std::map<std::string, Value> out;
    DETDIT_RETURN_IF_ERROR(b.add(site, std::move(c), &out));
    *sum = out.at("out");
    return Status::ok_status();
  };
  // The block's modulation (T, 6 * H): the projection, or the table plus it.
  std::vector<Value> modulation;
  for (auto& t : tables) modulation.push_back(t.at("table"));
  DType mod_dtype = DType::kBF16;
  if (path->block_table != nullptr) {
    DETDIT_RETURN_IF_ERROR(table_add(path->block_table, 6, modulation[0], "block table + projection", &modulation[0]));
    mod_dtype = path->table_dtype;
  }

  FormShape f;
  f.dtype = DType::kBF16;
  f.mod_dtype = mod_dtype;
  f.hidden = H;
  f.batch = B;
  f.seq_len = S;
  f.form = path->form;
  f.upcast = path->upcast;
  f.grad_dtype = DType::kF32;
  const std::string recipe = path->upcast ? "upcast" : "each op";
  auto affine_of = [](const char* prefix) { return prefix ? LayernormAffine::kWeightBias : LayernormAffine::kNone; };
  auto use_affine = [&](OpCase* c, const char* prefix) -> Status {
    if (prefix == nullptr) return Status::ok_status();
    DETDIT_RETURN_IF_ERROR(b.use_weight(c, "weight", std::string(prefix) + ".weight"));
    return b.use_weight(c, "bias", std::string(prefix) + ".bias");
  };
  const Chunk none{};
  auto chunk = [&](int projection_index, int c) {
    return Chunk{modulation[static_cast<std::size_t>(projection_index)], 6, c};
  };

  // The block's input x (B, S, H): a stand-in read by norm1 and, as the residual, by the region.
  auto x = std::make_shared<HostTensor>(DType::kBF16, std::vector<int64_t>{B, S, H});
  fill_stream_normal(x.get(), seed += 10, "verify", 0.0, 1.0);
  const Value block_input = x;

  const Fill ones = [](HostTensor* t) {  // an RMSNorm without affine: detdit's rmsnorm with a weight of ones
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, 1.0);
  };
  // norm1: the modulated norm before attention (shift, scale = chunks 0, 1).
  {
    const uint64_t s = seed += 10;
    OpCase c = path->rms ? rmsnorm_form_case(f, s, true) : layernorm_form_case(f, affine_of(path->norm1_affine), s, true);
    if (path->rms) set_fill(&c, "weight", ones);
    DETDIT_RETURN_IF_ERROR(use_affine(&c, path->norm1_affine));
    set_fill(&c, "x", copy_of(block_input));
    set_fill(&c, "modulation", parent_of({chunk(0, 0), chunk(0, 1), chunk(0, 2), none, none, none}, H));
    per_sample(&c, B, [f, s, path, affine = affine_of(path->norm1_affine)]() {
      FormShape one = f;
      one.batch = 1;
      return path->rms ? rmsnorm_form_case(one, s, true) : layernorm_form_case(one, affine, s, true);
    });
    DETDIT_RETURN_IF_ERROR(b.add(std::string("norm1: modulated ") + (path->rms ? "RMSNorm" : "LayerNorm") + ", " +
                                     form + ", " + recipe,
                                 std::move(c)));
  }

  // The attention's gated residual into the FFN's modulated norm: h = x + gate_msa * attention.
  std::map<std::string, Value> region;
  const int fp = path->ffn_projection, fc = path->ffn_chunk;
  if (path->rms) {
    const uint64_t s = seed += 10;
    OpCase c = gate_residual_rmsnorm_form_case(f, s, true);
    set_fill(&c, "weight", ones);
    set_fill(&c, "residual", copy_of(block_input));
    set_fill(&c, "modulation", parent_of({none, none, chunk(0, 2), chunk(fp, fc), chunk(fp, fc + 1), none}, H));
    per_sample(&c, B, [f, s]() {
      FormShape one = f;
      one.batch = 1;
      return gate_residual_rmsnorm_form_case(one, s, true);
    });
    DETDIT_RETURN_IF_ERROR(b.add("attention residual into the FFN's modulated RMSNorm (gate_msa; shift_mlp, "
                                 "scale_mlp), " + form + ", " + recipe,
                                 std::move(c), &region));
  } else {
    GateLayernormShape g;
    g.form = f;
    g.affine = affine_of(path->norm2_affine);
    g.d_h = true;
    const uint64_t s = seed += 10;
    OpCase c = gate_residual_layernorm_case(g, s, true);
    DETDIT_RETURN_IF_ERROR(use_affine(&c, path->norm2_affine));
    set_fill(&c, "residual", copy_of(block_input));
    set_fill(&c, "modulation", parent_of({chunk(fp, fc), chunk(fp, fc + 1), chunk(0, 2), none, none, none}, H));
    per_sample(&c, B, [g, s]() {
      GateLayernormShape one = g;
      one.form.batch = 1;
      return gate_residual_layernorm_case(one, s, true);
    });
    DETDIT_RETURN_IF_ERROR(b.add("attention residual into the FFN's modulated LayerNorm (gate_msa; shift_mlp, "
                                 "scale_mlp), " + form + ", " + recipe,
                                 std::move(c), &region));
  }

  // The FFN's gated residual: out = h + gate_mlp * FFN.
  std::map<std::string, Value> block;
  {
    const uint64_t s = seed += 10;
    OpCase c = gate_residual_form_case(f, s, true);
    set_fill(&c, "residual", copy_of(region.at("h")));
    set_fill(&c, "modulation", parent_of({none, none, chunk(fp, fc + 2), none, none, none}, H));
    per_sample(&c, B, [f, s]() {
      FormShape one = f;
      one.batch = 1;
      return gate_residual_form_case(one, s, true);
    });
    DETDIT_RETURN_IF_ERROR(b.add("FFN residual: h + gate_mlp * FFN, " + form + ", " + recipe, std::move(c), &block));
  }

  // The final layer's modulation: shift and scale as chunks of `final_table`.
  Value final_x = block.at("out");
  std::vector<Chunk> final_chunks;
  FormShape ff = f;
  if (path->final_style == FinalStyle::kTable) {
    Value out;  // the table + the time embedding itself, broadcast over both chunks (Wan: rounded to bf16)
    DETDIT_RETURN_IF_ERROR(table_add(path->final_source, 2, temb, "final table + time embedding", &out));
    final_chunks = {{out, 2, 0}, {out, 2, 1}};
    ff.mod_dtype = path->table_dtype;
  } else {
    if (path->pre_final_norm != nullptr) {  // CogVideoX's norm_final: a plain affine LayerNorm
      FormShape plain = f;
      plain.form = ModulationForm::kNone;
      const uint64_t s = seed += 10;
      OpCase c = layernorm_form_case(plain, LayernormAffine::kWeightBias, s, true);
      DETDIT_RETURN_IF_ERROR(use_affine(&c, path->pre_final_norm));
      set_fill(&c, "x", copy_of(final_x));
      per_sample(&c, B, [plain, s]() {
        FormShape one = plain;
        one.batch = 1;
        return layernorm_form_case(one, LayernormAffine::kWeightBias, s, true);
      });
      std::map<std::string, Value> out;
      DETDIT_RETURN_IF_ERROR(b.add("norm_final: LayerNorm (weight, bias)", std::move(c), &out));
      final_x = out.at("out");
    }
    std::map<std::string, Value> out;
    const bool scale_first = path->final_style == FinalStyle::kContinuous;
    DETDIT_RETURN_IF_ERROR(projection(path->final_source, 2,
                                      std::string("final AdaLN projection, 2 chunks (") +
                                          (scale_first ? "scale, shift" : "shift, scale") + ")",
                                      &out));
    const Value table = out.at("table");
    final_chunks = {{table, 2, scale_first ? 1 : 0}, {table, 2, scale_first ? 0 : 1}};
    ff.mod_dtype = DType::kBF16;
  }
  std::map<std::string, Value> final_out;
  {
    const uint64_t s = seed += 10;
    const LayernormAffine affine = affine_of(path->final_norm_affine);
    OpCase c = layernorm_form_case(ff, affine, s, true);
    DETDIT_RETURN_IF_ERROR(use_affine(&c, path->final_norm_affine));
    set_fill(&c, "x", copy_of(final_x));
    set_fill(&c, "modulation", parent_of({final_chunks[0], final_chunks[1], none, none, none, none}, H));
    per_sample(&c, B, [ff, affine, s]() {
      FormShape one = ff;
      one.batch = 1;
      return layernorm_form_case(one, affine, s, true);
    });
    DETDIT_RETURN_IF_ERROR(
        b.add("final norm: modulated LayerNorm, " + form + ", " + recipe, std::move(c), &final_out));
  }
  {
    LinearShape l;
    l.dtype = DType::kBF16;
    l.rows = B * S;
    l.in_features = H;
    l.out_features = ctx.out_dim;
    l.out_dtype = DType::kBF16;
    l.seed = seed += 10;
    OpCase c = linear_case(l);
    DETDIT_RETURN_IF_ERROR(b.use_weight(&c, "weight", "proj_out.weight"));
    DETDIT_RETURN_IF_ERROR(b.use_weight(&c, "bias", "proj_out.bias"));
    set_fill(&c, "x", copy_of(final_out.at("out")));
    DETDIT_RETURN_IF_ERROR(b.add("proj_out", std::move(c)));
  }
  return Status::ok_status();
}

}  // namespace cases
}  // namespace detdit
