// The run of a verify or bench command (cli.h): the environment a report
// records, the device and MPI world, and the weights every rank agrees on.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "build_commit.h"  // generated: DETDIT_BUILD_COMMIT, DETDIT_BUILD_DIRTY
#include "cases/parallel_cases.h"
#include "cli.h"
#include "io/files.h"
#include "io/sha256.h"

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cli {

using cases::gather_host_bytes;

namespace {

std::string version_string(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// Usable CUDA devices (0 in a CPU-only build or without a GPU).
int cuda_device_count() {
#ifdef DETDIT_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

}  // namespace

void record_environment(const Device& device, nlohmann::ordered_json* report) {
#if defined(__clang__)
  const std::string compiler = "Clang " __clang_version__;
#elif defined(__GNUC__)
  const std::string compiler = "GCC " __VERSION__;
#else
  const std::string compiler = "unknown";
#endif
  std::string runtime = "none", driver = "none", host;
  std::string device_name = "cpu (" + std::to_string(std::thread::hardware_concurrency()) + " threads)";
#ifdef DETDIT_WITH_CUDA
  int v = 0;
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) runtime = version_string(v);
  if (cudaDriverGetVersion(&v) == cudaSuccess && v > 0) driver = version_string(v);
  cudaDeviceProp prop;
  if (device.is_cuda() && cudaGetDeviceProperties(&prop, device.index) == cudaSuccess) {
    device_name = device.to_string() + " " + prop.name + " (sm_" + std::to_string(prop.major) +
                  std::to_string(prop.minor) + ")";
  }
  cudaGetLastError();
#else
  (void)device;
  (void)version_string;
#endif
  char name[256] = {0};
  if (::gethostname(name, sizeof name - 1) == 0) host = name;
  (*report)["detdit_version"] = DETDIT_VERSION;
  (*report)["git"] = {{"commit", DETDIT_BUILD_COMMIT}, {"dirty", DETDIT_BUILD_DIRTY != 0}};
  (*report)["environment"] = {{"host", host},
                              {"device", device_name},
                              {"compiler", compiler},
                              {"cuda_runtime", runtime},
                              {"cuda_driver", driver}};
}

// ---- --device and --comm ----------------------------------------------------

namespace {

Status open_mpi_world(bool cuda, std::unique_ptr<Communicator>* comm, Device* device, const NcclOptions& options) {
  std::unique_ptr<Communicator> mpi;
  DETDIT_RETURN_IF_ERROR(create_mpi_communicator(&mpi));
  if (!cuda) {
    *device = Device::cpu();
    *comm = std::move(mpi);
    return Status::ok_status();
  }
  // The rank on this host and the ranks on this host (Open MPI's launcher
  // variables; a single-host launcher without them: the MPI rank and world).
  auto from_env = [](const char* name, int fallback) {
    const char* value = std::getenv(name);
    return value != nullptr && *value != '\0' ? std::atoi(value) : fallback;
  };
  const int local_rank = from_env("OMPI_COMM_WORLD_LOCAL_RANK", mpi->rank());
  const int local_size = from_env("OMPI_COMM_WORLD_LOCAL_SIZE", mpi->world_size());
  const int gpus = cuda_device_count();
  Status usable;
  if (gpus == 0) {
    usable = Status::runtime_error("rank " + std::to_string(mpi->rank()) + " sees no CUDA device");
  } else if (local_size > gpus) {
    // NCCL refuses two ranks on one GPU; say so before it does.
    usable = Status::value_error(std::to_string(local_size) + " ranks on this host but " + std::to_string(gpus) +
                                 " GPUs: --comm mpi --device cuda needs one GPU per rank (use -np <= " +
                                 std::to_string(gpus) + ", or --comm inprocess to share one GPU)");
  }
  // Every rank learns whether any rank lacks a GPU before NCCL would wait for it.
  DETDIT_RETURN_IF_ERROR(mpi->agree(usable));
  *device = Device::cuda(local_rank % gpus);
#ifdef DETDIT_WITH_CUDA
  cudaSetDevice(device->index);
#endif
  // NVLink multicast (NVLS) stays off on the GPU machines: NCCL reads this
  // variable in ncclCommInitRank. A value the user set wins.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  return create_nccl_communicator_mpi(*device, comm, options);
}

}  // namespace

int open_run(const Args& args, const NcclOptions& nccl, Device* device, std::unique_ptr<Communicator>* world) {
  const std::string comm = args.get("--comm", "inprocess"), name = args.get("--device");
  const int gpus = cuda_device_count();
  const std::string chosen = name.empty() ? (gpus > 0 ? "cuda" : "cpu") : name;
  std::string error;
  if (comm != "inprocess" && comm != "mpi") {
    error = "--comm must be inprocess or mpi, got '" + comm + "'";
  } else if (chosen != "cpu" && chosen != "cuda") {
    error = "--device must be cpu or cuda, got '" + chosen + "'";
  } else if (chosen == "cuda" && gpus == 0) {
#ifdef DETDIT_WITH_CUDA
    error = "--device cuda: no usable CUDA device on this machine";
#else
    error = "--device cuda: this detdit was built without CUDA (no nvcc at configure time)";
#endif
  } else if (comm == "mpi") {
    // This process is one rank; its device is GPU local rank % count.
    const Status opened = open_mpi_world(chosen == "cuda", world, device, nccl);
    if (!opened.ok()) error = "--comm mpi: " + opened.to_string();
  } else {
    *device = chosen == "cuda" ? Device::cuda(0) : Device::cpu();
  }
  return error.empty() ? -1 : fail(error);
}

int agree_on_command_line(int argc, char** argv) {
  if (!launched_by_mpi()) return -1;
  std::unique_ptr<Communicator> mpi;
  if (!create_mpi_communicator(&mpi).ok()) return -1;  // no MPI: no collective can wait either
  // The arguments NUL-separated, compared whole: their lengths first, then the
  // lines padded with NULs past the longest to a multiple of 4 bytes (what
  // gather_host_bytes moves; at least 4, also for an empty line).
  std::string line;
  for (int i = 1; i < argc; ++i) line.append(argv[i], std::strlen(argv[i]) + 1);
  const uint64_t length = line.size();
  const int world = mpi->world_size();
  std::vector<uint64_t> lengths(static_cast<std::size_t>(world));
  std::vector<char> all;
  Status status = gather_host_bytes(*mpi, &length, sizeof length, &all);
  if (status.ok()) {
    std::memcpy(lengths.data(), all.data(), all.size());
    line.resize((*std::max_element(lengths.begin(), lengths.end()) / 4 + 1) * 4, '\0');
    status = gather_host_bytes(*mpi, line.data(), line.size(), &all);
  }
  for (int r = 1; status.ok() && r < world; ++r) {
    if (lengths[r] != lengths[0] || std::memcmp(all.data() + r * line.size(), all.data(), line.size()) != 0)
      status = Status::value_error("rank " + std::to_string(r) + " was started with another command line than rank 0; "
                                   "under mpirun every rank must run the same detdit command with the same options");
  }
  if (status.ok()) return -1;
  std::fprintf(stderr, "detdit: rank %d of %d: %s\n", mpi->rank(), mpi->world_size(), status.to_string().c_str());
  return 2;
}

namespace {
// One rank's weights as the ranks exchange them: the digest in hex and the
// absolute path, NUL-padded (a longer path is cut: it only names the file).
struct WeightsRecord {
  char sha256[64];
  char path[448];
};
static_assert(sizeof(WeightsRecord) % 4 == 0, "gather_host_bytes moves multiples of 4 bytes");

std::string record_text(const char* field, std::size_t size) { return std::string(field, strnlen(field, size)); }

// Every rank's weights the same bytes (resolve_run_weights), compared by digest.
Status agree_on_weights(Communicator& comm, const io::Weights& weights) {
  WeightsRecord mine{};
  Status local = Status::ok_status();
  // The whole file, header included: the same bytes in, the same results out.
  try {
    const std::string digest = io::sha256_hex(weights.file.file_bytes(), weights.file.file_size());
    std::memcpy(mine.sha256, digest.data(), std::min(digest.size(), sizeof mine.sha256));
  } catch (const std::runtime_error& e) {
    local = Status::runtime_error(std::string("SHA-256 of the weights: ") + e.what());
  }
  char resolved[PATH_MAX];
  const std::string path = realpath(weights.path.c_str(), resolved) != nullptr ? resolved : weights.path;
  std::memcpy(mine.path, path.data(), std::min(path.size(), sizeof mine.path - 1));
  // A rank whose own digest failed says why; rank 0 reports the rest.
  if (!local.ok() && comm.rank() != 0) std::fprintf(stderr, "detdit: rank %d: %s\n", comm.rank(), local.to_string().c_str());
  DETDIT_RETURN_IF_ERROR(all_ranks_ok(comm, local));
  std::vector<char> all;
  DETDIT_RETURN_IF_ERROR(gather_host_bytes(comm, &mine, sizeof mine, &all));
  const auto* records = reinterpret_cast<const WeightsRecord*>(all.data());
  auto describe = [&](int r) {
    return "rank " + std::to_string(r) + " loaded " + record_text(records[r].path, sizeof records[r].path) +
           " (SHA-256 " + record_text(records[r].sha256, sizeof records[r].sha256) + ")";
  };
  std::string differ;
  for (int r = 1; r < comm.world_size(); ++r)
    if (std::memcmp(records[r].sha256, records[0].sha256, sizeof records[0].sha256) != 0)
      differ += (differ.empty() ? "" : ", ") + describe(r);
  if (differ.empty()) return Status::ok_status();
  return Status::value_error("the ranks loaded different weights: " + describe(0) + ", but " + differ +
                             "; under mpirun every rank must load the same weights (--weights resolves on each "
                             "rank, relative to its working directory)");
}

}  // namespace

Status resolve_run_weights(Communicator* world, const std::vector<std::string>& destinations,
                           const std::string& option, const io::ManifestConfig& config, uint64_t seed,
                           io::Weights* weights) {
  const bool leader = world == nullptr || world->rank() == 0;
  Status status;
  for (const std::string& path : destinations)
    if (leader && status.ok()) status = io::check_replaceable(path);
  if (leader && status.ok()) status = io::resolve_weights(option, config, seed, /*announce=*/true, weights);
  if (world == nullptr) return status;
  status = all_ranks_ok(*world, status);
  if (status.ok() && !leader) {
    status = io::resolve_weights(option, config, seed, false, weights);
    if (!status.ok()) std::fprintf(stderr, "detdit: rank %d: %s\n", world->rank(), status.to_string().c_str());
  }
  status = all_ranks_ok(*world, status);
  // The same text may name other files on other ranks: compare the bytes.
  return status.ok() ? agree_on_weights(*world, *weights) : status;
}

Status all_ranks_ok(Communicator& comm, const Status& local) {
  const int32_t failed = local.ok() ? 0 : 1;
  std::vector<char> all;
  DETDIT_RETURN_IF_ERROR(gather_host_bytes(comm, &failed, sizeof failed, &all));
  if (!local.ok()) return local;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (reinterpret_cast<const int32_t*>(all.data())[r] != 0) {
      return Status::runtime_error("rank " + std::to_string(r) + " failed (its own output says why)");
    }
  }
  return Status::ok_status();
}

cases::CaseContext case_context(const io::Weights& weights, bool quick, uint64_t seed) {
  cases::CaseContext ctx;
  ctx.hidden = weights.config.hidden;
  ctx.time_embed_dim = weights.config.time_embed_dim;
  ctx.time_embed_hidden = weights.config.time_embed_hidden;
  ctx.freq_dim = weights.config.freq_dim;
  ctx.model = weights.config.model;
  ctx.pooled_dim = weights.config.pooled_dim;
  ctx.out_dim = weights.config.out_dim;
  const io::Weights* w = &weights;
  ctx.weight = [w](const std::string& name, TensorView* view) { return w->view(name, view); };
  ctx.quick = quick;
  ctx.seed = seed;
  return ctx;
}

}  // namespace cli
}  // namespace detdit
