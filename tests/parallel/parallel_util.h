// Helpers of the parallel tests: per-rank results collected on the test
// thread, and the launcher of the MPI variants (the test binary re-runs itself
// under mpirun with a filter naming a DISABLED_ worker test).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "support/test_util.h"
#include "detdit/comm.h"
#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace testing {

// Tensors of one rank on `device` (the CPU or a CUDA device), so a rank's code
// is the same for both: upload copies a host tensor there, empty_like makes
// an output filled with a canary byte, download copies back (synchronising
// `stream`). Memory is freed with the arena.
class DeviceArena {
 public:
  DeviceArena(Device device, Stream stream) : device_(device), stream_(stream) {}
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  TensorView upload(const HostTensor& t);
  TensorView empty_like(const HostTensor& t, uint8_t fill);
  TensorView empty(DType dtype, std::vector<int64_t> shape, uint8_t fill);
  HostTensor download(const TensorView& v);

 private:
  TensorView allocate(DType dtype, const std::vector<int64_t>& shape);
  Device device_;
  Stream stream_;
  std::vector<HostTensor> host_;
  std::vector<void*> device_memory_;
};

// A world-size-one NCCL communicator on cuda:0 (the WS1-over-NCCL tests).
Status one_rank_nccl_communicator(std::unique_ptr<Communicator>* comm, NcclOptions options = {});

// Runs `op` (work on `stream`, a stream of its own) as a CUDA graph: captured
// in global mode, so any host synchronisation, legacy-stream work or other
// capture-unsafe call inside it fails the capture, then replayed twice (the
// second replay must leave the same bytes). A RuntimeError names what failed.
Status replayed_as_cuda_graph(Stream stream, const std::function<Status()>& op);
// `op` itself, or `op` through replayed_as_cuda_graph when `captured`.
inline Status maybe_captured(bool captured, Stream stream, const std::function<Status()>& op) {
  return captured ? replayed_as_cuda_graph(stream, op) : op();
}

// Number of CUDA devices (0 without CUDA), and make `index` current on this thread.
int cuda_device_count();
void set_cuda_device(int index);

// Collective validation: runs `call` on `world` in-process CPU ranks; `call`
// returns the rank's status and sets *untouched when the rank's outputs still
// hold their canary. Every rank must fail with `kind` and a message
// containing `needle`, and no rank may write an output.
void expect_every_rank_refused(int world, ErrorKind kind, const std::string& needle,
                               const std::function<Status(Communicator& comm, bool* untouched)>& call);

// Runs `worker_test` (e.g. "DISABLED_MpiWorker.AllGather") of this binary on
// `ranks` MPI processes under `timeout -k 5 timeout_s` and returns the exit
// code of the whole run (124 or 137: killed at the timeout; -1: no exit code),
// with the command line and every rank's stdout and stderr in *output.
int launch_under_mpi(int ranks, const std::string& worker_test, int timeout_s, std::string* output);

// Runs `worker_test` (e.g. "DISABLED_MpiWorker.AllGather") of this binary on
// `ranks` MPI processes and succeeds only if mpirun exits 0 and every rank
// reports that exactly one test passed. The output is attached on failure.
// A run past timeout_s is killed and fails (a hung rank is a failure).
::testing::AssertionResult run_under_mpi(int ranks, const std::string& worker_test, int timeout_s = 300);

}  // namespace testing
}  // namespace detdit
