// The manifest tables (h3-conditioning-v1 and the families') and their checks (manifest.h).
#include "io/manifest.h"

#include <cstdio>
#include <memory>
#include <unordered_set>

namespace detdit {
namespace io {
namespace {

constexpr SymbolicDim kH{1, DimSymbol::kHidden};
constexpr SymbolicDim kHt{1, DimSymbol::kTimeHidden};
constexpr SymbolicDim kD{1, DimSymbol::kTimeDim};
constexpr SymbolicDim kF{1, DimSymbol::kFreq};
// The AdaLN projection has 3 modalities x 6 chunks of H; norm_out has shift and scale.
constexpr SymbolicDim k18H{18, DimSymbol::kHidden};
constexpr SymbolicDim k2H{2, DimSymbol::kHidden};
// The families' AdaLN projections: 6 chunks a block, 3 a single-stream block, 2 a final layer.
constexpr SymbolicDim k6H{6, DimSymbol::kHidden};
constexpr SymbolicDim k3H{3, DimSymbol::kHidden};
constexpr SymbolicDim kP{1, DimSymbol::kPooled};
constexpr SymbolicDim kO{1, DimSymbol::kOut};
constexpr SymbolicDim kOne{1, DimSymbol::kOne};
constexpr SymbolicDim kSix{6, DimSymbol::kOne};
constexpr SymbolicDim kTwo{2, DimSymbol::kOne};

int64_t resolve(const SymbolicDim& dim, const ManifestConfig& c) {
  switch (dim.symbol) {
    case DimSymbol::kHidden: return dim.multiple * c.hidden;
    case DimSymbol::kTimeHidden: return dim.multiple * c.time_embed_hidden;
    case DimSymbol::kTimeDim: return dim.multiple * c.time_embed_dim;
    case DimSymbol::kFreq: return dim.multiple * c.freq_dim;
    case DimSymbol::kPooled: return dim.multiple * c.pooled_dim;
    case DimSymbol::kOut: return dim.multiple * c.out_dim;
    case DimSymbol::kOne: return dim.multiple;
  }
  return 0;
}

int64_t* dimension_of(DimSymbol symbol, ManifestConfig* c) {
  switch (symbol) {
    case DimSymbol::kHidden: return &c->hidden;
    case DimSymbol::kTimeHidden: return &c->time_embed_hidden;
    case DimSymbol::kTimeDim: return &c->time_embed_dim;
    case DimSymbol::kFreq: return &c->freq_dim;
    case DimSymbol::kPooled: return &c->pooled_dim;
    case DimSymbol::kOut: return &c->out_dim;
    case DimSymbol::kOne: return nullptr;
  }
  return nullptr;
}

const char* symbol_name(DimSymbol symbol) {
  switch (symbol) {
    case DimSymbol::kHidden: return "H";
    case DimSymbol::kTimeHidden: return "Ht";
    case DimSymbol::kTimeDim: return "D";
    case DimSymbol::kFreq: return "F";
    case DimSymbol::kPooled: return "P";
    case DimSymbol::kOut: return "O";
    case DimSymbol::kOne: return "";
  }
  return "?";
}

std::string expand_block(const std::string& pattern, int64_t block) {
  std::string name = pattern;
  std::size_t at = name.find("{i}");
  if (at != std::string::npos) name.replace(at, 3, std::to_string(block));
  return name;
}

std::string describe_entry(DType dtype, const std::vector<int64_t>& shape) {
  return std::string(dtype_name(dtype)) + " " + shape_to_string(shape);
}

}  // namespace

const std::vector<ManifestTemplate>& manifest_templates() {
  static const std::vector<ManifestTemplate> kTable = {
      {"time_embedder.linear_1.weight", DType::kF32, {kHt, kF}, WeightRole::kLinearWeight, 1,
       "timestep_mlp W1 (FP32 module)"},
      {"time_embedder.linear_1.bias", DType::kF32, {kHt}, WeightRole::kLinearBias, -1, "timestep_mlp b1"},
      {"time_embedder.linear_2.weight", DType::kF32, {kD, kHt}, WeightRole::kLinearWeight, 1, "timestep_mlp W2"},
      {"time_embedder.linear_2.bias", DType::kF32, {kD}, WeightRole::kLinearBias, -1, "timestep_mlp b2"},
      {"transformer_blocks.{i}.adaln_proj.linear.weight", DType::kBF16, {k18H, kD}, WeightRole::kLinearWeight, 1,
       "adaln_projection W of block i (3 modalities x 6 chunks)"},
      {"transformer_blocks.{i}.adaln_proj.linear.bias", DType::kBF16, {k18H}, WeightRole::kLinearBias, -1,
       "adaln_projection b of block i"},
      {"transformer_blocks.{i}.norm1.weight", DType::kBF16, {kH}, WeightRole::kNormWeight, -1,
       "rmsnorm weight before attention"},
      {"transformer_blocks.{i}.norm2.weight", DType::kBF16, {kH}, WeightRole::kNormWeight, -1,
       "rmsnorm weight before the FFN"},
      {"token_refiner.final_norm.weight", DType::kBF16, {kH}, WeightRole::kNormWeight, -1,
       "plain rmsnorm after the token refiner"},
      {"norm_out.norm.weight", DType::kBF16, {kH}, WeightRole::kNormWeight, -1, "final_adaln_out rmsnorm weight"},
      {"norm_out.linear.weight", DType::kBF16, {k2H, kD}, WeightRole::kLinearWeight, 1,
       "final_adaln_out projection W (shift first, then scale)"},
      {"norm_out.linear.bias", DType::kBF16, {k2H}, WeightRole::kLinearBias, -1, "final_adaln_out projection b"},
  };
  return kTable;
}

namespace {

// A name built at run time, kept alive for the tables' const char* (each table is built once).
const char* intern(std::string name) {
  static std::vector<std::unique_ptr<std::string>> names;
  names.push_back(std::make_unique<std::string>(std::move(name)));
  return names.back()->c_str();
}

// One diffusers TimestepEmbedding / PixArtAlphaTextProjection: linear_1
// (Ht, in), linear_2 (D, Ht), each with its bias.
void add_mlp(std::vector<ManifestTemplate>* t, const std::string& prefix, DType dtype, SymbolicDim in,
             const char* purpose) {
  t->push_back({intern(prefix + ".linear_1.weight"), dtype, {kHt, in}, WeightRole::kLinearWeight, 1, purpose});
  t->push_back({intern(prefix + ".linear_1.bias"), dtype, {kHt}, WeightRole::kLinearBias, -1, purpose});
  t->push_back({intern(prefix + ".linear_2.weight"), dtype, {kD, kHt}, WeightRole::kLinearWeight, 1, purpose});
  t->push_back({intern(prefix + ".linear_2.bias"), dtype, {kD}, WeightRole::kLinearBias, -1, purpose});
}

// A bf16 nn.Linear(in, out): "<prefix>.weight" (out, in) and "<prefix>.bias" (out).
void add_linear(std::vector<ManifestTemplate>* t, const std::string& prefix, SymbolicDim out, SymbolicDim in,
                const char* purpose) {
  t->push_back({intern(prefix + ".weight"), DType::kBF16, {out, in}, WeightRole::kLinearWeight, 1, purpose});
  t->push_back({intern(prefix + ".bias"), DType::kBF16, {out}, WeightRole::kLinearBias, -1, purpose});
}

void add_proj_out(std::vector<ManifestTemplate>* t) {
  add_linear(t, "proj_out", kO, kH, "proj_out: linear after the final norm");
}

// SD3.5, Flux and HunyuanVideo: CombinedTimestep(Guidance)TextProjEmbeddings,
// AdaLayerNormZero of both streams, (single blocks), AdaLayerNormContinuous.
std::vector<ManifestTemplate> joint_templates(bool guidance, bool single) {
  std::vector<ManifestTemplate> t;
  add_mlp(&t, "time_text_embed.timestep_embedder", DType::kBF16, kF, "timestep MLP (bf16)");
  if (guidance) add_mlp(&t, "time_text_embed.guidance_embedder", DType::kBF16, kF, "guidance MLP (bf16)");
  add_mlp(&t, "time_text_embed.text_embedder", DType::kBF16, kP, "pooled-text projection (SiLU, bf16)");
  add_linear(&t, "transformer_blocks.{i}.norm1.linear", k6H, kD,
             "AdaLayerNormZero of the image stream: shift, scale, gate x 2");
  add_linear(&t, "transformer_blocks.{i}.norm1_context.linear", k6H, kD,
             "AdaLayerNormZero of the text stream");
  if (single)
    add_linear(&t, "single_transformer_blocks.{i}.norm.linear", k3H, kD, "AdaLayerNormZeroSingle: shift, scale, gate");
  add_linear(&t, "norm_out.linear", k2H, kD,
             "AdaLayerNormContinuous: scale, shift (scale first)");
  add_proj_out(&t);
  return t;
}

// Wan 2.1 / 2.2: the FP32 time embedder, the shared bf16 time_proj, an FP32
// scale_shift_table per block and the final one (randn / sqrt(H): linear-weight values of fan-in H).
std::vector<ManifestTemplate> wan_templates() {
  std::vector<ManifestTemplate> t;
  add_mlp(&t, "condition_embedder.time_embedder", DType::kF32, kF, "timestep MLP (FP32 module)");
  add_linear(&t, "condition_embedder.time_proj", k6H, kD,
             "time_proj: linear(silu(temb)), 6 chunks shared by every block");
  t.push_back({"blocks.{i}.scale_shift_table", DType::kF32, {kOne, kSix, kH}, WeightRole::kLinearWeight, 2,
               "block table: shift, scale, gate, c_shift, c_scale, c_gate (+ time_proj in FP32)"});
  t.push_back({"scale_shift_table", DType::kF32, {kOne, kTwo, kH}, WeightRole::kLinearWeight, 2,
               "final table: shift, scale (+ temb in FP32)"});
  add_proj_out(&t);
  return t;
}

std::vector<ManifestTemplate> qwen_image_templates() {
  std::vector<ManifestTemplate> t;
  add_mlp(&t, "time_text_embed.timestep_embedder", DType::kBF16, kF, "timestep MLP (bf16)");
  add_linear(&t, "transformer_blocks.{i}.img_mod.1", k6H, kD,
             "image modulation: (shift, scale, gate) x 2");
  add_linear(&t, "transformer_blocks.{i}.txt_mod.1", k6H, kD,
             "text modulation");
  add_linear(&t, "norm_out.linear", k2H, kD,
             "AdaLayerNormContinuous: scale, shift (scale first)");
  add_proj_out(&t);
  return t;
}

// CogVideoX: a sinusoid as wide as H, a 512-wide time embedding, one affine
// LayerNorm per CogVideoXLayerNormZero, norm_final then AdaLayerNorm (shift first).
std::vector<ManifestTemplate> cogvideox_templates() {
  std::vector<ManifestTemplate> t;
  add_mlp(&t, "time_embedding", DType::kBF16, kF, "timestep MLP (bf16), F = H");
  for (const char* norm : {"norm1", "norm2"}) {
    auto name = [&](const char* what) { return intern(std::string("transformer_blocks.{i}.") + norm + what); };
    add_linear(&t, std::string("transformer_blocks.{i}.") + norm + ".linear", k6H, kD,
               "CogVideoXLayerNormZero: shift, scale, gate, enc_shift, enc_scale, enc_gate");
    t.push_back({name(".norm.weight"), DType::kBF16, {kH}, WeightRole::kNormWeight, -1, "its LayerNorm's weight"});
    t.push_back({name(".norm.bias"), DType::kBF16, {kH}, WeightRole::kLinearBias, -1, "its LayerNorm's bias"});
  }
  t.push_back({"norm_final.weight", DType::kBF16, {kH}, WeightRole::kNormWeight, -1, "LayerNorm before norm_out"});
  t.push_back({"norm_final.bias", DType::kBF16, {kH}, WeightRole::kLinearBias, -1, "LayerNorm before norm_out"});
  add_linear(&t, "norm_out.linear", k2H, kD, "AdaLayerNorm: shift, scale (shift first)");
  t.push_back({"norm_out.norm.weight", DType::kBF16, {kH}, WeightRole::kNormWeight, -1, "AdaLayerNorm's LayerNorm"});
  t.push_back({"norm_out.norm.bias", DType::kBF16, {kH}, WeightRole::kLinearBias, -1, "AdaLayerNorm's LayerNorm"});
  add_proj_out(&t);
  return t;
}

// LTX-Video: AdaLayerNormSingle (timestep MLP, linear to 6H), bf16 tables.
std::vector<ManifestTemplate> ltx_templates() {
  std::vector<ManifestTemplate> t;
  add_mlp(&t, "time_embed.emb.timestep_embedder", DType::kBF16, kF, "timestep MLP (bf16)");
  add_linear(&t, "time_embed.linear", k6H, kD,
             "AdaLayerNormSingle: linear(silu(emb)), 6 chunks shared by every block");
  t.push_back({"transformer_blocks.{i}.scale_shift_table", DType::kBF16, {kSix, kH}, WeightRole::kLinearWeight, 1,
               "block table: shift, scale, gate x 2 (+ the projection)"});
  t.push_back({"scale_shift_table", DType::kBF16, {kTwo, kH}, WeightRole::kLinearWeight, 1,
               "final table: shift, scale (+ the embedded timestep)"});
  add_proj_out(&t);
  return t;
}

ManifestConfig dims_of(const char* model, int64_t hidden, int64_t time_hidden, int64_t time_dim, int64_t freq,
                       int64_t pooled, int64_t out) {
  ManifestConfig c;
  c.model = model;
  c.blocks = 1;
  c.hidden = hidden;
  c.time_embed_hidden = time_hidden;
  c.time_embed_dim = time_dim;
  c.freq_dim = freq;
  c.pooled_dim = pooled;
  c.out_dim = out;
  return c;
}

}  // namespace

// The released dimensions, from diffusers' conversion scripts (docs/models.md).
const std::vector<ModelManifest>& model_manifests() {
  static const std::vector<ManifestTemplate> sd35 = joint_templates(false, false), flux = joint_templates(true, true),
                                             wan = wan_templates(), qwen = qwen_image_templates(),
                                             cog = cogvideox_templates(), ltx = ltx_templates();
  static const std::vector<ModelManifest> kModels = {
      {"h3", "MiniMax-H3", kManifestVersion, ManifestConfig{}, 50, &manifest_templates()},
      {"sd35", "Stable Diffusion 3.5 Large", "sd35-conditioning-v1", dims_of("sd35", 2432, 2432, 2432, 256, 2048, 64),
       38, &sd35},
      {"flux", "Flux.1-dev", "flux-conditioning-v1", dims_of("flux", 3072, 3072, 3072, 256, 768, 64), 19, &flux},
      {"wan21", "Wan 2.1 14B", "wan21-conditioning-v1", dims_of("wan21", 5120, 5120, 5120, 256, 0, 64), 40, &wan},
      {"wan22_a14b", "Wan 2.2 A14B (one expert)", "wan22_a14b-conditioning-v1",
       dims_of("wan22_a14b", 5120, 5120, 5120, 256, 0, 64), 40, &wan},
      {"wan22_ti2v", "Wan 2.2 TI2V-5B", "wan22_ti2v-conditioning-v1",
       dims_of("wan22_ti2v", 3072, 3072, 3072, 256, 0, 192), 30, &wan},
      {"hunyuan_video", "HunyuanVideo", "hunyuan_video-conditioning-v1",
       dims_of("hunyuan_video", 3072, 3072, 3072, 256, 768, 64), 20, &flux},
      {"qwen_image", "Qwen-Image", "qwen_image-conditioning-v1", dims_of("qwen_image", 3072, 3072, 3072, 256, 0, 64),
       60, &qwen},
      {"cogvideox", "CogVideoX-5B", "cogvideox-conditioning-v1", dims_of("cogvideox", 3072, 512, 512, 3072, 0, 64), 42,
       &cog},
      {"ltx_video", "LTX-Video 2B", "ltx_video-conditioning-v1", dims_of("ltx_video", 2048, 2048, 2048, 256, 0, 128), 28,
       &ltx},
  };
  return kModels;
}

Status find_model_manifest(const std::string& name, const ModelManifest** model) {
  std::string names;
  for (const ModelManifest& m : model_manifests()) {
    if (name == m.name) {
      *model = &m;
      return Status::ok_status();
    }
    names += std::string(names.empty() ? "" : ", ") + m.name;
  }
  return Status::value_error("unknown model \"" + name + "\": expected one of " + names);
}

std::string symbolic_shape_string(const ManifestTemplate& entry) {
  std::string s = "[";
  for (std::size_t d = 0; d < entry.shape.size(); ++d) {
    if (d) s += ", ";
    if (entry.shape[d].multiple != 1 || entry.shape[d].symbol == DimSymbol::kOne)
      s += std::to_string(entry.shape[d].multiple);
    s += symbol_name(entry.shape[d].symbol);
  }
  return s + "]";
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[d]);
  }
  return s + "]";
}

