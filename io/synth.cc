// Synthetic weights (synth.h): counter-based splitmix64 -> Box-Muller.
#include "io/synth.h"

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#include "common/fnv1a.h"
#include "common/scalar_math.h"
#include "cpu/parallel.h"
#include "io/files.h"
#include "io/safetensors.h"
#include "io/sha256.h"

namespace detdit {
namespace io {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
constexpr int64_t kPairsPerTask = 1 << 16;  // work unit of the parallel fill; does not affect values

uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}


struct Distribution {
  double mean;
  double std;
};

Distribution distribution_of(const ManifestEntry& e) {
  switch (e.role) {
    case WeightRole::kLinearWeight: return {0.0, 1.0 / std::sqrt(static_cast<double>(e.fan_in))};
    case WeightRole::kLinearBias: return {0.0, 0.02};
    case WeightRole::kNormWeight: return {1.0, 0.05};
  }
  return {0.0, 1.0};
}

// The two normals of pair j of the stream `key` (splitmix64 outputs 2j, 2j+1).
void normal_pair(uint64_t key, uint64_t pair, double* z0, double* z1) {
  const uint64_t a = splitmix64_mix(key + (2 * pair + 1) * kGolden);
  const uint64_t b = splitmix64_mix(key + (2 * pair + 2) * kGolden);
  const double u1 = static_cast<double>((a >> 11) + 1) * 0x1.0p-53;  // (0, 1]: ln is finite
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;        // [0, 1)
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * M_PI * u2;
  *z0 = r * std::cos(angle);
  *z1 = r * std::sin(angle);
}

void store(DType dtype, uint8_t* out, int64_t i, double value) {
  const float v = static_cast<float>(value);
  if (dtype == DType::kF32) {
    std::memcpy(out + 4 * i, &v, 4);
  } else {
    const uint16_t bits = dtype == DType::kBF16 ? num::float_to_bf16(v) : num::float_to_f16(v);
    std::memcpy(out + 2 * i, &bits, 2);
  }
}

}  // namespace

void fill_normal(DType dtype, int64_t numel, uint64_t seed, const std::string& stream_name, double mean, double std,
                 uint8_t* out) {
  const uint64_t key = splitmix64_mix(splitmix64_mix(seed + kGolden) ^ fnv1a(stream_name));
  const int64_t pairs = (numel + 1) / 2;
  const int64_t tasks = (pairs + kPairsPerTask - 1) / kPairsPerTask;
  cpu::parallel_for(0, tasks, [&](int64_t task) {
    const int64_t end = std::min(pairs, (task + 1) * kPairsPerTask);
    for (int64_t j = task * kPairsPerTask; j < end; ++j) {
      double z0, z1;
      normal_pair(key, static_cast<uint64_t>(j), &z0, &z1);
      store(dtype, out, 2 * j, mean + std * z0);
      if (2 * j + 1 < numel) store(dtype, out, 2 * j + 1, mean + std * z1);
    }
  });
}

Status synth_tensor(const ManifestEntry& entry, uint64_t seed, uint8_t* out, uint64_t bytes) {
  if (!dtype_is_float(entry.dtype)) {
    return Status::type_error("synth: tensor \"" + entry.name + "\" must have a float dtype, got " +
                              dtype_name(entry.dtype));
  }
  int64_t numel = 1;
  for (int64_t d : entry.shape) numel *= d;
  if (bytes != static_cast<uint64_t>(numel) * dtype_size(entry.dtype)) {
    return Status::value_error("synth: tensor \"" + entry.name + "\" needs " +
                               std::to_string(numel * static_cast<int64_t>(dtype_size(entry.dtype))) +
                               " bytes, got a buffer of " + std::to_string(bytes));
  }
  if (entry.role == WeightRole::kLinearWeight && entry.fan_in <= 0) {
    return Status::value_error("synth: linear weight \"" + entry.name + "\" has fan_in " +
                               std::to_string(entry.fan_in));
  }
  const Distribution dist = distribution_of(entry);
  fill_normal(entry.dtype, numel, seed, entry.name, dist.mean, dist.std, out);
  return Status::ok_status();
}

