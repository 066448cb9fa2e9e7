// The detdit binary end to end: --help of every command, exit codes 0/1/2,
// weights synth/verify/inspect on a small configuration, a verify --quick run
// whose JSON report is parsed and checked, and report drawing its SVG.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "io/manifest.h"
#include "support/cases.h"
#include "support/files.h"
#include "support/test_util.h"
#include "detdit/parallel.h"
#include "io/manifest.h"
#include "io/safetensors.h"
#include "io/sha256.h"

namespace detdit {
namespace {

struct Result {
  int code = -1;
  std::string output;       // stdout, then stderr
  std::string stdout_text;  // stdout alone (the JSON of --format json)
};

std::string temp_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/detdit_cli_" + std::to_string(::getpid()) + "_" + name;
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

using testing::read_file;

// Runs `detdit <arguments>` with the cache pointed at a private directory. A
// run past `timeout_s` is killed (exit code 124, or 137 after SIGKILL), so a
// hang fails its test instead of hanging the suite.
Result detdit(const std::string& arguments, int timeout_s = 600) {
  static const std::string cache = temp_dir("cache");
  const std::string out = temp_dir("out") + "/stdout.txt", err = temp_dir("out") + "/stderr.txt";
  const std::string command = "XDG_CACHE_HOME='" + cache + "' timeout -k 5 " + std::to_string(timeout_s) + " '" +
                              DETDIT_CLI_PATH + "' " + arguments + " > '" + out + "' 2> '" + err + "'";
  const int status = std::system(command.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.stdout_text = read_file(out);
  r.output = r.stdout_text + read_file(err);
  return r;
}

// Each command is a usage error (exit 2) whose output says "detdit: <message>".
void expect_usage_errors(const std::vector<std::pair<std::string, std::string>>& commands_and_messages) {
  for (const auto& [command, message] : commands_and_messages) {
    const Result r = detdit(command);
    EXPECT_EQ(r.code, 2) << command << "\n" << r.output;
    EXPECT_NE(r.output.find("detdit: " + message), std::string::npos) << command << "\n" << r.output;
  }
}

// Small dimensions so the whole file is ~0.2 MB.
const char* const kSmallDims = " --hidden 64 --time-embed-hidden 64 --time-dim 32 --freq-dim 16";

std::string small_weights() {
  static std::string dir;
  if (dir.empty()) {
    dir = temp_dir("weights");
    Result r = detdit("weights synth --out '" + dir + "'" + kSmallDims);
    EXPECT_EQ(r.code, 0) << r.output;
  }
  return dir;
}

// The names in `dir` (none when it cannot be read).
std::vector<std::string> directory_entries(const std::string& dir) {
  std::vector<std::string> names;
  testing::list_directory(dir, &names);
  return names;
}

// verify --model runs every family's conditioning path on its synthetic
// weights at small dimensions (every site's checks pass; the report names
// the model), and the JSON report records the model and its dimensions.
TEST(Cli, EveryFamilysPathVerifiesOnItsSyntheticWeights) {
  const char* const kFamilyDims =
      " --hidden 64 --time-embed-hidden 64 --time-dim 64 --freq-dim 64 --pooled-dim 32 --out-dim 16";
  for (const io::ModelManifest& m : io::model_manifests()) {
    if (std::string(m.name) == "h3") continue;
    const std::string dir = temp_dir(std::string("model_") + m.name), name = m.name;
    Result r = detdit("weights synth --model " + name + " --out '" + dir + "'" + kFamilyDims);
    ASSERT_EQ(r.code, 0) << r.output;
    r = detdit("verify --quick --device cpu --model " + name + " --weights '" + dir + "' --out '" + dir +
               "/report.json'");
    EXPECT_EQ(r.code, 0) << name << "\n" << r.output;
    EXPECT_NE(r.output.find("detdit verify: PASS"), std::string::npos) << name << "\n" << r.output;
    EXPECT_NE(r.output.find("layernorm / final norm: modulated LayerNorm"), std::string::npos) << r.output;
    const nlohmann::json report = nlohmann::json::parse(read_file(dir + "/report.json"));
    EXPECT_EQ(report["options"]["model"], name);
    EXPECT_EQ(report["weights"]["out_dim"], 16);
    // The weights of another family are refused, naming the tensor that is missing.
    r = detdit("verify --quick --device cpu --model " + std::string(name == "ltx_video" ? "flux" : "ltx_video") +
               " --weights '" + dir + "/" + m.file_name() + "'");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("has no tensor"), std::string::npos) << r.output;
  }
  expect_usage_errors({{"verify --model flux2", "--model: unknown model \"flux2\": expected one of h3, sd35"},
                       {"verify --model flux --matrix", "--matrix applies to MiniMax-H3's verify (no --model)"},
                       {"verify --model flux --full", "--full applies to MiniMax-H3's verify (no --model)"},
                       {"weights synth --out x --model h3 --out-dim 3",
                        "--pooled-dim and --out-dim apply to the families' manifests, not h3's"},
                       {"weights manifest --model sd3", "unknown model \"sd3\""}});
}

TEST(Cli, HelpForEveryCommand) {
  for (const char* command : {"--help", "verify --help", "bench --help", "report --help", "weights --help",
                              "weights synth --help", "weights verify --help", "weights inspect --help",
                              "weights manifest --help"}) {
    Result r = detdit(command);
    EXPECT_EQ(r.code, 0) << command << "\n" << r.output;
    EXPECT_NE(r.output.find("usage: detdit"), std::string::npos) << command << "\n" << r.output;
  }
}

// VERSION is the one source of the version (CMakeLists.txt reads it).
TEST(Cli, VersionIsTheVersionFile) {
  std::string version = read_file(std::string(DETDIT_SOURCE_DIR) + "/VERSION");
  version = version.substr(0, version.find('\n'));
  ASSERT_FALSE(version.empty());
  Result r = detdit("--version");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output, "detdit " + version + "\n");
}

TEST(Cli, UsageErrorsExit2) {
  for (const char* command :
       {"", "frobnicate", "verify --bogus", "verify --device tpu", "verify --ops no_such_op", "verify --seed -3",
        "weights", "weights frob", "weights synth", "weights synth --out /tmp/x --blocks -1", "weights inspect",
        "weights verify", "report", "bench --format xml", "bench --out ''", "bench --out=", "verify --quick --quick",
        "verify --quick --full",
        // an empty value is not the default; numbers are decimal digits only
        "verify --weights ''", "verify --weights=", "bench --weights ''", "verify --out=", "verify --seed ' -1'",
        "verify --seed ' 5'", "verify --seed +5", "bench --repeats ' 3'", "weights synth --out /tmp/x --blocks +1",
        // the matrix's options only with --matrix, and lists of positive integers
        "verify --seq 4097", "verify --worlds 1,2", "verify --matrix-budget 5", "verify --matrix --worlds 0",
        "verify --matrix --seq 4097,x", "verify --matrix --seq ,", "verify --matrix --matrix-budget -1",
        "verify --matrix --comm mpi"}) {
    Result r = detdit(command);
    EXPECT_EQ(r.code, 2) << "'" << command << "'\n" << r.output;
    EXPECT_NE(r.output.find("detdit"), std::string::npos) << command;
  }
}

TEST(Cli, VerifyOnCudaWithoutAGpuIsAnInputError) {
  std::string why;
  if (testing::cuda_available(&why)) GTEST_SKIP() << "a GPU is present; this checks the no-GPU path";
  Result r = detdit("verify --quick --device cuda --weights '" + small_weights() + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--device cuda"), std::string::npos) << r.output;
}

TEST(Cli, WeightsSynthVerifyInspect) {
  const std::string dir = small_weights();
  Result r = detdit("weights verify '" + dir + "'" + kSmallDims);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("weights verify: OK"), std::string::npos) << r.output;
  r = detdit("weights verify '" + dir + "'" + kSmallDims + " --sha256 '" + dir + "/SHA256SUMS'");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("12 checksums checked"), std::string::npos) << r.output;

  // Against the H3 shapes every tensor differs: exit 1 with a readable list.
  r = detdit("weights verify '" + dir + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("DIFFERS shape: norm_out.norm.weight is [64], expected [5376]"), std::string::npos)
      << r.output;