std::vector<ManifestEntry> manifest_entries(const ManifestConfig& config) {
  std::vector<ManifestEntry> entries;
  auto add = [&](const ManifestTemplate& t, int64_t block) {
    ManifestEntry e;
    e.name = expand_block(t.name, block);
    e.dtype = t.dtype;
    for (const SymbolicDim& d : t.shape) e.shape.push_back(resolve(d, config));
    e.role = t.role;
    e.fan_in = t.fan_in_dim >= 0 ? e.shape[static_cast<std::size_t>(t.fan_in_dim)] : 0;
    entries.push_back(std::move(e));
  };
  // Table order, with the block tensors expanded block by block in place.
  const ModelManifest* model = nullptr;
  if (!find_model_manifest(config.model, &model).ok()) return entries;
  const auto& table = *model->templates;
  for (std::size_t i = 0; i < table.size(); ++i) {
    if (std::string(table[i].name).find("{i}") == std::string::npos) {
      add(table[i], 0);
      continue;
    }
    std::size_t end = i;
    while (end < table.size() && std::string(table[end].name).find("{i}") != std::string::npos) ++end;
    for (int64_t block = 0; block < config.blocks; ++block) {
      for (std::size_t j = i; j < end; ++j) add(table[j], block);
    }
    i = end - 1;
  }
  return entries;
}