Status write_synthetic_weights(const std::string& dir, const SynthOptions& options) {
  const ManifestConfig& c = options.config;
  const ModelManifest* model = nullptr;
  DETDIT_RETURN_IF_ERROR(find_model_manifest(c.model, &model));
  if (c.blocks < 0 || c.hidden <= 0 || c.time_embed_hidden <= 0 || c.time_embed_dim <= 0 || c.freq_dim <= 0) {
    return Status::value_error("synth: dimensions must be positive and blocks >= 0, got blocks=" +
                               std::to_string(c.blocks) + " hidden=" + std::to_string(c.hidden) +
                               " time_embed_hidden=" + std::to_string(c.time_embed_hidden) +
                               " time_embed_dim=" + std::to_string(c.time_embed_dim) +
                               " freq_dim=" + std::to_string(c.freq_dim));
  }
  for (const ManifestEntry& e : manifest_entries(c)) {
    for (int64_t d : e.shape) {
      if (d <= 0)
        return Status::value_error("synth: tensor \"" + e.name + "\" of model " + c.model + " would be " +
                                   shape_to_string(e.shape) + ": every dimension must be positive (pooled_dim=" +
                                   std::to_string(c.pooled_dim) + " out_dim=" + std::to_string(c.out_dim) + ")");
    }
  }
  DETDIT_RETURN_IF_ERROR(make_directories(dir));
  std::vector<ManifestEntry> entries;
  for (ManifestEntry& e : manifest_entries(c)) {
    if (options.only.empty() || e.name.find(options.only) != std::string::npos) entries.push_back(std::move(e));
  }
  if (entries.empty()) {
    return Status::value_error("synth: --only \"" + options.only + "\" matches no manifest tensor");
  }
  std::map<std::string, std::string> digests;
  std::mutex digests_mutex;
  std::vector<TensorToWrite> tensors;
  for (const ManifestEntry& e : entries) {
    TensorToWrite t;
    t.name = e.name;
    t.dtype = e.dtype;
    t.shape = e.shape;
    const uint64_t seed = options.seed;
    t.fill = [e, seed, &digests, &digests_mutex](uint8_t* out, uint64_t bytes) {
      DETDIT_RETURN_IF_ERROR(synth_tensor(e, seed, out, bytes));
      std::string digest;
      try {
        digest = sha256_hex(out, bytes);
      } catch (const std::runtime_error& error) {  // libcrypto cannot run: a Status, as the writer promises
        return Status::runtime_error("synth: tensor \"" + e.name + "\": " + error.what());
      }
      std::lock_guard<std::mutex> lock(digests_mutex);
      digests[e.name] = digest;
      return Status::ok_status();
    };
    tensors.push_back(std::move(t));
  }
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"detdit.kind", "synthetic"},
      {"detdit.manifest", model->version},
      {"detdit.synth_version", std::to_string(kSynthVersion)},
      {"detdit.seed", std::to_string(options.seed)},
      {"detdit.blocks", std::to_string(c.blocks)},
      {"detdit.hidden", std::to_string(c.hidden)},
      {"detdit.time_embed_hidden", std::to_string(c.time_embed_hidden)},
      {"detdit.time_embed_dim", std::to_string(c.time_embed_dim)},
      {"detdit.freq_dim", std::to_string(c.freq_dim)},
      {"detdit.only", options.only},
  };
  if (c.model != "h3") {  // H3's files keep the metadata they always had
    metadata["detdit.model"] = c.model;
    metadata["detdit.pooled_dim"] = std::to_string(c.pooled_dim);
    metadata["detdit.out_dim"] = std::to_string(c.out_dim);
  }
  // The checksums are committed with the weights: SHA256SUMS is renamed into
  // place once the weights' temporary is complete and before that is renamed,
  // and both destinations are checked first, so a failure replaces neither.
  const std::string path = dir + "/" + (c.model == "h3" ? std::string(kWeightsFileName) : model->file_name());
  const std::string sums_path = dir + "/SHA256SUMS";
  DETDIT_RETURN_IF_ERROR(check_replaceable(sums_path));
  auto commit_sums = [&]() {
    std::string sums;
    for (const ManifestEntry& e : entries) sums += digests[e.name] + "  " + e.name + "\n";
    return write_file_atomically(sums_path, sums);
  };
  return write_safetensors(path, tensors, metadata, commit_sums);
}

}  // namespace io
}  // namespace detdit
