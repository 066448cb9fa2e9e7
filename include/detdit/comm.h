// detdit/comm.h: the communicator of the parallel ops (tp_adaln_projection,
// the sp_region).
//
// A Communicator connects `world_size()` ranks. Its two data collectives are
// byte copies: a rank-ordered all-gather (after all_gather, on every rank,
// recv[r*bytes, (r+1)*bytes) holds rank r's send[0, bytes)) and a broadcast
// (after broadcast, every rank's buffer[0, bytes) holds the root's). No
// collective ever does arithmetic (no reductions anywhere), so the bits of
// every parallel result are decided by detdit's kernels alone.
//
// Every call is checked across ranks: before the payload moves, the ranks
// exchange a small fixed-size header {call sequence number, op, bytes, dtype,
// root}. If any two ranks disagree (different ops, sizes, dtypes or roots, or
// one rank skipped a call) every rank returns the same ValueError naming both
// calls; nothing is
// copied, nothing hangs. agree(local) is the validation handshake of the ops:
// every rank learns whether any rank's local validation failed (and that
// rank's message), so an op fails on every rank before its first data
// collective instead of leaving the others waiting.
//
// Implementations:
//   in-process: N ranks as threads of one process (InProcessGroup below), on
//     the CPU or sharing one CUDA device (each rank its own stream; copies are
//     stream-ordered device-to-device copies, no host synchronisation);
//   MPI: CPU ranks as processes (create_mpi_communicator), and the bootstrap of
//     multi-process NCCL runs (create_nccl_communicator_mpi);
//   NCCL: GPU ranks (ncclAllGather and ncclBroadcast of bytes only), from a caller's ncclComm_t or
//     from a unique id.
// A build without MPI or NCCL returns a RuntimeError from their factories.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Where send and recv buffers live: cpu, or the CUDA device of this rank.
  virtual Device device() const = 0;
  // "in_process", "mpi" or "nccl".
  virtual const char* backend_id() const = 0;

  // Rank-ordered all-gather of `bytes` bytes per rank: recv (world_size() *
  // bytes) gets rank r's send at offset r*bytes. `dtype` describes the
  // elements (bytes must be a multiple of its size) and is checked across
  // ranks. send and recv must not overlap. On a CUDA communicator the copy is
  // ordered on `stream` (the host is not synchronised, except by the NCCL
  // communicator's call check, see NcclOptions).
  virtual Status all_gather(const void* send, std::size_t bytes, void* recv, DType dtype, Stream stream) = 0;

  // Broadcast of `bytes` bytes from rank `root` (0 <= root < world_size()):
  // afterwards buffer[0, bytes) on every rank holds the root's buffer[0,
  // bytes); the root's buffer is only read. bytes, dtype and root are checked
  // across ranks like all_gather's; ordered on `stream` the same way.
  virtual Status broadcast(void* buffer, std::size_t bytes, int root, DType dtype, Stream stream) = 0;

  // Collective validation handshake: returns `local` on a rank whose local
  // validation failed, and on every other rank an error of the same kind that
  // names the first failing rank and quotes its message. Then, if the ranks'
  // `signature`s (a description of what decides the call's collectives and
  // its replicated results; only its 64-bit hash is exchanged) differ, a
  // ValueError on every rank. OK only if every rank passed `local` OK with the
  // same signature.
  virtual Status agree(const Status& local, const std::string& signature) = 0;
  Status agree(const Status& local) { return agree(local, std::string()); }
};

// N ranks as threads of one process: a shared group with a barrier. Each rank
// uses its own Communicator from one thread. If a rank leaves the group (its
// communicator is destroyed, e.g. its thread returned early) while others wait
// in a collective, they get a RuntimeError instead of hanging.
class InProcessGroup {
 public:
  // world >= 1 ranks whose buffers live on `device` (cpu, or one CUDA device
  // shared by all ranks).
  static Status create(int world, Device device, std::shared_ptr<InProcessGroup>* group);
  // The communicator of `rank`, at most one per rank.
  Status communicator(int rank, std::unique_ptr<Communicator>* comm);
  // Runs fn(comm) for every rank on its own thread and joins them all. Returns
  // OK if every rank returned OK, else the lowest failing rank's kind with the
  // messages of every failing rank ("rank 0: ...; rank 2: ..."). An exception
  // escaping fn is a failure of that rank (RuntimeError quoting what()).
  static Status run(int world, const std::function<Status(Communicator&)>& fn, Device device = Device::cpu());

  struct State;
  explicit InProcessGroup(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// MPI: this process is rank MPI_Comm_rank of `mpi_comm` (a pointer to an
// MPI_Comm; nullptr = MPI_COMM_WORLD). CPU buffers only. MPI is initialised
// here if the caller has not done so (with MPI_THREAD_SERIALIZED, a
// RuntimeError if MPI provides less; then finalised at exit). Creating is a
// collective on `mpi_comm`: the communicator works on a private MPI_Comm_dup
// of it, so its calls never meet the caller's own MPI calls or another
// communicator's, and the caller may free `mpi_comm` once this returns.
// Destroying the communicator does not wait for the peers: it posts this
// rank's leave and frees the duplicate (MPI completes both later), and
// MPI_Finalize leaves every MPI communicator still alive and waits for all
// leaves. A peer waiting in a call that this rank skipped gets a RuntimeError
// naming this rank, as does every later call there, and this rank prints that
// error on stderr when MPI finalises (docs/parallel.md).
// Threads: a communicator is used, and destroyed, by one thread at a time,
// any thread. With MPI initialised here, or by the caller at
// MPI_THREAD_SERIALIZED, no two MPI calls of the process may overlap: a
// communicator's call or destruction must not run while another thread is in
// another communicator's or in the caller's own MPI call. A caller's
// MPI_THREAD_MULTIPLE lifts that; its MPI_THREAD_FUNNELED or
// MPI_THREAD_SINGLE restricts every call and destruction to the main thread.
Status create_mpi_communicator(std::unique_ptr<Communicator>* comm, const void* mpi_comm = nullptr);
// True when this process was started by mpirun/mpiexec with more than one
// rank (from the launcher's environment; does not initialise MPI).
bool launched_by_mpi();

// NCCL (GPU). The call check (the header exchange that detects mismatched
// calls) reads the exchanged headers on the host, which synchronises the
// stream; check_calls = false skips it (no host synchronisation at all, and
// mismatched calls are then the caller's responsibility, as with raw NCCL).
struct NcclOptions {
  bool check_calls = true;
};
constexpr std::size_t kNcclUniqueIdBytes = 128;
struct NcclUniqueId {
  char bytes[kNcclUniqueIdBytes];
};
// A fresh unique id (on one rank; distribute it to the others).
Status nccl_unique_id(NcclUniqueId* id);
// Wraps a caller's ncclComm_t (passed as void*; not destroyed by detdit).
Status create_nccl_communicator(void* nccl_comm, Device device, std::unique_ptr<Communicator>* comm,
                                NcclOptions options = {});
// Creates (and owns) a NCCL communicator of `world` ranks from a unique id.
Status create_nccl_communicator_from_id(const NcclUniqueId& id, int world, int rank, Device device,
                                        std::unique_ptr<Communicator>* comm, NcclOptions options = {});
// Multi-process bootstrap: rank 0 of MPI_COMM_WORLD creates the unique id and
// broadcasts it over MPI; every process gets rank = its MPI rank.
Status create_nccl_communicator_mpi(Device device, std::unique_ptr<Communicator>* comm, NcclOptions options = {});

}  // namespace detdit