Status infer_manifest_config(const SafetensorsFile& file, ManifestConfig* config) {
  auto dims_of = [&](const char* name, std::size_t rank, std::vector<int64_t>* shape) -> Status {
    const TensorEntry* e = file.find(name);
    if (e == nullptr) {
      return Status::value_error(file.path() + ": has no tensor \"" + name +
                                 "\", which detdit needs to read the model's dimensions");
    }
    if (e->shape.size() != rank) {
      return Status::value_error(file.path() + ": tensor \"" + name + "\" must have rank " + std::to_string(rank) +
                                 ", got " + shape_to_string(e->shape));
    }
    // A zero dimension would leave the other one unbounded by the file's
    // bytes ([0, 2^40] is an empty tensor), and the ops sized by it with it.
    for (int64_t d : e->shape) {
      if (d < 1) {
        return Status::value_error(file.path() + ": tensor \"" + name + "\" is " + shape_to_string(e->shape) +
                                   ": the model's dimensions must be positive");
      }
    }
    *shape = e->shape;
    return Status::ok_status();
  };
  std::vector<int64_t> norm, linear_1, linear_2;
  DETDIT_RETURN_IF_ERROR(dims_of("norm_out.norm.weight", 1, &norm));
  DETDIT_RETURN_IF_ERROR(dims_of("time_embedder.linear_1.weight", 2, &linear_1));
  DETDIT_RETURN_IF_ERROR(dims_of("time_embedder.linear_2.weight", 2, &linear_2));
  ManifestConfig c;
  c.hidden = norm[0];
  c.time_embed_hidden = linear_1[0];
  c.freq_dim = linear_1[1];
  c.time_embed_dim = linear_2[0];
  c.blocks = 0;
  while (file.find(expand_block("transformer_blocks.{i}.adaln_proj.linear.weight", c.blocks)) != nullptr) ++c.blocks;
  *config = c;
  return Status::ok_status();
}

