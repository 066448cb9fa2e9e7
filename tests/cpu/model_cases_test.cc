// The DiT families' paths of verify --model (cases/model_cases.h) are wired as
// docs/models.md says: each site reads the chunks of the AdaLN table that
// the family's diffusers module assigns it (AdaLayerNormZero and Wan's table
// shift first, AdaLayerNormContinuous scale first, CogVideoX's FFN from its
// norm2 projection), and each chained input is the bytes the earlier site's
// CPU run gives (or their one rounding to the site's dtype). Small synthetic
// weights of each family.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cases/model_cases.h"
#include "io/synth.h"
#include "io/weights.h"
#include "support/test_util.h"

namespace detdit {
namespace {

using cases::HostTensor;
using cases::ModelSite;
using cases::OpCase;

struct Path {
  io::Weights weights;
  std::vector<ModelSite> sites;
};

void build(const std::string& model, Path* path) {
  const io::ModelManifest* m = nullptr;
  DETDIT_ASSERT_OK(io::find_model_manifest(model, &m));
  io::SynthOptions options;
  options.config = m->dims;
  options.config.hidden = 16;
  options.config.time_embed_hidden = options.config.time_embed_dim = 16;
  options.config.freq_dim = 16;
  options.config.pooled_dim = m->dims.pooled_dim > 0 ? 8 : 0;
  options.config.out_dim = 4;
  const std::string dir = ::testing::TempDir() + "/detdit_model_cases_" + model;
  DETDIT_ASSERT_OK(io::write_synthetic_weights(dir, options));
  DETDIT_ASSERT_OK(io::load_weights(dir, &path->weights, model));
  cases::CaseContext ctx;
  ctx.model = model;
  ctx.hidden = path->weights.config.hidden;
  ctx.time_embed_dim = path->weights.config.time_embed_dim;
  ctx.time_embed_hidden = path->weights.config.time_embed_hidden;
  ctx.freq_dim = path->weights.config.freq_dim;
  ctx.pooled_dim = path->weights.config.pooled_dim;
  ctx.out_dim = path->weights.config.out_dim;
  ctx.quick = true;
  const io::Weights* w = &path->weights;
  ctx.weight = [w](const std::string& name, TensorView* view) { return w->view(name, view); };
  DETDIT_ASSERT_OK(cases::model_sites(ctx, &path->sites));
}

const OpCase& site(const Path& p, const std::string& starts) {
  for (const ModelSite& s : p.sites)
    if (s.site.rfind(starts, 0) == 0) return s.c;
  ADD_FAILURE() << "no site starting \"" << starts << "\"";
  std::abort();
}

std::map<std::string, HostTensor> inputs_of(const OpCase& c) {
  std::map<std::string, HostTensor> in;
  cases::make_inputs(c, &in);
  return in;
}

std::map<std::string, HostTensor> outputs_of(const OpCase& c) {
  cases::Instance instance;
  EXPECT_TRUE(cases::instantiate(c, Device::cpu(), nullptr, &instance).ok());
  EXPECT_TRUE(cases::run(c, cases::Phase::kForward, instance).ok());
  std::map<std::string, HostTensor> out;
  EXPECT_TRUE(cases::download_outputs(c, instance, &out).ok());
  return out;
}

// Chunk c (of `chunks`) of every row of `table`, as doubles.
std::vector<double> chunk(const HostTensor& table, int64_t chunks, int c, int64_t hidden) {
  std::vector<double> v;
  const int64_t rows = table.numel() / (chunks * hidden);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < hidden; ++h) v.push_back(table.get((r * chunks + c) * hidden + h));
  return v;
}

double round_bf16(double v) {
  HostTensor one(DType::kBF16, {1});
  one.set(0, v);
  return one.get(0);
}

std::vector<double> values(const HostTensor& t) {
  std::vector<double> v;
  for (int64_t i = 0; i < t.numel(); ++i) v.push_back(t.get(i));
  return v;
}

TEST(ModelCases, FluxReadsShiftFirstInTheBlockAndScaleFirstInTheFinalLayer) {
  Path p;
  build("flux", &p);
  const int64_t H = 16;
  const HostTensor table = outputs_of(site(p, "AdaLN projection, 6 chunks (AdaLayerNormZero (image stream))"))["table"];
  const auto norm1 = inputs_of(site(p, "norm1"));
  EXPECT_EQ(chunk(norm1.at("modulation"), 6, 0, H), chunk(table, 6, 0, H));  // shift_msa
  EXPECT_EQ(chunk(norm1.at("modulation"), 6, 1, H), chunk(table, 6, 1, H));  // scale_msa
  const auto region = inputs_of(site(p, "attention residual"));
  EXPECT_EQ(chunk(region.at("modulation"), 6, 2, H), chunk(table, 6, 2, H));  // gate_msa
  EXPECT_EQ(chunk(region.at("modulation"), 6, 0, H), chunk(table, 6, 3, H));  // shift_mlp
  EXPECT_EQ(chunk(region.at("modulation"), 6, 1, H), chunk(table, 6, 4, H));  // scale_mlp
  EXPECT_EQ(values(region.at("residual")), values(norm1.at("x")));             // the block's input
  const auto ffn = inputs_of(site(p, "FFN residual"));
  EXPECT_EQ(chunk(ffn.at("modulation"), 6, 2, H), chunk(table, 6, 5, H));  // gate_mlp
  EXPECT_EQ(values(ffn.at("residual")), values(outputs_of(site(p, "attention residual"))["h"]));
  const HostTensor final_table = outputs_of(site(p, "final AdaLN projection"))["table"];
  const auto final_norm = inputs_of(site(p, "final norm"));
  EXPECT_EQ(chunk(final_norm.at("modulation"), 6, 0, H), chunk(final_table, 2, 1, H));  // shift: second
  EXPECT_EQ(chunk(final_norm.at("modulation"), 6, 1, H), chunk(final_table, 2, 0, H));  // scale: first
  EXPECT_EQ(values(final_norm.at("x")), values(outputs_of(site(p, "FFN residual"))["out"]));
  EXPECT_EQ(values(inputs_of(site(p, "proj_out")).at("x")), values(outputs_of(site(p, "final norm"))["out"]));
  // The embedding reads the sinusoid's features (rounded once to bf16) and the guidance's.
  const auto embedding = inputs_of(site(p, "time + guidance + text embedding"));
  std::vector<double> features = values(outputs_of(site(p, "timestep sinusoid"))["features"]);
  for (double& f : features) f = round_bf16(f);
  EXPECT_EQ(values(embedding.at("timestep_features")), features);
}

TEST(ModelCases, CogVideoXTakesTheFfnModulationFromNorm2AndShiftFirstInTheFinalLayer) {
  Path p;
  build("cogvideox", &p);
  const int64_t H = 16;
  const HostTensor norm1 = outputs_of(site(p, "AdaLN projection, 6 chunks (CogVideoXLayerNormZero norm1)"))["table"];
  const HostTensor norm2 = outputs_of(site(p, "AdaLN projection, 6 chunks (CogVideoXLayerNormZero norm2)"))["table"];
  const auto region = inputs_of(site(p, "attention residual"));
  EXPECT_EQ(chunk(region.at("modulation"), 6, 2, H), chunk(norm1, 6, 2, H));  // gate (norm1's)
  EXPECT_EQ(chunk(region.at("modulation"), 6, 0, H), chunk(norm2, 6, 0, H));  // shift (norm2's)
  EXPECT_EQ(chunk(region.at("modulation"), 6, 1, H), chunk(norm2, 6, 1, H));  // scale
  EXPECT_EQ(chunk(inputs_of(site(p, "FFN residual")).at("modulation"), 6, 2, H), chunk(norm2, 6, 2, H));
  TensorView w;
  DETDIT_ASSERT_OK(p.weights.view("transformer_blocks.0.norm2.norm.weight", &w));
  const HostTensor weight = region.at("weight");
  ASSERT_EQ(weight.nbytes(), w.nbytes());
  EXPECT_EQ(std::memcmp(weight.data(), w.data, w.nbytes()), 0);
  const HostTensor final_table = outputs_of(site(p, "final AdaLN projection"))["table"];
  const auto final_norm = inputs_of(site(p, "final norm"));
  EXPECT_EQ(chunk(final_norm.at("modulation"), 6, 0, H), chunk(final_table, 2, 0, H));  // shift first
  EXPECT_EQ(chunk(final_norm.at("modulation"), 6, 1, H), chunk(final_table, 2, 1, H));
  EXPECT_EQ(values(final_norm.at("x")), values(outputs_of(site(p, "norm_final"))["out"]));
}

TEST(ModelCases, WanAddsItsFp32TablesAndRoundsTheTimeEmbeddingOnce) {
  Path p;
  build("wan21", &p);
  const int64_t H = 16;
  const HostTensor temb = outputs_of(site(p, "time embedding"))["temb"];
  ASSERT_EQ(temb.dtype(), DType::kF32);
  std::vector<double> rounded = values(temb);
  for (double& v : rounded) v = round_bf16(v);
  EXPECT_EQ(values(inputs_of(site(p, "AdaLN projection")).at("temb")), rounded);
  const HostTensor block = outputs_of(site(p, "block table + projection"))["out"];
  ASSERT_EQ(block.dtype(), DType::kF32);
  const auto norm1 = inputs_of(site(p, "norm1"));
  EXPECT_EQ(norm1.at("modulation").dtype(), DType::kF32);
  EXPECT_EQ(chunk(norm1.at("modulation"), 6, 0, H), chunk(block, 6, 0, H));
  EXPECT_EQ(chunk(inputs_of(site(p, "FFN residual")).at("modulation"), 6, 2, H), chunk(block, 6, 5, H));
  const HostTensor final_table = outputs_of(site(p, "final table"))["out"];
  const auto final_norm = inputs_of(site(p, "final norm"));
  EXPECT_EQ(chunk(final_norm.at("modulation"), 6, 0, H), chunk(final_table, 2, 0, H));  // shift
  EXPECT_EQ(chunk(final_norm.at("modulation"), 6, 1, H), chunk(final_table, 2, 1, H));  // scale
}

TEST(ModelCases, AbsentOrMisshapedWeightsAreRefused) {
  Path p;
  build("ltx_video", &p);
  cases::CaseContext ctx;
  ctx.model = "ltx_video";
  ctx.hidden = 32;  // the file's H is 16: the first weight a site reads differs in size
  ctx.time_embed_dim = ctx.time_embed_hidden = ctx.freq_dim = 16;
  ctx.out_dim = 4;
  const io::Weights* w = &p.weights;
  ctx.weight = [w](const std::string& name, TensorView* view) { return w->view(name, view); };
  std::vector<ModelSite> sites;
  Status s = cases::model_sites(ctx, &sites);
  EXPECT_EQ(s.kind(), ErrorKind::kValue);
  EXPECT_NE(s.message().find("time_embed.linear.weight"), std::string::npos) << s.message();
  ctx.model = "sd3";
  EXPECT_EQ(cases::model_sites(ctx, &sites).kind(), ErrorKind::kValue);
}

}  // namespace
}  // namespace detdit
