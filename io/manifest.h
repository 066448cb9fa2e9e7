// The conditioning tensors of each model detdit verifies (docs/weights.md):
// MiniMax-H3's (manifest h3-conditioning-v1, the default) and one manifest
// per DiT family of docs/models.md (<model>-conditioning-v1): one table per
// model shared by the weights tools, the verify cases and docs/weights.md
// (tests/cpu/manifest_test.cc checks the doc lists every entry).
//
// Names follow the model's diffusers state dict. The block tensors repeat
// for i in [0, blocks): H3 has 50 blocks, the pinned extraction
// (h3_conditioning.safetensors) and the synthetic default hold 1.
// Dimensions are parameters so small test configurations use the same table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "detdit/status.h"
#include "detdit/tensor.h"
#include "io/safetensors.h"

namespace detdit {
namespace io {

constexpr const char* kManifestVersion = "h3-conditioning-v1";
// The file name inside a weights directory (the reference's extraction name).
constexpr const char* kWeightsFileName = "h3_conditioning.safetensors";

struct ManifestConfig {
  int64_t blocks = 1;               // transformer blocks held (H3 has 50)
  int64_t hidden = 5376;            // H
  int64_t time_embed_hidden = 5376; // time_embedder.linear_1 output
  int64_t time_embed_dim = 2688;    // D
  int64_t freq_dim = 256;           // sinusoid channels
  int64_t pooled_dim = 0;           // P: the pooled text's width (families with a text embedder)
  int64_t out_dim = 0;              // O: proj_out's outputs (the families' final layer)
  std::string model = "h3";         // the manifest: "h3" or a family's name (model_manifests)
  bool operator==(const ManifestConfig& o) const {
    return model == o.model && blocks == o.blocks && hidden == o.hidden && time_embed_hidden == o.time_embed_hidden &&
           time_embed_dim == o.time_embed_dim && freq_dim == o.freq_dim && pooled_dim == o.pooled_dim &&
           out_dim == o.out_dim;
  }
};

// What a tensor is, which sets its synthetic distribution (synth.h).
enum class WeightRole { kLinearWeight, kLinearBias, kNormWeight };

// A symbolic dimension: multiple * one of H (hidden), Ht (time_embed_hidden),
// D (time_embed_dim), F (freq_dim), P (pooled_dim), O (out_dim), or the
// number `multiple` itself (kOne).
enum class DimSymbol { kHidden, kTimeHidden, kTimeDim, kFreq, kPooled, kOut, kOne };
struct SymbolicDim {
  int64_t multiple;
  DimSymbol symbol;
};

// One row of the manifest table, before block expansion.
struct ManifestTemplate {
  const char* name;  // "{i}" stands for the block index
  DType dtype;
  std::vector<SymbolicDim> shape;
  WeightRole role;
  int fan_in_dim;     // index into shape of the linear's input features; -1 for norms and biases
  const char* purpose;
};
// "[18H, D]", as docs/weights.md prints it.
std::string symbolic_shape_string(const ManifestTemplate& entry);
// MiniMax-H3's table.
const std::vector<ManifestTemplate>& manifest_templates();

// A model detdit verifies: its name (`--model NAME`), what it is, its
// manifest version, the file a weights directory holds, the released
// model's dimensions (blocks: 1, what the synthetic default holds; `real_blocks`
// the released count) and its table. "h3" is MiniMax-H3's (kManifestVersion).
struct ModelManifest {
  const char* name;     // "flux"
  const char* title;    // "Flux.1-dev"
  const char* version;  // "flux-conditioning-v1"
  ManifestConfig dims;
  int64_t real_blocks;
  const std::vector<ManifestTemplate>* templates;
  std::string file_name() const { return std::string(name) + "_conditioning.safetensors"; }
};
const std::vector<ModelManifest>& model_manifests();
// The model named `name`; a ValueError listing every name when there is none.
Status find_model_manifest(const std::string& name, const ModelManifest** model);

struct ManifestEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  WeightRole role;
  int64_t fan_in;  // input features of a linear weight (0 for biases and norms)
};
// Every tensor of the configuration (its model's table), blocks expanded in
// ascending i; none for an unknown model.
std::vector<ManifestEntry> manifest_entries(const ManifestConfig& config);

// Dimensions read from a file's tensors (norm_out.norm.weight gives H,
// time_embedder.linear_1/2 give the time-embed sizes and freq_dim; blocks is
// the count of consecutive transformer_blocks.{i}.adaln_proj.linear.weight
// from i = 0). ValueError naming the file when a defining tensor is absent,
// has the wrong rank or a dimension below 1 (so that every dimension is
// bounded by the bytes of the tensors the manifest then requires).
Status infer_manifest_config(const SafetensorsFile& file, ManifestConfig* config);
// The same for a family's file: every dimension read from the first table
// row (block 0 for block rows) that holds it, blocks the count of consecutive
// blocks of the table's first block row; the same ValueErrors.
Status infer_model_config(const SafetensorsFile& file, const ModelManifest& model, ManifestConfig* config);

// Differences between a file and the manifest of `config`, one readable line
// each ("missing: NAME (bfloat16 [5376])", "shape: NAME is [..], expected
// [..]", "dtype: ..."). Extra tensors are listed in `extras` (not differences:
// real checkpoints carry more than the conditioning path).
void compare_to_manifest(const SafetensorsFile& file, const ManifestConfig& config,
                         std::vector<std::string>* differences, std::vector<std::string>* extras);

std::string shape_to_string(const std::vector<int64_t>& shape);  // "[96768, 2688]"

}  // namespace io
}  // namespace detdit
