// The H3 manifest (io/manifest.h) against the pinned tensors of docs/weights.md, its
// block expansion, docs/weights.md, config inference and comparison, and the
// synthetic weights (io/synth.h): determinism, independence of each
// tensor from the others and from the block count, and realistic scales.
#include <sys/stat.h>
#include <unistd.h>

#include <set>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "support/child_process.h"
#include "common/scalar_math.h"
#include "support/test_util.h"
#include "io/manifest.h"
#include "io/safetensors.h"
#include "io/sha256.h"
#include "io/synth.h"

namespace detdit {
namespace {

using io::ManifestConfig;
using io::ManifestEntry;

// The H3 conditioning tensors of block 0 as the model ships them (the table of
// docs/weights.md), written out here independently of io/manifest.cc.
struct Pinned {
  const char* name;
  DType dtype;
  std::vector<int64_t> shape;
};
const std::vector<Pinned> kSpecPinned = {
    {"time_embedder.linear_1.weight", DType::kF32, {5376, 256}},
    {"time_embedder.linear_1.bias", DType::kF32, {5376}},
    {"time_embedder.linear_2.weight", DType::kF32, {2688, 5376}},
    {"time_embedder.linear_2.bias", DType::kF32, {2688}},
    {"transformer_blocks.0.adaln_proj.linear.weight", DType::kBF16, {96768, 2688}},
    {"transformer_blocks.0.adaln_proj.linear.bias", DType::kBF16, {96768}},
    {"transformer_blocks.0.norm1.weight", DType::kBF16, {5376}},
    {"transformer_blocks.0.norm2.weight", DType::kBF16, {5376}},
    {"token_refiner.final_norm.weight", DType::kBF16, {5376}},
    {"norm_out.norm.weight", DType::kBF16, {5376}},
    {"norm_out.linear.weight", DType::kBF16, {10752, 2688}},
    {"norm_out.linear.bias", DType::kBF16, {10752}},
};

const ManifestEntry* find(const std::vector<ManifestEntry>& entries, const std::string& name) {
  for (const ManifestEntry& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::string temp_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/detdit_manifest_" + std::to_string(::getpid()) + "_" + name;
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

ManifestConfig small_config(int64_t blocks) {
  ManifestConfig c;
  c.blocks = blocks;
  c.hidden = 64;
  c.time_embed_hidden = 48;
  c.time_embed_dim = 32;
  c.freq_dim = 16;
  return c;
}

TEST(Manifest, MatchesTheSpecsPinnedTensors) {
  const std::vector<ManifestEntry> entries = io::manifest_entries(ManifestConfig{});
  ASSERT_EQ(entries.size(), kSpecPinned.size());
  for (const Pinned& p : kSpecPinned) {
    const ManifestEntry* e = find(entries, p.name);
    ASSERT_NE(e, nullptr) << p.name;
    EXPECT_EQ(e->dtype, p.dtype) << p.name;
    EXPECT_EQ(e->shape, p.shape) << p.name;
  }
}

TEST(Manifest, ExpandsBlocksInOrder) {
  ManifestConfig c;
  c.blocks = 50;
  const std::vector<ManifestEntry> entries = io::manifest_entries(c);
  EXPECT_EQ(entries.size(), 4u + 4u * 50u + 4u);
  std::set<std::string> names;
  for (const ManifestEntry& e : entries) EXPECT_TRUE(names.insert(e.name).second) << "duplicate " << e.name;
  EXPECT_EQ(entries[4].name, "transformer_blocks.0.adaln_proj.linear.weight");
  EXPECT_EQ(entries[8].name, "transformer_blocks.1.adaln_proj.linear.weight");
  EXPECT_EQ(entries[4 + 4 * 49 + 3].name, "transformer_blocks.49.norm2.weight");
  EXPECT_EQ(find(entries, "transformer_blocks.50.norm1.weight"), nullptr);
  // fan_in is the linear's input features; 0 for biases and norms.
  EXPECT_EQ(find(entries, "transformer_blocks.7.adaln_proj.linear.weight")->fan_in, 2688);
  EXPECT_EQ(find(entries, "time_embedder.linear_1.weight")->fan_in, 256);
  EXPECT_EQ(find(entries, "time_embedder.linear_2.weight")->fan_in, 5376);
  EXPECT_EQ(find(entries, "norm_out.linear.bias")->fan_in, 0);
  EXPECT_EQ(io::manifest_entries(ManifestConfig{0}).size(), 8u);
}

// docs/weights.md lists every model's manifest template with its dtype and
// shape, each family's under a heading naming its manifest version.
TEST(Manifest, DocListsEveryEntry) {
  std::ifstream in(std::string(DETDIT_SOURCE_DIR) + "/docs/weights.md");
  ASSERT_TRUE(in) << "docs/weights.md is missing";
  std::stringstream text;
  text << in.rdbuf();
  const std::string doc = text.str();
  for (const io::ModelManifest& m : io::model_manifests()) {
    const std::size_t section = std::string(m.name) == "h3" ? 0 : doc.find(std::string("`") + m.version + "`");
    ASSERT_NE(section, std::string::npos) << "docs/weights.md does not name " << m.version;
    for (const io::ManifestTemplate& t : *m.templates) {
      const std::string row = std::string("| `") + t.name + "` | " + dtype_name(t.dtype) + " | `" +
                              io::symbolic_shape_string(t) + "` |";
      EXPECT_NE(doc.find(row, section), std::string::npos)
          << "docs/weights.md lacks, after " << m.version << ", the row starting\n" << row;
    }
  }
}

// Every family's synthetic weights at small dimensions: the dimensions read
// back, no difference from the manifest, the file named after the model.
TEST(Manifest, FamiliesSynthInferAndCompare) {
  for (const io::ModelManifest& m : io::model_manifests()) {
    if (std::string(m.name) == "h3") continue;
    SCOPED_TRACE(m.name);
    io::SynthOptions options;
    options.config = m.dims;
    options.config.blocks = 2;
    options.config.hidden = 16;
    options.config.time_embed_hidden = 24;
    options.config.time_embed_dim = 8;
    options.config.freq_dim = 12;
    options.config.pooled_dim = m.dims.pooled_dim > 0 ? 40 : 0;
    options.config.out_dim = 4;
    const std::string dir = temp_dir(std::string("family_") + m.name);
    DETDIT_ASSERT_OK(io::write_synthetic_weights(dir, options));
    io::SafetensorsFile file;
    DETDIT_ASSERT_OK(io::SafetensorsFile::open(dir + "/" + m.file_name(), &file));
    EXPECT_EQ(file.metadata().at("detdit.manifest"), m.version);
    ManifestConfig inferred;
    DETDIT_ASSERT_OK(io::infer_model_config(file, m, &inferred));
    EXPECT_TRUE(inferred == options.config)
        << "H " << inferred.hidden << " Ht " << inferred.time_embed_hidden << " D " << inferred.time_embed_dim << " F "
        << inferred.freq_dim << " P " << inferred.pooled_dim << " O " << inferred.out_dim << " blocks "
        << inferred.blocks;
    std::vector<std::string> differences, extras;
    io::compare_to_manifest(file, options.config, &differences, &extras);
    EXPECT_TRUE(differences.empty()) << differences[0];
    EXPECT_TRUE(extras.empty());
    // Another family's file: its tensors are missing.
    const io::ModelManifest* other = nullptr;
    DETDIT_ASSERT_OK(io::find_model_manifest(std::string(m.name) == "ltx_video" ? "flux" : "ltx_video", &other));
    EXPECT_EQ(io::infer_model_config(file, *other, &inferred).kind(), ErrorKind::kValue);
  }
  const io::ModelManifest* none = nullptr;
  const Status s = io::find_model_manifest("flux2", &none);
  EXPECT_EQ(s.kind(), ErrorKind::kValue);
  EXPECT_NE(s.message().find("expected one of h3, sd35, flux"), std::string::npos) << s.message();
}

io::SafetensorsFile synth_and_open(const std::string& dir, const io::SynthOptions& options) {
  Status s = io::write_synthetic_weights(dir, options);
  EXPECT_TRUE(s.ok()) << s.to_string();
  io::SafetensorsFile file;
  s = io::SafetensorsFile::open(dir + "/" + io::kWeightsFileName, &file);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return file;
}

TEST(Manifest, InferAndCompare) {
  io::SynthOptions options;
  options.config = small_config(2);
  io::SafetensorsFile file = synth_and_open(temp_dir("infer"), options);
  ManifestConfig inferred;
  DETDIT_ASSERT_OK(io::infer_manifest_config(file, &inferred));
  EXPECT_TRUE(inferred == options.config);
  std::vector<std::string> differences, extras;
  io::compare_to_manifest(file, options.config, &differences, &extras);
  EXPECT_TRUE(differences.empty()) << differences[0];
  EXPECT_TRUE(extras.empty());
  // Against the H3 shapes every tensor differs in shape; with 3 blocks the
  // third block is missing; with 1 block the second is extra.
  io::compare_to_manifest(file, ManifestConfig{2}, &differences, &extras);
  EXPECT_EQ(differences.size(), 16u);
  EXPECT_EQ(differences[0], "shape: time_embedder.linear_1.weight is [48, 16], expected [5376, 256]");
  differences.clear();
  ManifestConfig three = small_config(3);
  io::compare_to_manifest(file, three, &differences, &extras);
  ASSERT_EQ(differences.size(), 4u);
  EXPECT_EQ(differences[0], "missing: transformer_blocks.2.adaln_proj.linear.weight (bfloat16 [1152, 32])");
  differences.clear();
  io::compare_to_manifest(file, small_config(1), &differences, &extras);
  EXPECT_TRUE(differences.empty());
  ASSERT_EQ(extras.size(), 4u);
  EXPECT_EQ(extras[0], "transformer_blocks.1.adaln_proj.linear.weight (bfloat16 [1152, 32])");
}

TEST(Manifest, InferNeedsTheDefiningTensors) {
  io::SynthOptions options;
  options.config = small_config(1);
  options.only = "time_embedder";
  io::SafetensorsFile file = synth_and_open(temp_dir("partial"), options);
  ManifestConfig inferred;
  Status s = io::infer_manifest_config(file, &inferred);
  EXPECT_EQ(s.kind(), ErrorKind::kValue);
  EXPECT_NE(s.message().find("has no tensor \"norm_out.norm.weight\""), std::string::npos) << s.message();
}

// Reading the dimensions of a file of many blocks and comparing it with their
// manifest is linear in the tensor count: 200,000 zero-size block tensors
// (11 MB of header) take about 2 s (6 s under ASan); with a name scan per
// tensor 50,000 took 6.5 s, so 200,000 about 100 s. The deadline leaves room
// for a loaded machine and a sanitizer build.
TEST(Manifest, ManyBlocksInferAndCompareInLinearTime) {
  constexpr int kBlocks = 200000;
  std::string header = R"({"norm_out.norm.weight":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},)"
                       R"("time_embedder.linear_1.weight":{"dtype":"F32","shape":[1,1],"data_offsets":[2,6]},)"
                       R"("time_embedder.linear_2.weight":{"dtype":"F32","shape":[1,1],"data_offsets":[6,10]})";
  for (int i = 0; i < kBlocks; ++i) {
    header += ",\"transformer_blocks." + std::to_string(i) +
              ".adaln_proj.linear.weight\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[10,10]}";
  }
  header += "}";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((uint64_t{header.size()} >> (8 * i)) & 0xff);
  bytes += header + std::string(10, '\0');
  const testing::ChildOutcome outcome = testing::run_in_child(
      [&] {
        io::SafetensorsFile file;
        ManifestConfig config;
        if (!io::SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "many", &file)
                 .ok() ||
            !io::infer_manifest_config(file, &config).ok() || config.blocks != kBlocks) {
          return 1;
        }
        std::vector<std::string> differences, extras;
        io::compare_to_manifest(file, config, &differences, &extras);
        // Every block misses 3 tensors and has a mis-shaped weight; 5 tensors outside the blocks are missing.
        return differences.size() == 4u * kBlocks + 5 && extras.empty() ? 0 : 2;
      },
      /*timeout_seconds=*/45);
  EXPECT_TRUE(outcome.passed()) << "1: parse or infer failed, 2: wrong differences; " << outcome.describe();
}

TEST(Synth, DeterministicAndIndependent) {
  io::SynthOptions one;
  one.config = small_config(1);
  io::SynthOptions three = one;
  three.config.blocks = 3;
  io::SynthOptions only = one;
  only.only = "norm_out.linear.weight";
  io::SynthOptions reseeded = one;
  reseeded.seed = 1;
  io::SafetensorsFile a = synth_and_open(temp_dir("a"), one);
  io::SafetensorsFile again = synth_and_open(temp_dir("again"), one);
  io::SafetensorsFile b = synth_and_open(temp_dir("b"), three);
  io::SafetensorsFile c = synth_and_open(temp_dir("c"), only);
  io::SafetensorsFile d = synth_and_open(temp_dir("d"), reseeded);
  ASSERT_EQ(c.entries().size(), 1u);
  for (const io::TensorEntry& e : a.entries()) {
    const io::TensorEntry* e2 = again.find(e.name);
    const io::TensorEntry* e3 = b.find(e.name);
    const io::TensorEntry* e5 = d.find(e.name);
    ASSERT_TRUE(e2 && e3 && e5) << e.name;
    EXPECT_TRUE(testing::bitwise_equal_bytes(a.data(e), again.data(*e2), e.numel(), e.dtype)) << e.name;
    EXPECT_TRUE(testing::bitwise_equal_bytes(a.data(e), b.data(*e3), e.numel(), e.dtype))
        << e.name << " changed with the block count";
    EXPECT_NE(0, std::memcmp(a.data(e), d.data(*e5), e.nbytes())) << e.name << " ignores the seed";
  }
  const io::TensorEntry* w = c.find("norm_out.linear.weight");
  EXPECT_TRUE(testing::bitwise_equal_bytes(a.data(*a.find(w->name)), c.data(*w), w->numel(), w->dtype));
  // Blocks differ from each other (their names differ).
  EXPECT_NE(0, std::memcmp(b.data(*b.find("transformer_blocks.0.norm1.weight")),
                           b.data(*b.find("transformer_blocks.1.norm1.weight")), 128));
}

// Sample mean and standard deviation match the documented distributions.
TEST(Synth, RealisticScales) {
  io::SynthOptions options;
  options.config = small_config(1);
  options.config.hidden = 256;
  options.config.time_embed_dim = 128;
  const std::string dir = temp_dir("scales");
  io::SafetensorsFile file = synth_and_open(dir, options);
  struct Expect {
    const char* name;
    double mean, std;
  };
  for (const Expect& x : {Expect{"transformer_blocks.0.adaln_proj.linear.weight", 0.0, 1.0 / std::sqrt(128.0)},
                          Expect{"transformer_blocks.0.adaln_proj.linear.bias", 0.0, 0.02},
                          Expect{"norm_out.norm.weight", 1.0, 0.05},
                          Expect{"time_embedder.linear_1.weight", 0.0, 1.0 / std::sqrt(16.0)}}) {
    TensorView v;
    DETDIT_ASSERT_OK(file.view(x.name, &v));
    double sum = 0, sum_sq = 0;
    const int64_t n = v.numel();
    for (int64_t i = 0; i < n; ++i) {
      const double value = v.dtype == DType::kF32
                                ? static_cast<const float*>(v.data)[i]
                                : num::bf16_to_float(static_cast<const uint16_t*>(v.data)[i]);
      sum += value;
      sum_sq += value * value;
    }
    const double mean = sum / n, std = std::sqrt(sum_sq / n - mean * mean);
    // 5 standard errors of the mean and of the std (n >= 256).
    EXPECT_NEAR(mean, x.mean, 5 * x.std / std::sqrt(double(n))) << x.name;
    EXPECT_NEAR(std, x.std, 5 * x.std / std::sqrt(2.0 * n) + 0.004 * x.std) << x.name;
  }
  // SHA256SUMS lists every tensor with the digest of its bytes.
  std::ifstream sums(dir + "/SHA256SUMS");
  std::string hex, name;
  int lines = 0;
  while (sums >> hex >> name) {
    const io::TensorEntry* e = file.find(name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(hex, io::sha256_hex(file.data(*e), e->nbytes())) << name;
    ++lines;
  }
  EXPECT_EQ(lines, static_cast<int>(file.entries().size()));
}

}  // namespace
}  // namespace detdit
