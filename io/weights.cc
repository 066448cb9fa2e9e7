#include "io/weights.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "io/files.h"
#include "io/synth.h"

namespace detdit {
namespace io {

std::string weights_file_path(const std::string& dir_or_file, const std::string& model) {
  struct stat st;
  if (::stat(dir_or_file.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return dir_or_file + "/" + (model == "h3" ? std::string(kWeightsFileName) : model + "_conditioning.safetensors");
  }
  return dir_or_file;
}

namespace {

// What the ops that verify and bench run need of the dimensions, checked when
// the weights are loaded: weights the ops must refuse are bad input (exit 2),
// not failed checks (exit 1).
Status check_op_dimensions(const std::string& path, const ManifestConfig& c) {
  struct Need {
    const char* name;
    int64_t value, multiple;
    const char* why;
  };
  const Need needs[] = {
      {"H (norm_out.norm.weight)", c.hidden, 4, "rmsnorm reads its rows as 4-element vectors"},
      {"D (time_embedder.linear_2 outputs)", c.time_embed_dim, 8,
       "the bf16 AdaLN projections read 16-byte vectors of D"},
      {"time_embed_hidden (time_embedder.linear_1 outputs)", c.time_embed_hidden, 4,
       "the fp32 time_embedder.linear_2 reads 16-byte vectors of it"},
      {"F (time_embedder.linear_1 inputs)", c.freq_dim, 4, "the fp32 time_embedder.linear_1 reads 16-byte vectors of F"},
      {"P (the text embedder's linear_1 inputs)", c.pooled_dim, 8, "the bf16 text MLP reads 16-byte vectors of P"},
      {"O (proj_out outputs)", c.out_dim, 1, ""},
  };
  for (const Need& n : needs) {
    if (n.value % n.multiple != 0)
      return Status::value_error(path + ": " + n.name + " = " + std::to_string(n.value) + " must be a multiple of " +
                                 std::to_string(n.multiple) + " (" + n.why + ")");
  }
  return Status::ok_status();
}

}  // namespace

Status load_weights(const std::string& dir_or_file, Weights* weights, const std::string& model) {
  const ModelManifest* manifest = nullptr;
  DETDIT_RETURN_IF_ERROR(find_model_manifest(model, &manifest));
  Weights w;
  w.path = weights_file_path(dir_or_file, model);
  DETDIT_RETURN_IF_ERROR(SafetensorsFile::open(w.path, &w.file));
  if (model == "h3") {
    DETDIT_RETURN_IF_ERROR(infer_manifest_config(w.file, &w.config));
  } else {
    DETDIT_RETURN_IF_ERROR(infer_model_config(w.file, *manifest, &w.config));
  }
  if (w.config.blocks == 0) {
    std::string first_block;
    for (const ManifestTemplate& t : *manifest->templates)
      if (first_block.empty() && std::string(t.name).find("{i}") != std::string::npos) first_block = t.name;
    first_block.replace(first_block.find("{i}"), 3, "0");
    return Status::value_error(w.path + ": has no " + first_block);
  }
  DETDIT_RETURN_IF_ERROR(check_op_dimensions(w.path, w.config));
  std::vector<std::string> differences, extras;
  compare_to_manifest(w.file, w.config, &differences, &extras);
  if (!differences.empty()) {
    std::string message = w.path + ": does not match manifest " + manifest->version + ":";
    for (const std::string& d : differences) message += "\n  " + d;
    return Status::value_error(message);
  }
  auto kind = w.file.metadata().find("detdit.kind");
  w.synthetic = kind != w.file.metadata().end() && kind->second == "synthetic";
  *weights = std::move(w);
  return Status::ok_status();
}

Status synthetic_cache_dir(const ManifestConfig& config, uint64_t seed, std::string* dir) {
  std::string root;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  if (xdg != nullptr && xdg[0] == '/') {
    root = std::string(xdg) + "/detdit";
  } else if (home != nullptr && home[0] != '\0') {
    root = std::string(home) + "/.cache/detdit";
  } else {
    return Status::runtime_error(
        "cannot place the synthetic weights cache: neither XDG_CACHE_HOME nor HOME is set (pass --weights DIR)");
  }
  const ModelManifest* model = nullptr;
  DETDIT_RETURN_IF_ERROR(find_model_manifest(config.model, &model));
  // A model's released dimensions keep the short name (H3's the name it always had).
  ManifestConfig released = model->dims;
  released.blocks = config.blocks;
  std::string dims = config == released ? "" : "-H" + std::to_string(config.hidden) + "-Ht" +
                                                   std::to_string(config.time_embed_hidden) + "-D" +
                                                   std::to_string(config.time_embed_dim) + "-F" +
                                                   std::to_string(config.freq_dim);
  if (!dims.empty() && config.model != "h3")
    dims += "-P" + std::to_string(config.pooled_dim) + "-O" + std::to_string(config.out_dim);
  *dir = root + "/synth-v" + std::to_string(kSynthVersion) + "-" + model->version + dims + "-b" +
         std::to_string(config.blocks) + "-s" + std::to_string(seed);
  return Status::ok_status();
}

namespace {

// A cached file is used only when it is the synthetic weights of exactly
// this (version, blocks, seed, dimensions) and matches the manifest.
bool cache_is_usable(const std::string& dir, const ManifestConfig& config, uint64_t seed, Weights* weights) {
  Weights w;
  if (!load_weights(dir, &w, config.model).ok() || !w.synthetic) return false;
  const auto& m = w.file.metadata();
  auto is = [&](const char* key, const std::string& value) {
    auto it = m.find(key);
    return it != m.end() && it->second == value;
  };
  if (!(w.config == config) || !is("detdit.synth_version", std::to_string(kSynthVersion)) ||
      !is("detdit.seed", std::to_string(seed)) || !is("detdit.only", "")) {
    return false;
  }
  *weights = std::move(w);
  return true;
}

}  // namespace

Status resolve_weights(const std::string& weights_option, const ManifestConfig& config, uint64_t seed,
                       bool announce, Weights* weights) {
  if (!weights_option.empty()) return load_weights(weights_option, weights, config.model);
  std::string dir;
  DETDIT_RETURN_IF_ERROR(synthetic_cache_dir(config, seed, &dir));
  if (cache_is_usable(dir, config, seed, weights)) return Status::ok_status();
  remove_temporaries_on_signals();  // an interrupted generation leaves no partial cache entry
  if (announce) {
    std::fprintf(stderr, "detdit: generating the default synthetic weights (%s, H=%lld, blocks=%lld, seed=%llu) into %s ...\n",
                 config.model.c_str(), static_cast<long long>(config.hidden), static_cast<long long>(config.blocks),
                 static_cast<unsigned long long>(seed), dir.c_str());
  }
  auto start = std::chrono::steady_clock::now();
  SynthOptions options;
  options.config = config;
  options.seed = seed;
  DETDIT_RETURN_IF_ERROR(write_synthetic_weights(dir, options));
  if (announce) {
    std::fprintf(stderr, "detdit: done in %.1f s (cached for later runs)\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return load_weights(dir, weights, config.model);
}

}  // namespace io
}  // namespace detdit