  // The whole-file digest of coreutils' sha256sum, an independent implementation, is accepted.
  const std::string sums = temp_dir("sums") + "/SUMS";
  ASSERT_EQ(std::system(("cd '" + dir + "' && sha256sum h3_conditioning.safetensors > '" + sums + "'").c_str()), 0);
  r = detdit("weights verify '" + dir + "'" + kSmallDims + " --sha256 '" + sums + "'");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("1 checksums checked"), std::string::npos) << r.output;

  // A wrong checksum (a whole-file digest line) is a difference.
  std::ofstream(sums) << "0123456789abcdef  h3_conditioning.safetensors\n";
  r = detdit("weights verify '" + dir + "'" + kSmallDims + " --sha256 '" + sums + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("sha256: h3_conditioning.safetensors is "), std::string::npos) << r.output;
  std::ofstream(sums) << "not a checksum line\n";
  r = detdit("weights verify '" + dir + "'" + kSmallDims + " --sha256 '" + sums + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(sums + ":1:"), std::string::npos) << r.output;

  // A partial file (--only) misses tensors: exit 1 naming them.
  const std::string partial = temp_dir("partial");
  r = detdit("weights synth --out '" + partial + "' --only norm_out" + kSmallDims);
  ASSERT_EQ(r.code, 0) << r.output;
  r = detdit("weights verify '" + partial + "'" + kSmallDims);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("missing: time_embedder.linear_1.weight (float32 [64, 16])"), std::string::npos)
      << r.output;

  r = detdit("weights inspect '" + dir + "/h3_conditioning.safetensors'");
  EXPECT_EQ(r.code, 0) << r.output;
  for (const io::ManifestEntry& e : io::manifest_entries(io::ManifestConfig{})) {
    EXPECT_NE(r.output.find(e.name), std::string::npos) << e.name;
  }
  EXPECT_NE(r.output.find("metadata detdit.kind = synthetic"), std::string::npos) << r.output;

  // A malformed file: exit 2, the message names the file and the problem.
  const std::string bad = temp_dir("bad") + "/bad.safetensors";
  std::ofstream(bad) << "\x05\0\0\0\0\0\0\0{\"a\":";
  for (const char* command : {"weights inspect", "weights verify"}) {
    r = detdit(std::string(command) + " '" + bad + "'");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(bad + ": "), std::string::npos) << r.output;
  }
  r = detdit("weights manifest");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("transformer_blocks.{i}.adaln_proj.linear.weight"), std::string::npos) << r.output;
}

// --sha256 lists: what is not a regular file is refused, a list without a
// checksum line is an input error (it used to report "0 checksums checked ...
// OK"), and uppercase digests are read as sha256sum reads them.
TEST(Cli, Sha256ListsCheckSomethingOrAreRefused) {
  const std::string dir = small_weights();
  const std::string verify = "weights verify '" + dir + "'" + kSmallDims + " --sha256 ";
  const std::string empty = temp_dir("sums_empty") + "/SUMS", comments = temp_dir("sums_comments") + "/SUMS";
  std::ofstream(empty).close();
  std::ofstream(comments) << "# nothing listed\n\n";
  for (const std::string& sums : {::testing::TempDir(), std::string("/dev/zero"), empty, comments}) {
    Result r = detdit(verify + "'" + sums + "'");
    EXPECT_EQ(r.code, 2) << sums << "\n" << r.output;
    EXPECT_EQ(r.output.find("OK"), std::string::npos) << sums << "\n" << r.output;
  }
  // The digests (each line's first field) in uppercase, the names unchanged.
  std::string upper = read_file(dir + "/SHA256SUMS");
  bool in_digest = true;
  for (char& c : upper) {
    if (c == ' ') in_digest = false;
    if (c == '\n') in_digest = true;
    if (in_digest && c >= 'a' && c <= 'f') c = static_cast<char>(c - 'a' + 'A');
  }
  const std::string upper_sums = temp_dir("sums_upper") + "/SUMS";
  std::ofstream(upper_sums) << upper;
  Result r = detdit(verify + "'" + upper_sums + "'");
  EXPECT_EQ(r.code, 0) << upper << "\n" << r.output;
  EXPECT_NE(r.output.find("12 checksums checked"), std::string::npos) << r.output;
}

// Every file detdit reads must be a regular file: a FIFO is refused at once
// (opening one for reading waits for a writer), as a weights file, inside a
// weights directory, as a checksum list and as a report.
TEST(Cli, FifosAreRefusedNotWaitedFor) {
  const std::string dir = temp_dir("fifo");
  const std::string fifo = dir + "/" + io::kWeightsFileName;
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  for (const std::string& command :
       {"weights inspect '" + fifo + "'", "weights verify '" + dir + "'",
        "verify --quick --device cpu --weights '" + dir + "'",
        "weights verify '" + small_weights() + "'" + kSmallDims + " --sha256 '" + fifo + "'",
        "report '" + fifo + "' --out '" + dir + "/figure.svg'"}) {
    Result r = detdit(command, /*timeout_s=*/30);
    EXPECT_EQ(r.code, 2) << command << "\n" << r.output;
    EXPECT_NE(r.output.find(fifo + ": not a regular file (a FIFO)"), std::string::npos) << command << "\n" << r.output;
  }
}

// A weights file of the manifest's names and shapes for `config`, all zeros.
void write_zero_weights(const io::ManifestConfig& config, const std::string& path) {
  std::vector<io::TensorToWrite> tensors;
  for (const io::ManifestEntry& e : io::manifest_entries(config)) {
    tensors.push_back({e.name, e.dtype, e.shape, [](uint8_t* out, uint64_t bytes) {
                         std::memset(out, 0, bytes);
                         return Status::ok_status();
                       }});
  }
  DETDIT_EXPECT_OK(io::write_safetensors(path, tensors, {}));
}

// Weights whose dimensions the ops refuse are bad input (exit 2) naming the
// dimension; they used to run and fail checks (exit 1).
TEST(Cli, WeightsTheOpsCannotRunOnAreInputErrors) {
  struct Bad {
    const char* what;
    int64_t hidden, time_embed_hidden, time_embed_dim, freq_dim;
    const char* message;
  };
  for (const Bad& bad : {Bad{"H = 5", 5, 64, 32, 16, "H (norm_out.norm.weight) = 5 must be a multiple of 4"},
                         Bad{"H = 0", 0, 64, 32, 16, "the model's dimensions must be positive"},
                         Bad{"D = 6", 64, 64, 6, 16, "D (time_embedder.linear_2 outputs) = 6 must be a multiple of 8"},
                         Bad{"Ht = 6", 64, 6, 32, 16, "time_embed_hidden (time_embedder.linear_1 outputs) = 6"},
                         Bad{"F = 6", 64, 64, 32, 6, "F (time_embedder.linear_1 inputs) = 6 must be a multiple of 4"}}) {
    io::ManifestConfig config;
    config.hidden = bad.hidden;
    config.time_embed_hidden = bad.time_embed_hidden;
    config.time_embed_dim = bad.time_embed_dim;
    config.freq_dim = bad.freq_dim;
    const std::string path = temp_dir("bad_dims") + "/" + io::kWeightsFileName;
    write_zero_weights(config, path);
    for (const char* command : {"verify --quick --device cpu", "bench --quick --device cpu --ops timestep_mlp"}) {
      Result r = detdit(std::string(command) + " --weights '" + path + "'");
      EXPECT_EQ(r.code, 2) << bad.what << ": " << command << "\n" << r.output;
      EXPECT_NE(r.output.find(bad.message), std::string::npos) << bad.what << ": " << command << "\n" << r.output;
    }
  }
}

