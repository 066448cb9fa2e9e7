// The MiniMax-H3 conditioning tensors (manifest h3-conditioning-v1, docs/weights.md):
// one table shared by the weights tools, the verify cases and docs/weights.md
// (tests/cpu/manifest_test.cc checks the doc lists every entry).
//
// Names follow diffusers' MiniMaxH3Transformer3DModel state dict. The block
// tensors repeat for i in [0, blocks): H3 has 50 blocks, the pinned
// extraction (h3_conditioning.safetensors) and the synthetic default hold 1.
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
  bool operator==(const ManifestConfig& o) const {
    return blocks == o.blocks && hidden == o.hidden && time_embed_hidden == o.time_embed_hidden &&
           time_embed_dim == o.time_embed_dim && freq_dim == o.freq_dim;
  }
};

// What a tensor is, which sets its synthetic distribution (synth.h).
enum class WeightRole { kLinearWeight, kLinearBias, kNormWeight };

// A symbolic dimension: multiple * one of H (hidden), Ht (time_embed_hidden),
// D (time_embed_dim), F (freq_dim).
enum class DimSymbol { kHidden, kTimeHidden, kTimeDim, kFreq };
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
const std::vector<ManifestTemplate>& manifest_templates();

struct ManifestEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  WeightRole role;
  int64_t fan_in;  // input features of a linear weight (0 for biases and norms)
};
// Every tensor of the configuration, blocks expanded in ascending i.
std::vector<ManifestEntry> manifest_entries(const ManifestConfig& config);

// Dimensions read from a file's tensors (norm_out.norm.weight gives H,
// time_embedder.linear_1/2 give the time-embed sizes and freq_dim; blocks is
// the count of consecutive transformer_blocks.{i}.adaln_proj.linear.weight
// from i = 0). ValueError naming the file when a defining tensor is absent,
// has the wrong rank or a dimension below 1 (so that every dimension is
// bounded by the bytes of the tensors the manifest then requires).
Status infer_manifest_config(const SafetensorsFile& file, ManifestConfig* config);

// Differences between a file and the manifest of `config`, one readable line
// each ("missing: NAME (bfloat16 [5376])", "shape: NAME is [..], expected
// [..]", "dtype: ..."). Extra tensors are listed in `extras` (not differences:
// real checkpoints carry more than the conditioning path).
void compare_to_manifest(const SafetensorsFile& file, const ManifestConfig& config,
                         std::vector<std::string>* differences, std::vector<std::string>* extras);

std::string shape_to_string(const std::vector<int64_t>& shape);  // "[96768, 2688]"

}  // namespace io
}  // namespace detdit
