// detdit weights synth | verify | inspect.
#include <chrono>
#include <cstdio>

#include "args.h"
#include "cli.h"
#include "io/files.h"
#include "io/manifest.h"
#include "io/safetensors.h"
#include "io/sha256.h"
#include "io/synth.h"
#include "io/weights.h"

namespace detdit {
namespace cli {
namespace {

const char* const kWeightsUsage =
    "usage: detdit weights <synth|verify|inspect|manifest> [options]\n"
    "\n"
    "  synth     write deterministic synthetic weights of the manifest's shapes\n"
    "  verify    check a weights directory against the manifest (and checksums)\n"
    "  inspect   list a safetensors file's tensors, dtypes, shapes and byte ranges\n"
    "  manifest  print the manifest table\n"
    "\n"
    "detdit weights <command> --help describes each command.\n";

// The model and dimension overrides shared by synth and verify: small
// configurations for tests. `blocks_default` is what --blocks is when not
// given: synth writes 1 block, verify expects the file's own count.
void declare_dimensions(Args* args, const std::string& blocks_default) {
  args->option("--model", "NAME", "the model's manifest: h3, or a DiT family of docs/models.md", "h3");
  args->option("--blocks", "N", "transformer blocks", blocks_default);
  args->option("--hidden", "H", "hidden size H", "the model's (H3: 5376)");
  args->option("--time-embed-hidden", "N", "time embedder linear_1 outputs Ht", "the model's (H3: 5376)");
  args->option("--time-dim", "D", "time-embed dim D", "the model's (H3: 2688)");
  args->option("--freq-dim", "F", "sinusoid channels F", "the model's (256)");
  args->option("--pooled-dim", "P", "pooled text width P (families with a text embedder)", "the model's");
  args->option("--out-dim", "O", "proj_out outputs O (the families)", "the model's");
}

// The model's released dimensions, then the overrides.
Status read_dimensions(Args* args, io::ManifestConfig* c, int64_t default_blocks) {
  const io::ModelManifest* model = nullptr;
  DETDIT_RETURN_IF_ERROR(io::find_model_manifest(args->get("--model", "h3"), &model));
  *c = model->dims;
  const int64_t kMax = int64_t(1) << 24;
  const bool h3 = c->model == "h3";
  const bool ok = args->get_int("--blocks", default_blocks, 0, 100000, &c->blocks) &&
                  args->get_int("--hidden", c->hidden, 1, kMax, &c->hidden) &&
                  args->get_int("--time-embed-hidden", c->time_embed_hidden, 1, kMax, &c->time_embed_hidden) &&
                  args->get_int("--time-dim", c->time_embed_dim, 1, kMax, &c->time_embed_dim) &&
                  args->get_int("--freq-dim", c->freq_dim, 1, kMax, &c->freq_dim) &&
                  args->get_int("--pooled-dim", c->pooled_dim, h3 ? 0 : 1, kMax, &c->pooled_dim) &&
                  args->get_int("--out-dim", c->out_dim, h3 ? 0 : 1, kMax, &c->out_dim);
  if (!ok) return Status::value_error(args->error());
  if (h3 && (args->has("--pooled-dim") || args->has("--out-dim")))
    return Status::value_error("--pooled-dim and --out-dim apply to the families' manifests, not h3's");
  return Status::ok_status();
}

int run_synth(int argc, char** argv) {
  Args args("detdit weights synth --out DIR [--model NAME] [--blocks N] [--seed N] [--only PATTERN]",
            "Writes DIR/h3_conditioning.safetensors (--model NAME: DIR/NAME_conditioning.safetensors) with\n"
            "deterministic synthetic weights of the model's manifest: names, shapes and dtypes\n"
            "(docs/weights.md), and DIR/SHA256SUMS with one checksum per tensor.");
  args.option("--out", "DIR", "output directory (created if missing)");
  args.option("--seed", "N", "generator seed", "0");
  args.option("--only", "PATTERN", "write only the tensors whose name contains PATTERN");
  declare_dimensions(&args, "1");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  io::SynthOptions options;
  Status dims = read_dimensions(&args, &options.config, 1);
  if (!dims.ok()) return fail(dims.message());
  if (!args.get_uint64("--seed", 0, &options.seed)) return fail(args.error());
  if (!args.has("--out")) return fail("weights synth needs --out DIR");
  options.only = args.get("--only");
  const std::string dir = args.get("--out");
  io::remove_temporaries_on_signals();  // an interrupted synth leaves no partial file
  auto start = std::chrono::steady_clock::now();
  Status status = io::write_synthetic_weights(dir, options);
  if (!status.ok()) return fail(status.to_string());
  io::SafetensorsFile file;
  status = io::SafetensorsFile::open(io::weights_file_path(dir, options.config.model), &file);
  if (!status.ok()) return fail(status.to_string());
  std::printf("wrote %s: %zu tensors, %.3f GB in %.1f s (%s, seed %llu, blocks %lld)\n", file.path().c_str(),
              file.entries().size(), file.file_size() / 1e9,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              options.config.model.c_str(), static_cast<unsigned long long>(options.seed),
              static_cast<long long>(options.config.blocks));
  return 0;
}

int run_verify_weights(int argc, char** argv) {
  Args args("detdit weights verify DIR [--model NAME] [--sha256 FILE] [--blocks N]",
            "Checks the names, dtypes and shapes of DIR/h3_conditioning.safetensors (--model NAME:\n"
            "DIR/NAME_conditioning.safetensors; or a file) against the model's manifest and, with --sha256, the checksums. Prints every difference. Exit 0: everything\n"
            "matches; 1: something differs; 2: usage error or unreadable/malformed file.\n"
            "The expected block count defaults to the number of blocks in the file (at least 1).");
  args.positional("DIR", "weights directory or safetensors file");
  args.option("--sha256", "FILE", "checksum lines '<hex>  <tensor name or file name>'");
  declare_dimensions(&args, "the number of blocks in the file, at least 1");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  const io::ModelManifest* model = nullptr;
  Status status = io::find_model_manifest(args.get("--model", "h3"), &model);
  if (!status.ok()) return fail(status.message());
  io::SafetensorsFile file;
  status = io::SafetensorsFile::open(io::weights_file_path(args.get("DIR"), model->name), &file);
  if (!status.ok()) return fail(status.to_string());
  // The block count of the table's first block row.
  int64_t blocks_in_file = 0;
  for (const io::ManifestTemplate& t : *model->templates) {
    std::string pattern = t.name;
    const std::size_t at = pattern.find("{i}");
    if (at == std::string::npos) continue;
    while (file.find(std::string(pattern).replace(at, 3, std::to_string(blocks_in_file)))) ++blocks_in_file;
    break;
  }
  io::ManifestConfig config;
  status = read_dimensions(&args, &config, std::max<int64_t>(1, blocks_in_file));
  if (!status.ok()) return fail(status.message());
  std::vector<std::string> differences, extras;
  io::compare_to_manifest(file, config, &differences, &extras);
  int checked = 0;
  if (args.has("--sha256")) {
    status = io::check_sha256_list(args.get("--sha256"), file, &differences, &checked);
    if (!status.ok()) return fail(status.to_string());
  }
  const size_t expected = io::manifest_entries(config).size();
  std::printf("%s: manifest %s, blocks %lld, H %lld, Ht %lld, D %lld, F %lld: %zu tensors expected, %zu in file\n",
              file.path().c_str(), model->version, static_cast<long long>(config.blocks),
              static_cast<long long>(config.hidden), static_cast<long long>(config.time_embed_hidden),
              static_cast<long long>(config.time_embed_dim), static_cast<long long>(config.freq_dim), expected,
              file.entries().size());
  for (const std::string& e : extras) std::printf("  extra (not in the manifest, ignored): %s\n", e.c_str());
  for (const std::string& d : differences) std::printf("  DIFFERS %s\n", d.c_str());
  if (args.has("--sha256")) std::printf("  %d checksums checked\n", checked);
  if (!differences.empty()) {
    std::printf("weights verify: FAIL, %zu differences\n", differences.size());
    return 1;
  }
  std::printf("weights verify: OK\n");
  return 0;
}

int run_inspect(int argc, char** argv) {
  Args args("detdit weights inspect FILE [--model NAME]",
            "Lists a safetensors file's metadata and tensors: name, dtype, shape and byte range\n"
            "(relative to the data section, which starts at byte 8 + header length).");
  args.positional("FILE", "safetensors file (or a weights directory: the model's file in it)");
  args.option("--model", "NAME", "whose file a directory holds: h3, or a DiT family of docs/models.md", "h3");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  const io::ModelManifest* model = nullptr;
  Status status = io::find_model_manifest(args.get("--model", "h3"), &model);
  if (!status.ok()) return fail(status.message());
  io::SafetensorsFile file;
  status = io::SafetensorsFile::open(io::weights_file_path(args.get("FILE"), model->name), &file);
  if (!status.ok()) return fail(status.to_string());
  std::printf("%s: %llu bytes, header %llu bytes, data section at byte %llu, %zu tensors\n", file.path().c_str(),
              static_cast<unsigned long long>(file.file_size()), static_cast<unsigned long long>(file.header_bytes()),
              static_cast<unsigned long long>(file.data_start()), file.entries().size());
  for (const auto& kv : file.metadata()) std::printf("  metadata %s = %s\n", kv.first.c_str(), kv.second.c_str());
  std::printf("  %-50s %-8s %-16s %s\n", "tensor", "dtype", "shape", "bytes [begin, end)");
  for (const io::TensorEntry& e : file.entries()) {
    std::printf("  %-50s %-8s %-16s [%llu, %llu)\n", e.name.c_str(), io::safetensors_dtype_string(e.dtype),
                io::shape_to_string(e.shape).c_str(), static_cast<unsigned long long>(e.begin),
                static_cast<unsigned long long>(e.end));
  }
  return 0;
}

int run_manifest(int argc, char** argv) {
  Args args("detdit weights manifest [--model NAME]",
            "Prints a model's manifest table (default h3-conditioning-v1): name, dtype, symbolic shape, role.\n"
            "H = hidden, Ht = time_embed_hidden, D = time_embed_dim, F = freq_dim, P = pooled_dim,\n"
            "O = out_dim; {i} = block index.");
  args.option("--model", "NAME", "the model: h3, or a DiT family of docs/models.md", "h3");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  const io::ModelManifest* model = nullptr;
  const Status status = io::find_model_manifest(args.get("--model", "h3"), &model);
  if (!status.ok()) return fail(status.message());
  for (const io::ManifestTemplate& t : *model->templates) {
    std::printf("%-50s %-9s %-9s %s\n", t.name, dtype_name(t.dtype), io::symbolic_shape_string(t).c_str(),
                t.purpose);
  }
  return 0;
}

}  // namespace

int run_weights(int argc, char** argv) {
  return run_command(argc, argv, kWeightsUsage, "weights ",
                     {{"synth", run_synth}, {"verify", run_verify_weights}, {"inspect", run_inspect},
                      {"manifest", run_manifest}});
}

}  // namespace cli
}  // namespace detdit
