// The detdit CLI's commands and what their drivers share: the environment a
// report records, the device and MPI world of a run, and its weights. Exit
// codes: 0 every check passed, 1 a check failed, 2 usage or input error.
// Every command answers --help.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "cases/op_case.h"
#include "detdit/comm.h"
#include "detdit/status.h"
#include "detdit/tensor.h"
#include "io/weights.h"
#include "progress.h"

namespace detdit {
namespace cli {

extern const char* const kUsage;

int run_verify(int argc, char** argv);   // verify.cc
int run_bench(int argc, char** argv);    // bench.cc
int run_report(int argc, char** argv);   // report.cc
int run_weights(int argc, char** argv);  // weights_cmd.cc

// Runs the command argv[1] names among `commands` on argv[1..argc). No
// command: `usage` on stderr (exit 2); --help or -h: `usage` on stdout;
// another: "unknown <kind>command" (2).
int run_command(int argc, char** argv, const char* usage, const char* kind,
                std::initializer_list<std::pair<const char*, int (*)(int, char**)>> commands);

// A usage or input error: prints "detdit: <message>" to stderr where `print`
// (e.g. on the leader rank alone) and returns exit code 2.
int fail(const std::string& message, bool print = true);

// The figure of a verify report (report.cc).
Status write_report_svg(const nlohmann::json& report, const std::string& path);

// ---- the run (run.cc) ---------------------------------------------------------

// What every JSON report (verify, bench) records of where it ran and what
// ran: "detdit_version", "git": {"commit", "dirty"} (the git state of the
// source tree when this binary was built, tools/build_commit.cmake: HEAD, or
// "unknown" where the source was no git clone; dirty: tracked files differed
// from HEAD) and "environment": {"host", "device" ("cpu (2 threads)",
// "cuda:0 NVIDIA H200 (sm_90)"), "compiler", "cuda_runtime", "cuda_driver"}
// ("none" where a CPU-only build or a machine without a driver has none).
void record_environment(const Device& device, nlohmann::ordered_json* report);

// Under mpirun (launched_by_mpi()) every process must run the same command
// line: the collectives of a command follow from its options, so ranks
// started differently (another --ops or --repeats, --help or --list on one,
// verify on one and bench on another) would wait forever in a collective
// their peers never enter. Called first, before any command can exit, on
// every rank: the ranks exchange argv[1..argc) over MPI. Returns -1 (go on)
// when they are equal or this is no multi-process MPI run (or detdit has no
// MPI); else 2 (a usage error, on every rank, each saying so).
int agree_on_command_line(int argc, char** argv);

// --device (cpu, cuda; not given: cuda when a GPU is present) and --comm
// (inprocess, mpi) of a verify or bench run. Under --comm mpi this process is
// one rank of *world: MPI on the CPU; on CUDA, NCCL (with `nccl`) on GPU
// (rank on this host % device count; more ranks on a host than GPUs is a
// ValueError on every rank) from a unique id broadcast over MPI, with
// NCCL_NVLS_ENABLE=0 set first unless the user set it (NVLink multicast stays
// off); *device is where this rank's tensors live. Returns -1 (go on) or 2
// (a usage error, printed).
int open_run(const Args& args, const NcclOptions& nccl, Device* device, std::unique_ptr<Communicator>* world);

// The run's weights on every rank of `world` (nullptr: this process alone).
// First the leader checks that `destinations` (the reports it will write) can
// be replaced, so a bad one is refused before the run; then rank 0 resolves
// --weights `option` (io::resolve_weights: the cached synthetic default of
// `config` and `seed` when empty, generated on first use) before the others,
// so no two ranks write the cache at once; then the ranks all-gather the
// SHA-256 of their weights file (and its absolute path) and compare the
// digests: the same text may name other files on other ranks (a relative
// path under another working directory, another host's copy). Every rank
// gets the same verdict; a rank whose own resolve failed prints why.
Status resolve_run_weights(Communicator* world, const std::vector<std::string>& destinations,
                           const std::string& option, const io::ManifestConfig& config, uint64_t seed,
                           io::Weights* weights);

// A barrier that also agrees on success: every rank learns whether any rank's
// `local` failed (that rank's own error, else a RuntimeError naming the first
// failing rank). Unlike Communicator::agree it always communicates (a NCCL
// communicator without its call check skips agree's exchange).
Status all_ranks_ok(Communicator& comm, const Status& local);

// The op-case library's context of a run on `weights`: their dimensions and
// tensors, --quick and the seed of the inputs.
cases::CaseContext case_context(const io::Weights& weights, bool quick, uint64_t seed);

}  // namespace cli
}  // namespace detdit
