// The h3-conditioning-v1 manifest table and its checks (manifest.h).
#include "io/manifest.h"

#include <cstdio>
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

int64_t resolve(const SymbolicDim& dim, const ManifestConfig& c) {
  switch (dim.symbol) {
    case DimSymbol::kHidden: return dim.multiple * c.hidden;
    case DimSymbol::kTimeHidden: return dim.multiple * c.time_embed_hidden;
    case DimSymbol::kTimeDim: return dim.multiple * c.time_embed_dim;
    case DimSymbol::kFreq: return dim.multiple * c.freq_dim;
  }
  return 0;
}

const char* symbol_name(DimSymbol symbol) {
  switch (symbol) {
    case DimSymbol::kHidden: return "H";
    case DimSymbol::kTimeHidden: return "Ht";
    case DimSymbol::kTimeDim: return "D";
    case DimSymbol::kFreq: return "F";
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

std::string symbolic_shape_string(const ManifestTemplate& entry) {
  std::string s = "[";
  for (std::size_t d = 0; d < entry.shape.size(); ++d) {
    if (d) s += ", ";
    if (entry.shape[d].multiple != 1) s += std::to_string(entry.shape[d].multiple);
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
  const auto& table = manifest_templates();
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