Status infer_model_config(const SafetensorsFile& file, const ModelManifest& model, ManifestConfig* config) {
  ManifestConfig c = model.dims;
  const DimSymbol symbols[] = {DimSymbol::kHidden, DimSymbol::kTimeHidden, DimSymbol::kTimeDim,
                               DimSymbol::kFreq,   DimSymbol::kPooled,     DimSymbol::kOut};
  for (DimSymbol symbol : symbols) {
    int64_t* value = dimension_of(symbol, &c);
    *value = 0;
    const ManifestTemplate* row = nullptr;
    std::size_t at = 0;
    for (const ManifestTemplate& t : *model.templates) {
      for (std::size_t d = 0; d < t.shape.size() && row == nullptr; ++d)
        if (t.shape[d].symbol == symbol) row = &t, at = d;
      if (row != nullptr) break;
    }
    if (row == nullptr) continue;  // the model has no such dimension (e.g. no pooled text)
    const std::string name = expand_block(row->name, 0);
    const TensorEntry* e = file.find(name);
    if (e == nullptr)
      return Status::value_error(file.path() + ": has no tensor \"" + name + "\", which detdit needs to read the " +
                                 model.title + " model's " + symbol_name(symbol));
    if (e->shape.size() != row->shape.size())
      return Status::value_error(file.path() + ": tensor \"" + name + "\" must have rank " +
                                 std::to_string(row->shape.size()) + ", got " + shape_to_string(e->shape));
    const int64_t multiple = row->shape[at].multiple;
    if (e->shape[at] < multiple || e->shape[at] % multiple != 0)
      return Status::value_error(file.path() + ": tensor \"" + name + "\" is " + shape_to_string(e->shape) +
                                 ": dimension " + std::to_string(at) + " must be a positive multiple of " +
                                 std::to_string(multiple));
    *value = e->shape[at] / multiple;
  }
  c.blocks = 0;
  for (const ManifestTemplate& t : *model.templates) {
    if (std::string(t.name).find("{i}") == std::string::npos) continue;
    while (file.find(expand_block(t.name, c.blocks)) != nullptr) ++c.blocks;
    break;
  }
  *config = c;
  return Status::ok_status();
}