// verify's report and figure go through a temporary renamed into place, and
// a destination that is not a regular file is refused before the run: a FIFO
// as --out used to block the finished run forever (ofstream waits for a
// reader). A report that was there is replaced whole; no temporary is left.
TEST(Cli, VerifyWritesItsReportAtomically) {
  const std::string dir = temp_dir("verify_out");
  const std::string fifo = dir + "/report.json";
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string verify = "verify --quick --device cpu --ops timestep_sinusoid --weights '" + small_weights() + "'";
  for (const char* option : {" --out '", " --figure '"}) {
    Result r = detdit(verify + option + fifo + "'", /*timeout_s=*/30);
    EXPECT_EQ(r.code, 2) << option << "\n" << r.output;
    EXPECT_NE(r.output.find(fifo + ": exists and is not a regular file (a FIFO)"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("timestep_sinusoid"), std::string::npos) << "the run went ahead:\n" << r.output;
  }
  ASSERT_EQ(std::remove(fifo.c_str()), 0);
  std::ofstream(fifo) << "an older report";
  Result r = detdit(verify + " --out '" + fifo + "'");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(read_file(fifo))["kind"], "detdit_verify_report");
  EXPECT_EQ(directory_entries(dir), std::vector<std::string>{"report.json"});
  // bench's report likewise: a destination it cannot replace is refused before any case runs.
  r = detdit("bench --quick --device cpu --ops timestep_mlp --repeats 1 --warmup 0 --weights '" + small_weights() +
             "' --out '" + dir + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(dir + ": exists and is not a regular file (a directory)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("timestep_mlp"), std::string::npos) << "the run went ahead:\n" << r.output;
}

// Input that used to throw out of the CLI (exit 134, SIGABRT) is an input
// error (exit 2) with a message; nothing is left behind.
TEST(Cli, BadInputIsAnErrorNotAnAbort) {
  // A directory as the report: std::ios_failure reading it.
  Result r = detdit("report '" + ::testing::TempDir() + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("not a regular file (a directory)"), std::string::npos) << r.output;

  // H = 2^24: the AdaLN weight is 18H x D bf16 = 1.6 TB, which no buffer holds
  // (std::bad_alloc after 63 MB of the file were written).
  const std::string huge = temp_dir("huge");
  r = detdit("weights synth --out '" + huge + "' --hidden 16777216");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("cannot allocate"), std::string::npos) << r.output;
  EXPECT_TRUE(directory_entries(huge).empty()) << "left behind: " << ::testing::PrintToString(directory_entries(huge));

  // A zero dimension leaves another unbounded by the file: a
  // time_embedder.linear_1.weight of [0, 2^40] is 0 bytes, yet F = 2^40
  // sized the verify buffers (std::bad_alloc).
  io::ManifestConfig config;
  config.hidden = 64;
  config.time_embed_hidden = 0;
  config.time_embed_dim = 32;
  config.freq_dim = int64_t{1} << 40;
  const std::string zero = temp_dir("zero_dim") + "/" + io::kWeightsFileName;
  write_zero_weights(config, zero);
  r = detdit("verify --quick --device cpu --weights '" + zero + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("time_embedder.linear_1.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("must be positive"), std::string::npos) << r.output;
}

// synth commits the weights and SHA256SUMS together: when SHA256SUMS cannot be
// replaced (here a directory), the weights file is not replaced either and no
// temporary is left.
TEST(Cli, SynthReplacesNothingWhenItFails) {
  const std::string dir = temp_dir("synth_fails");
  Result r = detdit("weights synth --out '" + dir + "'" + kSmallDims);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string weights = dir + "/" + io::kWeightsFileName, sums = dir + "/SHA256SUMS";
  const std::string before = read_file(weights);
  ASSERT_EQ(std::remove(sums.c_str()), 0);
  ASSERT_EQ(::mkdir(sums.c_str(), 0755), 0);
  r = detdit("weights synth --out '" + dir + "' --seed 1" + kSmallDims);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(sums + ": exists and is not a regular file (a directory)"), std::string::npos) << r.output;
  EXPECT_TRUE(read_file(weights) == before) << "the weights were replaced by a synth that failed";
  const std::vector<std::string> names = directory_entries(dir);
  EXPECT_EQ(names.size(), 2u) << "left behind: " << ::testing::PrintToString(names);
}

// A pid that no longer runs: a child that has exited and been reaped.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// Temporaries of dead writers (SIGKILL, power loss) are removed by the next
// synth into the directory; a live process's temporary and other files stay.
TEST(Cli, SynthRemovesStaleTemporaries) {
  const std::string dir = temp_dir("stale");
  const std::string dead = std::to_string(dead_pid()), alive = std::to_string(::getpid());
  const std::vector<std::string> stale = {std::string(io::kWeightsFileName) + ".tmp." + dead, "SHA256SUMS.tmp." + dead};
  const std::vector<std::string> kept = {std::string(io::kWeightsFileName) + ".tmp." + alive,
                                         std::string(io::kWeightsFileName) + ".tmp.notes", "other.tmp." + dead};
  for (const std::string& name : stale) std::ofstream(dir + "/" + name) << "partial";
  for (const std::string& name : kept) std::ofstream(dir + "/" + name) << "keep";
  Result r = detdit("weights synth --out '" + dir + "'" + kSmallDims);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const std::string& name : stale) EXPECT_NE(::access((dir + "/" + name).c_str(), F_OK), 0) << name;
  for (const std::string& name : kept) EXPECT_EQ(::access((dir + "/" + name).c_str(), F_OK), 0) << name;
}

// SIGINT or SIGTERM during a synth removes its temporary (an interrupted
// H3 synth used to leave up to 0.64 GB per run in the cache) and the process
// still dies of the signal.
TEST(Cli, InterruptedSynthLeavesNoTemporary) {
  for (int sig : {SIGINT, SIGTERM}) {
    const std::string dir = temp_dir("interrupted_" + std::to_string(sig));
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // Default dispositions, whatever the test runner set (ignored signals
      // stay ignored across exec, and detdit honours that).
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      std::freopen("/dev/null", "w", stdout);
      std::freopen("/dev/null", "w", stderr);
      ::execl(DETDIT_CLI_PATH, "detdit", "weights", "synth", "--out", dir.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    const std::string tmp = dir + "/" + io::kWeightsFileName + ".tmp." + std::to_string(pid);
    bool appeared = false;
    for (int waited_ms = 0; waited_ms < 30000 && !appeared; waited_ms += 5) {
      appeared = ::access(tmp.c_str(), F_OK) == 0;
      if (!appeared) ::usleep(5000);
    }
    ::kill(pid, sig);
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(appeared) << "the H3 synth never created " << tmp;
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    EXPECT_NE(::access(tmp.c_str(), F_OK), 0) << tmp << " was left behind after signal " << sig;
  }
}

// Without --weights, verify's synthetic default holds the H3 tensors at
// H = 1536 (D = 768), generated into its own cache entry; --full is H3's
// dimensions (the entry without a dimensions tag, as bench uses).
TEST(Cli, VerifyDefaultWeightsAreTheH3TensorsAtH1536) {
  const std::string out = temp_dir("verify_default");
  Result r = detdit("verify --device cpu --ops timestep_sinusoid --out '" + out + "/report.json'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("synth-v1-h3-conditioning-v1-H1536-Ht1536-D768-F256-b1-s0"), std::string::npos)
      << r.output;
  nlohmann::json report = nlohmann::json::parse(read_file(out + "/report.json"));
  EXPECT_EQ(report["options"]["full"], false);
  EXPECT_EQ(report["weights"]["synthetic"], true);
  EXPECT_EQ(report["weights"]["hidden"], 1536);
  EXPECT_EQ(report["weights"]["time_embed_hidden"], 1536);
  EXPECT_EQ(report["weights"]["time_embed_dim"], 768);
  EXPECT_EQ(report["weights"]["freq_dim"], 256);
  r = detdit("verify --full --device cpu --ops timestep_sinusoid --weights '" + small_weights() + "' --out '" + out +
             "/full.json'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(read_file(out + "/full.json"))["options"]["full"], true);
}

TEST(Cli, VerifyQuickReportAndFigure) {
  const std::string out = temp_dir("verify");
  Result r = detdit("verify --quick --device cpu --weights '" + small_weights() + "' --out '" + out +
                    "/report.json'");
  EXPECT_EQ(r.code, 0) << r.output;
  nlohmann::json report = nlohmann::json::parse(read_file(out + "/report.json"));
  EXPECT_EQ(report["kind"], "detdit_verify_report");
  EXPECT_EQ(report["verdict"], "PASS");
  EXPECT_EQ(report["options"]["quick"], true);
  EXPECT_EQ(report["options"]["full"], false);
  EXPECT_EQ(report["options"]["device"], "cpu");
  EXPECT_EQ(report["weights"]["hidden"], 64);
  const std::string commit = report["git"]["commit"];
  EXPECT_TRUE(commit == "unknown" || commit.size() == 40) << commit;
  EXPECT_TRUE(report["git"]["dirty"].is_boolean());
  EXPECT_FALSE(report["environment"]["compiler"].get<std::string>().empty());
  int64_t checks = 0, passed = 0;
  std::set<std::string> ops;
  for (const auto& c : report["cases"]) {
    ops.insert(c["op"].get<std::string>());
    for (const auto& row : c["checks"]) {
      EXPECT_LE(row["bitwise_passed"].get<int64_t>(), row["bitwise_run"].get<int64_t>());
      if (row.value("informational", false)) continue;  // a measurement (naive SP), not a check
      ++checks;
      passed += row["pass"].get<bool>() ? 1 : 0;
      if (!row["bound"].is_null()) {
        EXPECT_LE(row["max_error_vs_fp64"].get<double>(), row["bound"].get<double>());
      }
    }
  }
  EXPECT_EQ(report["checks_total"], checks);
  EXPECT_EQ(report["checks_passed"], passed);
  EXPECT_GE(checks, 10);
  for (const char* op : {"timestep_sinusoid", "timestep_mlp", "adaln_projection", "rmsnorm"}) {
    EXPECT_TRUE(ops.count(op)) << op;
  }
  const std::string verdict = "detdit verify: PASS, " + std::to_string(passed) + "/" + std::to_string(checks) + " checks";
  EXPECT_NE(r.output.find(verdict), std::string::npos) << r.output;

  r = detdit("report '" + out + "/report.json' --out '" + out + "/figure.svg'");
  EXPECT_EQ(r.code, 0) << r.output;
  const std::string svg = read_file(out + "/figure.svg");
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  for (const std::string& op : ops) EXPECT_NE(svg.find(op), std::string::npos) << op;

  // A report of the same shape with its own title and time label (what
  // scripts/torch_compare.py writes): both replace the verify wording, and a
  // differing comparison is a red cell.
  std::ofstream(out + "/compare.json")
      << R"json({"kind": "detdit_torch_compare", "title": "detdit vs PyTorch", "time_label": "fwd+bwd (s)",
             "verdict": "PASS", "cases": [{"op": "rmsnorm", "case": "block S4097, torch.compile", "seconds": 0.001,
             "checks": [{"check": "run to run", "bitwise_run": 1, "bitwise_passed": 0, "pass": false}]}]})json";
  r = detdit("report '" + out + "/compare.json' --out '" + out + "/compare.svg'");
  EXPECT_EQ(r.code, 0) << r.output;
  const std::string compare_svg = read_file(out + "/compare.svg");
  for (const char* text : {">detdit vs PyTorch</text>", "Time per case (fwd+bwd (s))", "b0/1 run to run",
                           "rmsnorm / block S4097, torch.compile", "fill=\"#d62728\""}) {
    EXPECT_NE(compare_svg.find(text), std::string::npos) << text;
  }
  EXPECT_EQ(compare_svg.find("detdit verify"), std::string::npos);

  // report refuses what is not a verify report.
  std::ofstream(out + "/other.json") << "{\"kind\": 1}";
  r = detdit("report '" + out + "/other.json' --out '" + out + "/x.svg'");
  EXPECT_EQ(r.code, 2) << r.output;
  std::ofstream(out + "/broken.json") << "{";
  r = detdit("report '" + out + "/broken.json'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("broken.json: not valid JSON"), std::string::npos) << r.output;
}

// A failing check exits 1: weights whose time-embedder bias is NaN make the
// timestep_mlp accuracy check measure a NaN error.
TEST(Cli, VerifyFailingCheckExits1) {
  const std::string src = small_weights() + "/" + io::kWeightsFileName;
  io::SafetensorsFile file;
  DETDIT_ASSERT_OK(io::SafetensorsFile::open(src, &file));
  const io::TensorEntry* bias = file.find("time_embedder.linear_2.bias");
  ASSERT_NE(bias, nullptr);
  std::string bytes = read_file(src);
  const float nan = std::nanf("");
  for (uint64_t at = file.data_start() + bias->begin; at < file.data_start() + bias->end; at += 4) {
    std::memcpy(&bytes[at], &nan, 4);
  }
  const std::string dir = temp_dir("nan");
  std::ofstream(dir + "/" + io::kWeightsFileName, std::ios::binary) << bytes;
  Result r = detdit("verify --quick --device cpu --ops timestep_mlp --weights '" + dir + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("detdit verify: FAIL"), std::string::npos) << r.output;
}

// What the outputs promise: the verify table fits 120 columns, a
// progress line per finished case on stderr (not a terminal here), every
// JSON report says where it ran and what was built, help texts state the real
// defaults, and report refuses another kind of report by naming it.
TEST(Cli, OutputsFitAndSayWhereTheyRan) {
  const std::string out = temp_dir("outputs");
  Result r = detdit("verify --quick --device cpu --weights '" + small_weights() + "' --out '" + out +
                    "/report.json' --figure '" + out + "/figure.svg'");
  ASSERT_EQ(r.code, 0) << r.output;
  std::istringstream table(r.stdout_text);
  for (std::string line; std::getline(table, line);) EXPECT_LE(line.size(), 120u) << line;
  const nlohmann::json report = nlohmann::json::parse(read_file(out + "/report.json"));
  const std::size_t cases = report["cases"].size();
  ASSERT_GT(cases, 0u);
  for (std::size_t i = 1; i <= cases; ++i) {
    const std::string progress = "detdit verify: [" + std::to_string(i) + "/" + std::to_string(cases) + "] ";
    EXPECT_NE(r.output.find(progress), std::string::npos) << progress << "\n" << r.output;
  }
  EXPECT_NE(r.output.find(" s elapsed)"), std::string::npos) << r.output;

  std::string version = read_file(std::string(DETDIT_SOURCE_DIR) + "/VERSION");
  version = version.substr(0, version.find('\n'));
  r = detdit("bench --quick --device cpu --ops timestep_mlp --repeats 2 --warmup 0 --format json --weights '" +
             small_weights() + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json bench = nlohmann::json::parse(r.stdout_text);
  EXPECT_NE(r.output.find("detdit bench: [2/2] timestep_mlp"), std::string::npos) << r.output;
  for (const nlohmann::json* json : {&report, &bench}) {
    EXPECT_EQ((*json)["detdit_version"], version);
    const std::string commit = (*json)["git"]["commit"];
    EXPECT_TRUE(commit == "unknown" || (commit.size() == 40 && commit.find_first_not_of("0123456789abcdef") ==
                                                                   std::string::npos))
        << commit;
    for (const char* key : {"host", "device", "compiler", "cuda_runtime", "cuda_driver"})
      EXPECT_TRUE((*json)["environment"][key].is_string() && !(*json)["environment"][key].get<std::string>().empty())
          << key << ": " << json->dump();
    EXPECT_EQ((*json)["environment"]["device"].get<std::string>().rfind("cpu", 0), 0u);
  }
  EXPECT_EQ(report["format_version"], 2);

  // A CPU run's figure: whole check names, no CUDA in the footer.
  const std::string svg = read_file(out + "/figure.svg");
  EXPECT_NE(svg.find(">b14/14 row invariance (position alone) T=7</text>"), std::string::npos) << svg;
  EXPECT_EQ(svg.find("~</text>"), std::string::npos);
  EXPECT_EQ(svg.find("CUDA"), std::string::npos);

  // report given a bench report names it and its kind, not the figure.
  std::ofstream(out + "/bench.json") << bench.dump();
  r = detdit("report '" + out + "/bench.json' --out '" + out + "/bench.svg'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(out + "/bench.json: ValueError: expected a detdit verify report"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("\"detdit_bench_report\": a detdit bench report"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("bench.svg"), std::string::npos) << r.output;

  r = detdit("weights verify --help");
  EXPECT_NE(r.output.find("(default: the number of blocks in the file, at least 1)"), std::string::npos) << r.output;
  expect_usage_errors({
      {"verify --quick=1", "option --quick takes no value"},
      {"verify --out a.json --out b.json", "option --out given twice"},
      {"verify --weights=", "--weights: needs a non-empty value DIR, got ''"},
      {"verify --ops rmsnorm,,rmsnorm", "--ops has an empty item in 'rmsnorm,,rmsnorm'"},
      {"verify --ops rmsnorm,", "--ops has an empty item in 'rmsnorm,'"},
      {"verify --ops rmsnorm,gate_residual,rmsnorm", "--ops lists 'rmsnorm' twice"},
      {"verify --matrix --worlds 2,4,2", "--worlds lists world size 2 twice"},
      {"verify --matrix --seq 4097,", "--seq must list sequence lengths in [1, 16777216], got ''"},
      {"bench --cases a,a", "--cases lists 'a' twice"}});
}

TEST(Cli, BenchQuickJson) {
  Result r = detdit("bench --quick --device cpu --ops timestep_mlp --repeats 2 --warmup 0 --format json --weights '" +
                    small_weights() + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  nlohmann::json out = nlohmann::json::parse(r.stdout_text);
  EXPECT_EQ(out["kind"], "detdit_bench_report");
  EXPECT_GT(out["copy_gbps"].get<double>(), 0);
  EXPECT_EQ(out["format_version"], 2);
  // timestep_mlp at T = 1 and 4 (--quick), each forward, backward and both
  ASSERT_EQ(out["cases"].size(), 6u) << out.dump();
  std::map<std::string, std::map<std::string, int64_t>> compared;  // case -> phase -> elements
  for (const auto& c : out["cases"]) {
    EXPECT_EQ(c["op"], "timestep_mlp");
    EXPECT_EQ(c["wrong"], 0) << c.dump();
    EXPECT_GT(c["compared"].get<int64_t>(), 0) << c.dump();
    EXPECT_GT(c["median_us"].get<double>(), 0);
    EXPECT_GT(c["bytes"].get<double>(), 0);
    compared[c["case"]][c["phase"]] = c["compared"];
  }
  ASSERT_EQ(compared.size(), 2u);
  for (const auto& [name, phases] : compared) {
    ASSERT_EQ(phases.size(), 3u) << name;
    EXPECT_EQ(phases.at("fwd+bwd"), phases.at("fwd") + phases.at("bwd")) << name;
  }
  r = detdit("bench --quick --device cpu --ops timestep_mlp --repeats 2 --format csv --weights '" + small_weights() + "'");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.stdout_text.rfind("op,case,phase,device,median_us", 0), 0u) << r.output;
  // --out: the table on stdout and the same JSON report in the file.
  const std::string dir = temp_dir("bench_out");
  r = detdit("bench --quick --device cpu --ops timestep_mlp --repeats 2 --warmup 0 --out '" + dir +
             "/bench.json' --weights '" + small_weights() + "'");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("copy bandwidth"), std::string::npos) << r.output;
  const nlohmann::json written = nlohmann::json::parse(read_file(dir + "/bench.json"));
  EXPECT_EQ(written["kind"], "detdit_bench_report");
  EXPECT_EQ(written["cases"].size(), 6u) << written.dump();
  // A case name the run does not have is a usage error, not an empty report;
  // sp_region's names count where sp_region runs.
  r = detdit("bench --quick --device cpu --ops timestep_mlp --cases 'T=5' --weights '" + small_weights() + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("detdit: --cases: no case named 'T=5' on --device cpu"), std::string::npos) << r.output;
  r = detdit("bench --quick --device cpu --ops sp_region --cases 'S=4097 block' --repeats 1 --warmup 0 --weights '" +
             small_weights() + "'");
  EXPECT_EQ(r.code, 0) << r.output;
}

// ---- parallel regions (cases/checks.cc, cases/timing.cc) ----

// The rows each rank sends at `world` for the packing, from the op cases'
// packing definition (cases/index_case.h) and the library's SpPlan: the
// CLI's numbers must be these.
std::vector<int64_t> expected_send_rows(testing::Packing packing, int64_t seq_len, int world) {
  const testing::IndexCase index = testing::make_index_case(packing, seq_len, 3, 2);
  SpPlan sp;
  EXPECT_TRUE(SpPlan::create(testing::adaln_plan(index), world, 0, &sp).ok());
  std::vector<int64_t> rows;
  for (const SpPlan::RankTraffic& t : sp.traffic()) rows.push_back(t.send_rows);
  return rows;
}

// Checks the sp_region and tp_adaln_projection cases of a verify report:
// every world row compares `tensors x ranks` tensors, all equal; the
// expected world sizes ran; rows moved match the plan; naive-SP rows are
// informational and show differing bits at world > 1.
void expect_parallel_cases(const nlohmann::json& report, const std::vector<int>& sp_worlds,
                           const std::vector<int>& tp_worlds, int sp_case_count, int tp_case_count) {
  int sp_cases = 0, tp_cases = 0, informational = 0;
  int64_t checks = 0;
  for (const auto& c : report["cases"]) {
    const std::string op = c["op"], name = c["case"];
    std::vector<int> worlds;
    for (const auto& row : c["checks"]) {
      if (row.value("informational", false)) {
        ++informational;
        EXPECT_TRUE(row["pass"].get<bool>()) << row.dump();
        EXPECT_EQ(row["bitwise_run"], 0) << row.dump();
        continue;
      }
      ++checks;
      const std::string check = row["check"];
      const int world = std::stoi(check.substr(3));  // "ws=N" / "tp=N"
      worlds.push_back(world);
      // sp_region: 4 plain rmsnorm + 6 modulated + 4 gate_residual + 9 gate_residual_rmsnorm tensors.
      const int64_t per_rank = op == "sp_region" ? 23 : 5;
      EXPECT_EQ(row["bitwise_run"].get<int64_t>(), per_rank * world) << op << " " << name << " " << row.dump();
      EXPECT_EQ(row["bitwise_passed"], row["bitwise_run"]) << row.dump();
      EXPECT_TRUE(row["pass"].get<bool>()) << row.dump();
      if (op == "sp_region") {
        const testing::Packing packing =
            name.find("interleaved") != std::string::npos ? testing::Packing::kInterleaved : testing::Packing::kBlock;
        const int64_t seq_len = std::stoll(name.substr(2));
        const std::vector<int64_t> expected = expected_send_rows(packing, seq_len, world);
        ASSERT_TRUE(row["metrics"]["send_rows_per_rank"].is_array() || world == 1) << row.dump();
        const std::vector<int64_t> got =
            world == 1 ? std::vector<int64_t>{row["metrics"]["send_rows_per_rank"].get<int64_t>()}
                       : row["metrics"]["send_rows_per_rank"].get<std::vector<int64_t>>();
        EXPECT_EQ(got, expected) << name << " ws=" << world;
      } else {
        EXPECT_GT(row["metrics"]["bytes_sent_per_rank_backward"].get<double>(), 0) << row.dump();
      }
    }
    if (op == "sp_region") {
      ++sp_cases;
      EXPECT_EQ(worlds, sp_worlds) << name;
      for (const auto& row : c["checks"]) {
        if (!row.value("informational", false)) continue;
        // The naive rank-order sum changes d_weight bits at every world > 1.
        EXPECT_GT(row["metrics"]["d_weight_fraction_differing_naive"].get<double>(), 0.0) << row.dump();
        EXPECT_NE(row["detail"].get<std::string>().find("naive rank-order sum differs"), std::string::npos);
      }
    }
    if (op == "tp_adaln_projection") {
      ++tp_cases;
      EXPECT_EQ(worlds, tp_worlds) << name;
    }
  }
  EXPECT_EQ(sp_cases, sp_case_count);
  EXPECT_EQ(tp_cases, tp_case_count);
  EXPECT_GT(informational, 0);
  EXPECT_EQ(report["checks_total"].get<int64_t>(), checks);
  EXPECT_EQ(report["checks_passed"].get<int64_t>(), checks);
}

TEST(Cli, VerifyParallelQuickInProcess) {
  // Small weights: H = 64, N = 18H = 1152 = 18 chunks of 64: tp 1 and 3 split
  // it evenly, 8 unevenly (3, 3, 2, 2, 2, 2, 2, 2 chunks); no TP row is
  // informational (only more ranks than chunks would be refused).
  const std::string out = temp_dir("verify_parallel");
  Result r = detdit("verify --quick --device cpu --ops sp_region,tp_adaln_projection --weights '" + small_weights() +
                    "' --out '" + out + "/report.json'");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json report = nlohmann::json::parse(read_file(out + "/report.json"));
  EXPECT_EQ(report["verdict"], "PASS");
  EXPECT_EQ(report["options"]["comm"], "in_process");
  // --quick on the CPU: S = 4097 x 2 packings; T = 1 and 4.
  expect_parallel_cases(report, {1, 2, 3, 8}, {1, 3, 8}, 2, 2);
  for (const auto& c : report["cases"]) {
    if (c["op"] != "tp_adaln_projection") continue;
    std::map<std::string, nlohmann::json> metrics;
    for (const auto& row : c["checks"]) {
      EXPECT_FALSE(row.value("informational", false)) << row.dump();
      metrics[row["check"].get<std::string>()] = row["metrics"];
    }
    // Every rank sends a block of rank 0's size: 3 chunks at tp = 8 (not N/8 =
    // 2.25 chunks), half of tp = 3's 6.
    for (const char* metric : {"bytes_sent_per_rank_forward", "bytes_sent_per_rank_backward"})
      EXPECT_EQ(2 * metrics["tp=8"][metric].get<double>(), metrics["tp=3"][metric].get<double>()) << metric;
  }
  EXPECT_NE(r.output.find("naive rank-order sum differs from WS1"), std::string::npos) << r.output;
}

// ---- verify --matrix (cases/matrix.cc) ----------------------------------------------

// The matrix on the small weights (H = 64): S = 257 and 4097, a budget that
// B = 2 at S = 4097 (524,416 elements) exceeds and B = 1 (262,208) does not.
const char* const kMatrixSizes = " --seq 257,4097 --matrix-budget 300000";

TEST(Cli, VerifyMatrixCellsSkipsAndFigure) {
  const std::string out = temp_dir("verify_matrix");
  Result r = detdit("verify --matrix --quick --device cpu --weights '" + small_weights() + "'" + kMatrixSizes +
                    " --out '" + out + "/matrix.json' --figure '" + out + "/matrix.svg'");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json report = nlohmann::json::parse(read_file(out + "/matrix.json"));
  EXPECT_EQ(report["kind"], "detdit_verify_report");
  EXPECT_EQ(report["mode"], "matrix");
  EXPECT_EQ(report["verdict"], "PASS");
  const std::string commit = report["git"]["commit"];
  EXPECT_TRUE(commit == "unknown" || commit.size() == 40) << commit;
  EXPECT_FALSE(report["environment"]["host"].get<std::string>().empty());
  const nlohmann::json& m = report["matrix"];
  std::map<std::string, int64_t> results;
  std::set<std::string> ops;
  // (op, packing, B, S) -> the world sizes of its "ws=N" cells.
  std::map<std::string, std::vector<int>> sp_worlds;
  for (const auto& cell : m["cells"]) {
    for (const char* key : {"op", "device", "profile", "world", "packing", "batch", "seq_len", "result", "detail"})
      ASSERT_TRUE(cell.contains(key)) << key << " " << cell.dump();
    EXPECT_EQ(cell["device"], "cpu");
    EXPECT_EQ(cell["profile"], "portable");
    const std::string op = cell["op"], result = cell["result"], check = cell["check"];
    ops.insert(op);
    ++results[result];
    if (result == "pass") {
      EXPECT_EQ(cell["bitwise_passed"], cell["bitwise_run"]) << cell.dump();
    }
    if (result == "skipped") {
      // Never counted as run: no comparison, the reason given.
      EXPECT_EQ(cell["bitwise_run"], 0) << cell.dump();
      EXPECT_NE(cell["detail"].get<std::string>().find("over this run's budget of 300,000"), std::string::npos);
    }
    // Only the modulated norm and the gate have a naive contrast (run or skipped).
    if (check.rfind("naive", 0) == 0) {
      EXPECT_TRUE(op == "sp_rmsnorm_modulated" || op == "sp_gate_residual") << op;
    }
    if (op.rfind("sp_", 0) != 0 || check.rfind("ws=", 0) != 0) continue;
    const int world = cell["world"], batch = cell["batch"], seq_len = cell["seq_len"];
    EXPECT_EQ(check, "ws=" + std::to_string(world));
    // Over the budget exactly when B x S x H > 300,000.
    EXPECT_EQ(result, batch * seq_len * 64 > 300000 ? "skipped" : "pass") << cell.dump();
    // Every rank compares each of the variant's tensors with WS1.
    const int per_rank = op == "sp_rmsnorm_modulated" ? 6 : op == "sp_gate_residual_rmsnorm" ? 9 : 4;
    if (result == "pass") {
      EXPECT_EQ(cell["bitwise_run"].get<int>(), per_rank * world) << cell.dump();
    }
    sp_worlds[op + " " + cell["packing"].get<std::string>() + " B" + std::to_string(batch) + " S" +
              std::to_string(seq_len)]
        .push_back(world);
  }
  // 4 ops x 2 packings x B in {1, 2} x S in {257, 4097}, each at --quick's worlds.
  EXPECT_EQ(sp_worlds.size(), 32u);
  for (const auto& [key, worlds] : sp_worlds) EXPECT_EQ(worlds, (std::vector<int>{1, 2, 3, 8})) << key;
  for (const char* op : {"linear", "rmsnorm", "gate_residual", "gate_residual_rmsnorm", "adaln_row_gather",
                         "timestep_sinusoid", "timestep_mlp", "sp_rmsnorm_plain", "sp_rmsnorm_modulated",
                         "sp_gate_residual", "sp_gate_residual_rmsnorm", "tp_adaln_projection"})
    EXPECT_TRUE(ops.count(op)) << op;
  EXPECT_EQ(m["counts"]["pass"], results["pass"]);
  EXPECT_EQ(m["counts"]["skipped"], results["skipped"]);
  EXPECT_EQ(results["fail"], 0);
  EXPECT_GT(results["skipped"], 0);
  EXPECT_GT(results["info"], 0);  // the naive-SP contrast
  EXPECT_EQ(report["checks_total"], results["pass"]);
  EXPECT_FALSE(m["not_enumerated"].empty());
  EXPECT_NE(r.output.find("detdit verify --matrix: PASS, " + std::to_string(results["pass"]) + "/" +
                          std::to_string(results["pass"]) + " cells passed (cpu"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(std::to_string(results["skipped"]) + " cells skipped"), std::string::npos);
  EXPECT_NE(r.output.find("not in this matrix: profile torch"), std::string::npos) << r.output;
  // The figure draws the skipped cells as such; detdit report draws the JSON too.
  const std::string svg = read_file(out + "/matrix.svg");
  EXPECT_NE(svg.find("skipped (not run)"), std::string::npos);
  EXPECT_NE(svg.find("sp_rmsnorm_modulated / S=4097 B=2 interleaved"), std::string::npos);
  r = detdit("report '" + out + "/matrix.json' --out '" + out + "/redrawn.svg'");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(read_file(out + "/redrawn.svg"), svg);
}

// The test hook flips one bit of an op's WS1 output: its cells must fail with
// the mismatch (count, first index, both values in hex, ulp), the others pass.
TEST(Cli, VerifyMatrixCorruptedCellsFail) {
  const std::string out = temp_dir("verify_matrix_corrupt");
  ::setenv("DETDIT_TEST_CORRUPT_CELLS", "sp_rmsnorm_modulated", 1);
  Result r = detdit("verify --matrix --quick --device cpu --ops sp_rmsnorm_modulated,sp_gate_residual --seq 257 "
                    "--weights '" + small_weights() + "' --out '" + out + "/matrix.json'");
  ::unsetenv("DETDIT_TEST_CORRUPT_CELLS");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("detdit verify --matrix: FAIL"), std::string::npos) << r.output;
  const nlohmann::json report = nlohmann::json::parse(read_file(out + "/matrix.json"));
  EXPECT_EQ(report["verdict"], "FAIL");
  EXPECT_EQ(report["matrix"]["test_corrupted_op"], "sp_rmsnorm_modulated");
  int failed = 0, passed = 0;
  for (const auto& cell : report["matrix"]["cells"]) {
    const std::string op = cell["op"], result = cell["result"], check = cell["check"];
    ASSERT_TRUE(op == "sp_rmsnorm_modulated" || op == "sp_gate_residual") << op;
    if (result == "info") continue;
    if (op == "sp_gate_residual") {
      EXPECT_EQ(result, "pass") << cell.dump();
      ++passed;
      continue;
    }
    EXPECT_EQ(result, "fail") << cell.dump();
    ++failed;
    // Rank 0 holds element 0 of the output.
    EXPECT_EQ(cell["bitwise_passed"].get<int>() + 1, cell["bitwise_run"].get<int>()) << cell.dump();
    const std::string detail = cell["detail"];
    for (const char* part : {"rank 0: modulated rmsnorm out: 1 of ", " elements differ; first at index 0: expected 0x",
                             ", got 0x", " 1 ulp"})
      EXPECT_NE(detail.find(part), std::string::npos) << part << " in " << detail;
  }
  EXPECT_EQ(failed, 2 * 2 * 4);  // 2 packings x B in {1, 2} x worlds 1, 2, 3, 8
  EXPECT_EQ(passed, 2 * 2 * 4);
  // A name the matrix does not have is a usage error, not a silent pass.
  ::setenv("DETDIT_TEST_CORRUPT_CELLS", "no_such_op", 1);
  r = detdit("verify --matrix --quick --device cpu --ops sp_gate_residual --seq 257 --weights '" + small_weights() + "'");
  ::unsetenv("DETDIT_TEST_CORRUPT_CELLS");
  EXPECT_EQ(r.code, 2) << r.output;
  r = detdit("verify --matrix --quick --device cpu --ops no_such_op --weights '" + small_weights() + "'");
  EXPECT_EQ(r.code, 2) << r.output;
}

// mpirun from PATH (the binary itself was built with or without MPI; a build
// without it refuses --comm mpi with exit 2).
bool have_mpirun() { return std::system("command -v mpirun > /dev/null 2>&1") == 0; }
const char* const kMpirun =
    "timeout 300 mpirun --oversubscribe --allow-run-as-root --mca btl self,vader "
    "--mca btl_vader_single_copy_mechanism none -np 2 ";

TEST(Cli, VerifyParallelUnderMpirunTwoRanks) {
#if !defined(DETDIT_WITH_MPI)
  GTEST_SKIP() << "detdit was built without MPI";
#endif
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not on PATH";
  const std::string out = temp_dir("verify_mpi");
  const std::string weights = small_weights();
  const std::string cache = temp_dir("cache");
  const std::string command = std::string("XDG_CACHE_HOME='") + cache + "' " + kMpirun + "'" + DETDIT_CLI_PATH +
                              "' verify --comm mpi --device cpu --quick --weights '" + weights + "' --out '" + out +
                              "/report.json' > '" + out + "/output.txt' 2>&1";
  const int status = std::system(command.c_str());
  const std::string output = read_file(out + "/output.txt");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n" << output;
  const nlohmann::json report = nlohmann::json::parse(read_file(out + "/report.json"));
  EXPECT_EQ(report["verdict"], "PASS");
  EXPECT_EQ(report["options"]["comm"], "mpi");
  EXPECT_EQ(report["options"]["world_size"], 2);
  // Only the parallel cases run under --comm mpi; every row counts both ranks.
  for (const auto& c : report["cases"]) {
    const std::string op = c["op"];
    EXPECT_TRUE(op == "sp_region" || op == "tp_adaln_projection") << op;
  }
  // Under MPI: S = 4097 and 32768 x 2 packings; T = 1..4.
  expect_parallel_cases(report, {2}, {2}, 4, 4);
  EXPECT_NE(output.find("ranks over mpi"), std::string::npos) << output;
  // Rank 0 alone prints the table: one verdict line.
  EXPECT_EQ(output.find("detdit verify: PASS"), output.rfind("detdit verify: PASS")) << output;
}

// Ranks started with different command lines (an MPMD launch: one app
// context per rank) exit 2 together, each saying why, within a minute; 6 of
// these used to hang (a rank waiting in a collective its peer never entered).
// The name says "Mpi": the sanitizer job (scripts/test.sh) runs the tests that
// start MPI processes with the unwinder that finds Open MPI's frames.
TEST(Cli, RanksWithDifferentCommandLinesUnderMpirunFailTogether) {
#if !defined(DETDIT_WITH_MPI)
  GTEST_SKIP() << "detdit was built without MPI";
#endif
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not on PATH";
  const std::string weights = " --weights '" + small_weights() + "'";
  const std::string verify = "verify --comm mpi --device cpu --quick" + weights;
  const std::string bench = "bench --comm mpi --device cpu --quick --warmup 0 --format json" + weights;
  const std::pair<std::string, std::string> pairs[] = {
      {verify + " --ops sp_region", verify + " --ops tp_adaln_projection"},
      {verify, verify + " --list"},
      {verify, verify + " --help"},
      {verify, bench},
      {bench + " --repeats 2", bench + " --repeats 3"},
      {verify + " --seed 1", verify + " --seed 2"},
  };
  const std::string out = temp_dir("mpmd") + "/output.txt";
  for (const auto& [first, second] : pairs) {
    const std::string app = std::string("'") + DETDIT_CLI_PATH + "' ";
    const std::string command = std::string("XDG_CACHE_HOME='") + temp_dir("cache") +
                                "' timeout -k 5 60 mpirun --oversubscribe --allow-run-as-root --mca btl self,vader "
                                "--mca btl_vader_single_copy_mechanism none -np 1 " + app + first + " : -np 1 " + app +
                                second + " > '" + out + "' 2>&1";
    const int status = std::system(command.c_str());
    const std::string output = read_file(out);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    EXPECT_EQ(code, 2) << "(124: timed out) " << command << "\n" << output;
    for (const char* rank : {"rank 0 of 2", "rank 1 of 2"})
      EXPECT_NE(output.find(std::string("detdit: ") + rank + ": ValueError: rank 1 was started with another command line"),
                std::string::npos)
          << command << "\n" << output;
  }
}

// The same --weights text resolving to other bytes on another rank (each rank
// started in its own working directory: an MPMD launch with -wdir) is refused
// with exit 2 on every rank, naming both files and digests, instead of
// reporting FAIL rows; identical bytes at other paths run.
TEST(Cli, RanksWithDifferentWeightsUnderMpirunFailTogether) {
#if !defined(DETDIT_WITH_MPI)
  GTEST_SKIP() << "detdit was built without MPI";
#endif
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not on PATH";
  // The ranks name their files by absolute path, without symbolic links.
  char canonical[PATH_MAX];
  ASSERT_NE(realpath(temp_dir("mpi_weights").c_str(), canonical), nullptr);
  const std::string root = canonical;
  // Rank 0's and rank 2's files are byte copies; rank 1's has another seed.
  for (const auto& [dir, seed] : {std::pair<const char*, int>{"a", 1}, {"b", 2}}) {
    Result r = detdit("weights synth --out '" + root + "/" + dir + "/w' --seed " + std::to_string(seed) + kSmallDims);
    ASSERT_EQ(r.code, 0) << r.output;
  }
  ASSERT_EQ(std::system(("mkdir -p '" + root + "/c' && cp -r '" + root + "/a/w' '" + root + "/c/w'").c_str()), 0);
  const std::string file_a = read_file(root + "/a/w/h3_conditioning.safetensors");
  const std::string sha_a = io::sha256_hex(file_a.data(), file_a.size());
  const std::string out = root + "/output.txt";
  auto launch = [&](const std::string& second_dir) {
    const std::string app = std::string("'") + DETDIT_CLI_PATH + "' verify --comm mpi --device cpu --quick " +
                            "--ops tp_adaln_projection --weights w";
    const std::string command = std::string("XDG_CACHE_HOME='") + temp_dir("cache") +
                                "' timeout -k 5 60 mpirun --oversubscribe --allow-run-as-root --mca btl self,vader "
                                "--mca btl_vader_single_copy_mechanism none -np 1 -wdir '" + root + "/a' " + app +
                                " : -np 1 -wdir '" + root + "/" + second_dir + "' " + app + " > '" + out + "' 2>&1";
    const int status = std::system(command.c_str());
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, command + "\n" + read_file(out));
  };
  auto [code, output] = launch("b");
  EXPECT_EQ(code, 2) << "(124: timed out) " << output;
  EXPECT_NE(output.find("detdit: ValueError: the ranks loaded different weights: rank 0 loaded " + root +
                        "/a/w/h3_conditioning.safetensors (SHA-256 " + sha_a + "), but rank 1 loaded " + root +
                        "/b/w/h3_conditioning.safetensors (SHA-256 "),
            std::string::npos)
      << output;
  EXPECT_EQ(output.find("FAIL"), std::string::npos) << output;
  std::tie(code, output) = launch("c");
  EXPECT_EQ(code, 0) << output;
  EXPECT_NE(output.find("detdit verify: PASS"), std::string::npos) << output;
}

TEST(Cli, BenchParallelCpuJson) {
  Result r = detdit("bench --device cpu --ops sp_region,tp_adaln_projection --repeats 2 --warmup 0 --format json "
                    "--weights '" + small_weights() + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json out = nlohmann::json::parse(r.stdout_text);
  const nlohmann::json& p = out["parallel"];
  EXPECT_EQ(p["simulated"], true);
  EXPECT_NE(p["how"].get<std::string>().find("SIMULATION"), std::string::npos);
  std::map<std::string, std::vector<int>> worlds;
  for (const auto& row : p["results"]) {
    ASSERT_FALSE(row.contains("error")) << row.dump();
    const std::string key = row["op"].get<std::string>() + " " + row["case"].get<std::string>() + " " +
                            row["phase"].get<std::string>();
    worlds[key].push_back(row["ws1"].get<bool>() ? 0 : row["world"].get<int>());
    EXPECT_GT(row["median_us"].get<double>(), 0) << row.dump();
    EXPECT_EQ(row["wrong"], 0) << row.dump();
    if (!row["ws1"].get<bool>()) {
      EXPECT_GT(row["compared"].get<int64_t>(), 0) << row.dump();
      EXPECT_EQ(row["rank_median_us"].size(), row["world"].get<std::size_t>()) << row.dump();
    }
  }
  // WS1 first, then 2, 4, 8 (TP too: N = 1152 has 18 chunks, 4 and 8 split it unevenly).
  const std::vector<int> sp = {0, 2, 4, 8}, tp = {0, 2, 4, 8};
  EXPECT_EQ(worlds["sp_region S=4097 block fwd+bwd"], sp);
  EXPECT_EQ(worlds["sp_region S=4097 interleaved fwd+bwd"], sp);
  EXPECT_EQ(worlds["tp_adaln_projection T=4 fwd"], tp);
  EXPECT_EQ(worlds["tp_adaln_projection T=4 fwd+bwd"], tp);
  // The targets of docs/design.md are listed; S = 131072 is not run on the CPU.
  ASSERT_EQ(p["targets"].size(), 2u);
  for (const auto& t : p["targets"]) EXPECT_TRUE(t["measured_speedup"].is_null()) << t.dump();
}

TEST(Cli, BenchPredictWorldIsAPredictionFromEachRankAloneAndTheLinkModel) {
  Result r = detdit("bench --device cpu --ops sp_region,tp_adaln_projection --predict-world 2,4 --link-gbps 1 "
                    "--link-latency-us 5 --repeats 1 --warmup 0 --format json --weights '" + small_weights() + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json p = nlohmann::json::parse(r.stdout_text)["parallel"];
  EXPECT_EQ(p["predicted"], true);
  EXPECT_EQ(p["simulated"], false);
  EXPECT_EQ(p["comm"], "prediction");
  EXPECT_EQ(p["how"].get<std::string>().rfind("PREDICTION, not a measurement", 0), 0u) << p["how"];
  EXPECT_EQ(p["link_model"]["bus_gbps"], 1.0);
  EXPECT_EQ(p["link_model"]["latency_us"], 5.0);
  int predicted = 0;
  for (const auto& row : p["results"]) {
    ASSERT_FALSE(row.contains("error")) << row.dump();
    if (row["ws1"].get<bool>()) continue;
    ++predicted;
    EXPECT_EQ(row["predicted"], true) << row.dump();
    EXPECT_TRUE(row["wrong"].is_null() && row["compared"].is_null()) << row.dump();  // not checked
    EXPECT_EQ(row["rank_median_us"].size(), row["world"].get<std::size_t>()) << row.dump();
    // prediction = the slowest rank alone + (latency per collective + bytes / bandwidth)
    const double calls = row["collectives_per_step"], bytes = row["link_bytes_per_rank"];
    const double link_us = row["predicted_link_us"], compute_us = row["predicted_compute_us"];
    EXPECT_GT(calls, 0) << row.dump();
    EXPECT_NEAR(link_us, calls * 5.0 + bytes / 1e9 * 1e6, 1e-6 * link_us) << row.dump();
    double slowest = 0;
    for (double m : row["rank_median_us"]) slowest = std::max(slowest, m);
    EXPECT_DOUBLE_EQ(compute_us, slowest) << row.dump();
    EXPECT_NEAR(row["median_us"].get<double>(), compute_us + link_us, 1e-9 * (compute_us + link_us)) << row.dump();
    if (row["op"] == "tp_adaln_projection" && row["phase"] == "fwd" && row["world"] == 2) {
      // one all-gather of rank 0's block: ceil(18 / 2) = 9 chunks of 64 columns, T = 4, bf16,
      // received from the one other rank
      EXPECT_EQ(calls, 1) << row.dump();
      EXPECT_EQ(bytes, 4.0 * 9 * 64 * 2) << row.dump();
    }
  }
  EXPECT_EQ(predicted, 8);  // sp_region 2 packings, tp 2 phases; worlds 2 and 4
  EXPECT_TRUE(p["wrong_vs"].is_null());
  for (const auto& t : p["targets"]) EXPECT_TRUE(t["predicted"].get<bool>() && !t["simulated"].get<bool>()) << t.dump();
  // A world size that cannot split N (18 chunks here) is an error row, and the run fails.
  r = detdit("bench --device cpu --ops tp_adaln_projection --predict-world 2,64 --repeats 1 --warmup 0 --format json "
             "--weights '" + small_weights() + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  int refused = 0;
  const nlohmann::json refusing = nlohmann::json::parse(r.stdout_text);
  for (const auto& row : refusing["parallel"]["results"]) {
    if (!row.contains("error")) continue;
    ++refused;
    EXPECT_EQ(row["world"], 64) << row.dump();
    EXPECT_NE(row["error"].get<std::string>().find("tp=64 is more ranks than the 18"), std::string::npos) << row.dump();
  }
  EXPECT_EQ(refused, 2);  // fwd and fwd+bwd
  // CSV: every line has the header's 11 columns; a region's case names its world.
  r = detdit("bench --device cpu --ops tp_adaln_projection --predict-world 2 --repeats 1 --warmup 0 --format csv "
             "--weights '" + small_weights() + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  std::istringstream csv(r.stdout_text);
  std::vector<std::string> csv_rows;
  for (std::string line; std::getline(csv, line);) {
    EXPECT_EQ(std::count(line.begin(), line.end(), ','), 10) << line;
    csv_rows.push_back(line.substr(0, line.find(",cpu,")));
  }
  EXPECT_EQ(csv_rows, (std::vector<std::string>{"op,case,phase,device,median_us,bytes,gbps,percent_of_copy,wrong,compared,error",
                                                "tp_adaln_projection,T=4 WS1,fwd", "tp_adaln_projection,T=4 ws=2 predicted,fwd",
                                                "tp_adaln_projection,T=4 WS1,fwd+bwd",
                                                "tp_adaln_projection,T=4 ws=2 predicted,fwd+bwd"}));
  expect_usage_errors({
      {"bench --device cpu --ops sp_region --predict-world 1", "--predict-world must list world sizes in [2, 1024], got '1'"},
      {"bench --device cpu --ops sp_region --predict-world 2x", "--predict-world must list world sizes in [2, 1024], got '2x'"},
      {"bench --device cpu --ops sp_region --predict-world 2,,4", "--predict-world must list world sizes in [2, 1024], got ''"},
      {"bench --device cpu --ops sp_region --link-gbps 5", "--link-gbps and --link-latency-us are the model of --predict-world"},
      {"bench --device cpu --ops sp_region --predict-world 2 --link-gbps 0", "--link-gbps must be a number > 0, got '0'"},
      {"bench --device cpu --ops timestep_mlp --predict-world 2", "--predict-world predicts the parallel regions, and none runs here"}});
}

TEST(Cli, BenchPredictWorldUnderMpirunMeasuresTheLinkAndComparesWithTheMeasuredWorld) {
#if !defined(DETDIT_WITH_MPI)
  GTEST_SKIP() << "detdit was built without MPI";
#endif
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not on PATH";
  const std::string out = temp_dir("bench_predict_mpi");
  const std::string command = std::string("XDG_CACHE_HOME='") + temp_dir("cache") + "' " + kMpirun + "'" +
                              DETDIT_CLI_PATH + "' bench --comm mpi --device cpu --ops tp_adaln_projection " +
                              "--predict-world 2,4 --repeats 2 --warmup 0 --format json --weights '" + small_weights() +
                              "' > '" + out + "/bench.json' 2> '" + out + "/err.txt'";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n" << read_file(out + "/err.txt");
  const nlohmann::json p = nlohmann::json::parse(read_file(out + "/bench.json"))["parallel"];
  EXPECT_EQ(p["comm"], "mpi");
  EXPECT_EQ(p["predicted"], true);
  EXPECT_NE(p["link_model"]["source"].get<std::string>().find("bandwidth measured, latency measured over mpi between 2 ranks"),
            std::string::npos) << p["link_model"].dump();
  EXPECT_GT(p["link_model"]["bus_gbps"].get<double>(), 0);
  EXPECT_GT(p["link_model"]["latency_us"].get<double>(), 0);
  std::map<std::string, double> measured;  // phase -> the measured world 2's median
  int predictions = 0;
  for (const auto& row : p["results"]) {
    ASSERT_FALSE(row.contains("error")) << row.dump();
    if (row["ws1"].get<bool>()) continue;
    if (!row["predicted"].get<bool>()) {
      EXPECT_EQ(row["world"], 2) << row.dump();
      EXPECT_EQ(row["wrong"], 0) << row.dump();
      EXPECT_GT(row["compared"].get<int64_t>(), 0) << row.dump();
      measured[row["phase"]] = row["median_us"];
      continue;
    }
    ++predictions;
    EXPECT_TRUE(row["wrong"].is_null()) << row.dump();
    // the prediction of the measured world carries the measurement and its error
    if (row["world"] == 2) {
      ASSERT_EQ(measured.count(row["phase"]), 1u) << row.dump();
      const double m = measured[row["phase"]], predicted = row["median_us"];
      EXPECT_DOUBLE_EQ(row["measured_us"].get<double>(), m) << row.dump();
      EXPECT_NEAR(row["prediction_error_percent"].get<double>(), 100 * (predicted - m) / m, 1e-9) << row.dump();
    } else {
      EXPECT_FALSE(row.contains("measured_us")) << row.dump();
    }
  }
  EXPECT_EQ(predictions, 4);  // fwd and fwd+bwd at worlds 2 and 4
}

TEST(Cli, BenchParallelUnderMpirunTwoRanks) {
#if !defined(DETDIT_WITH_MPI)
  GTEST_SKIP() << "detdit was built without MPI";
#endif
  if (!have_mpirun()) GTEST_SKIP() << "mpirun is not on PATH";
  const std::string out = temp_dir("bench_mpi");
  const std::string command = std::string("XDG_CACHE_HOME='") + temp_dir("cache") + "' " + kMpirun + "'" +
                              DETDIT_CLI_PATH + "' bench --comm mpi --device cpu --quick --repeats 2 --warmup 0 --format json " +
                              "--weights '" + small_weights() + "' > '" + out + "/bench.json' 2> '" + out + "/err.txt'";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n" << read_file(out + "/err.txt");
  // Rank 0 alone prints: the output is one JSON document.
  const nlohmann::json report = nlohmann::json::parse(read_file(out + "/bench.json"));
  const nlohmann::json& p = report["parallel"];
  EXPECT_EQ(p["comm"], "mpi");
  EXPECT_EQ(p["world_size"], 2);
  EXPECT_EQ(p["simulated"], false);
  EXPECT_TRUE(report["cases"].empty()) << "only the parallel ops run under --comm mpi";
  int worlds = 0;
  for (const auto& row : p["results"]) {
    ASSERT_FALSE(row.contains("error")) << row.dump();
    EXPECT_EQ(row["rank_median_us"].size(), 2u) << row.dump();  // every rank's median, WS1 included
    EXPECT_EQ(row["wrong"], 0) << row.dump();
    if (!row["ws1"].get<bool>()) {
      ++worlds;
      EXPECT_EQ(row["world"], 2);
      EXPECT_GT(row["compared"].get<int64_t>(), 0);
    }
  }
  EXPECT_EQ(worlds, 4);  // SP S=4097 x 2 packings, TP T=4 fwd and fwd+bwd
}

}  // namespace
}  // namespace detdit
