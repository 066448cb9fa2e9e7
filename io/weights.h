// Where a command's weights come from: --weights DIR (real or any prepared
// weights), or else the embedded default: synthetic weights (io/synth.h)
// generated on first use and cached under $XDG_CACHE_HOME/detdit (or
// ~/.cache/detdit) in synth-v<version>-<manifest>[-<dims>]-b<blocks>-s<seed>/
// (<dims> only for dimensions other than H3's). At H3's dimensions with
// blocks = 1, seed = 0 it is about 0.6 GB; verify's default dimensions
// are smaller.
#pragma once

#include <cstdint>
#include <string>

#include "detdit/status.h"
#include "io/manifest.h"
#include "io/safetensors.h"

namespace detdit {
namespace io {

struct Weights {
  std::string path;       // the safetensors file
  bool synthetic = false; // metadata says detdit.kind = synthetic
  SafetensorsFile file;
  ManifestConfig config;  // read from the file's shapes
  // A CPU view of a manifest tensor (ValueError naming the file when absent).
  Status view(const std::string& name, TensorView* view) const { return file.view(name, view); }
};

// DIR may be a directory holding the model's file (h3_conditioning.safetensors,
// <model>_conditioning.safetensors) or the file.
std::string weights_file_path(const std::string& dir_or_file, const std::string& model = "h3");

// Opens the file, reads its dimensions (as `model`'s manifest names them),
// checks that the ops can run on them (H, D, time_embed_hidden and F
// multiples of their vector widths) and checks the file against the manifest
// of those dimensions (every difference listed in a ValueError naming the file).
Status load_weights(const std::string& dir_or_file, Weights* weights, const std::string& model = "h3");

// The cache directory of the synthetic default of `config` (not created).
Status synthetic_cache_dir(const ManifestConfig& config, uint64_t seed, std::string* dir);

// --weights DIR when given (as config.model's weights), else the cached
// synthetic default of `config` (its model, dimensions and blocks), generated now if absent or unusable
// (`announce` is told when that happens: it takes a while).
Status resolve_weights(const std::string& weights_option, const ManifestConfig& config, uint64_t seed,
                       bool announce, Weights* weights);

}  // namespace io
}  // namespace detdit