void compare_to_manifest(const SafetensorsFile& file, const ManifestConfig& config,
                         std::vector<std::string>* differences, std::vector<std::string>* extras) {
  std::vector<ManifestEntry> expected = manifest_entries(config);
  for (const ManifestEntry& e : expected) {
    const TensorEntry* got = file.find(e.name);
    if (got == nullptr) {
      differences->push_back("missing: " + e.name + " (" + describe_entry(e.dtype, e.shape) + ")");
      continue;
    }
    if (got->dtype != e.dtype) {
      differences->push_back("dtype: " + e.name + " is " + dtype_name(got->dtype) + ", expected " +
                             dtype_name(e.dtype));
    }
    if (got->shape != e.shape) {
      differences->push_back("shape: " + e.name + " is " + shape_to_string(got->shape) + ", expected " +
                             shape_to_string(e.shape));
    }
  }
  // A set, not a scan per tensor: a file of many tensors (a header may hold
  // millions of zero-size ones) must not make this quadratic.
  std::unordered_set<std::string> known;
  for (const ManifestEntry& e : expected) known.insert(e.name);
  for (const TensorEntry& got : file.entries()) {
    if (known.count(got.name) == 0) extras->push_back(got.name + " (" + describe_entry(got.dtype, got.shape) + ")");
  }
}

}  // namespace io
}  // namespace detdit
