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

// Dimension overrides shared by synth and verify: other AdaLN DiTs, and small
// configurations for tests. `blocks_default` is what --blocks is when not
// given: synth writes 1 block, verify expects the file's own count.
void declare_dimensions(Args* args, const std::string& blocks_default) {
  args->option("--blocks", "N", "transformer blocks", blocks_default);
  args->option("--hidden", "H", "hidden size H", "5376");
  args->option("--time-embed-hidden", "N", "time_embedder.linear_1 outputs", "5376");
  args->option("--time-dim", "D", "time-embed dim D", "2688");
  args->option("--freq-dim", "F", "sinusoid channels F", "256");
}

bool read_dimensions(Args* args, io::ManifestConfig* c, int64_t default_blocks) {
  const int64_t kMax = int64_t(1) << 24;
  return args->get_int("--blocks", default_blocks, 0, 100000, &c->blocks) &&
         args->get_int("--hidden", c->hidden, 1, kMax, &c->hidden) &&
         args->get_int("--time-embed-hidden", c->time_embed_hidden, 1, kMax, &c->time_embed_hidden) &&
         args->get_int("--time-dim", c->time_embed_dim, 1, kMax, &c->time_embed_dim) &&
         args->get_int("--freq-dim", c->freq_dim, 1, kMax, &c->freq_dim);
}

int run_synth(int argc, char** argv) {
  Args args("detdit weights synth --out DIR [--blocks N] [--seed N] [--only PATTERN]",
            "Writes DIR/h3_conditioning.safetensors with deterministic synthetic weights of the manifest's\n"
            "names, shapes and dtypes (docs/weights.md) and DIR/SHA256SUMS with one checksum per tensor.");
  args.option("--out", "DIR", "output directory (created if missing)");
  args.option("--seed", "N", "generator seed", "0");
  args.option("--only", "PATTERN", "write only the tensors whose name contains PATTERN");
  declare_dimensions(&args, "1");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  io::SynthOptions options;
  if (!read_dimensions(&args, &options.config, 1) || !args.get_uint64("--seed", 0, &options.seed)) {
    return fail(args.error());
  }
  if (!args.has("--out")) return fail("weights synth needs --out DIR");
  options.only = args.get("--only");
  const std::string dir = args.get("--out");
  io::remove_temporaries_on_signals();  // an interrupted synth leaves no partial file
  auto start = std::chrono::steady_clock::now();
  Status status = io::write_synthetic_weights(dir, options);
  if (!status.ok()) return fail(status.to_string());
  io::SafetensorsFile file;
  status = io::SafetensorsFile::open(io::weights_file_path(dir), &file);
  if (!status.ok()) return fail(status.to_string());
  std::printf("wrote %s: %zu tensors, %.3f GB in %.1f s (seed %llu, blocks %lld)\n", file.path().c_str(),
              file.entries().size(), file.file_size() / 1e9,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              static_cast<unsigned long long>(options.seed), static_cast<long long>(options.config.blocks));
  return 0;
}

int run_verify_weights(int argc, char** argv) {
  Args args("detdit weights verify DIR [--sha256 FILE] [--blocks N]",
            "Checks the names, dtypes and shapes of DIR/h3_conditioning.safetensors (or a file) against the\n"
            "manifest and, with --sha256, the checksums. Prints every difference. Exit 0: everything\n"
            "matches; 1: something differs; 2: usage error or unreadable/malformed file.\n"
            "The expected block count defaults to the number of blocks in the file (at least 1).");
  args.positional("DIR", "weights directory or safetensors file");
  args.option("--sha256", "FILE", "checksum lines '<hex>  <tensor name or file name>'");
  declare_dimensions(&args, "the number of blocks in the file, at least 1");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  io::SafetensorsFile file;
  Status status = io::SafetensorsFile::open(io::weights_file_path(args.get("DIR")), &file);
  if (!status.ok()) return fail(status.to_string());
  int64_t blocks_in_file = 0;
  while (file.find("transformer_blocks." + std::to_string(blocks_in_file) + ".adaln_proj.linear.weight")) {
    ++blocks_in_file;
  }
  io::ManifestConfig config;
  if (!read_dimensions(&args, &config, std::max<int64_t>(1, blocks_in_file))) return fail(args.error());
  std::vector<std::string> differences, extras;
  io::compare_to_manifest(file, config, &differences, &extras);
  int checked = 0;
  if (args.has("--sha256")) {
    status = io::check_sha256_list(args.get("--sha256"), file, &differences, &checked);
    if (!status.ok()) return fail(status.to_string());
  }
  const size_t expected = io::manifest_entries(config).size();
  std::printf("%s: manifest %s, blocks %lld, H %lld, Ht %lld, D %lld, F %lld: %zu tensors expected, %zu in file\n",
              file.path().c_str(), io::kManifestVersion, static_cast<long long>(config.blocks),
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
  Args args("detdit weights inspect FILE",
            "Lists a safetensors file's metadata and tensors: name, dtype, shape and byte range\n"
            "(relative to the data section, which starts at byte 8 + header length).");
  args.positional("FILE", "safetensors file (or a weights directory)");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  io::SafetensorsFile file;
  Status status = io::SafetensorsFile::open(io::weights_file_path(args.get("FILE")), &file);
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
  Args args("detdit weights manifest",
            "Prints the manifest table (h3-conditioning-v1): name, dtype, symbolic shape, role.\n"
            "H = hidden, Ht = time_embed_hidden, D = time_embed_dim, F = freq_dim; {i} = block index.");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  for (const io::ManifestTemplate& t : io::manifest_templates()) {
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
