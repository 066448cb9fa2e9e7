// What the parallel verify and bench drivers share (verify_cases.cc, verify.cc,
// bench_parallel.cc): the world of a `--comm mpi` run, the agreement on the
// command line and on the weights' content, and an all-gather of small host
// records through any communicator. The problems they drive are
// cases/parallel_cases.h's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cases/parallel_cases.h"
#include "detdit/comm.h"
#include "detdit/parallel.h"
#include "io/weights.h"
#include "verify.h"

namespace detdit {
namespace cli {

// The problems, their runs and the comparison with WS1 are the op-case
// library's (cases/parallel_cases.h).
using cases::kSpVariants;
using cases::local_rows;
using cases::Packing;
using cases::packing_name;
using cases::ParallelRun;
using cases::RankStream;
using cases::RunOutput;
using cases::SpIndex;
using cases::SpProblem;
using cases::SpVariant;
using cases::sp_variant_has_naive_contrast;
using cases::sp_variant_name;
using cases::sp_variant_takes_profile;
using cases::TpProblem;
using cases::TpWeights;
using cases::gather_host_bytes;

// ---- --comm mpi ---------------------------------------------------------------

// The communicator of a process launched by mpirun: MPI on the CPU; on CUDA,
// NCCL on GPU (rank on this host % device count; more ranks on a host than
// GPUs is a ValueError on every rank) from a unique id broadcast over MPI,
// with NCCL_NVLS_ENABLE=0 set first unless the user set it (NVLink
// multicast stays off). *device is where this rank's tensors live.
Status open_mpi_world(bool cuda, std::unique_ptr<Communicator>* comm, Device* device, NcclOptions options = {});

// Under mpirun (launched_by_mpi()) every process must run the same command
// line: the collectives of a command follow from its options, so ranks
// started differently (another --ops or --repeats, --help or --list on one,
// verify on one and bench on another) would wait forever in a collective
// their peers never enter. Called first, before any command can exit, on
// every rank: the ranks exchange argv[1..argc) over MPI. Returns
// -1 (go on) when they are equal or this is no multi-process MPI run (or
// detdit has no MPI); else 2 (a usage error, on every rank, each saying so).
int agree_on_command_line(int argc, char** argv);

// Under mpirun every rank must also compute on the same weights, whatever
// path its --weights resolved to (a relative path under another working
// directory, another host's copy): after loading, the ranks all-gather the
// SHA-256 of their weights file (and its absolute path) and compare the
// digests. Returns the same ValueError on every rank when they differ, naming
// each rank whose file differs from rank 0's with both paths and digests (a
// usage error: the CLI exits 2 instead of reporting FAIL rows).
Status agree_on_weights(Communicator& comm, const io::Weights& weights);

// The device of --device `name` ("cpu", "cuda", or empty: cuda when a GPU is
// present); false with *error (a usage error) otherwise.
bool parse_device(const std::string& name, Device* device, std::string* error);

// The run's weights on every rank of `world` (nullptr: this process alone).
// First the leader checks that `destinations` (the reports it will write) can
// be replaced, so a bad one is refused before the run; then rank 0 resolves
// --weights `option` (io::resolve_weights: the cached synthetic default of
// `config` and `seed` when empty, generated on first use) before the others,
// so no two ranks write the cache at once; then the ranks agree that they
// loaded the same bytes (agree_on_weights). Every rank gets the same verdict;
// a rank whose own resolve failed prints why.
Status resolve_run_weights(Communicator* world, const std::vector<std::string>& destinations,
                           const std::string& option, const io::ManifestConfig& config, uint64_t seed,
                           io::Weights* weights);

// A barrier that also agrees on success: every rank learns whether any rank's
// `local` failed (that rank's own error, else a RuntimeError naming the first
// failing rank). Unlike Communicator::agree it always communicates (a NCCL
// communicator without its call check skips agree's exchange).
Status all_ranks_ok(Communicator& comm, const Status& local);


}  // namespace cli
}  // namespace detdit
