// The MPI communicator: CPU ranks as processes. Payloads move with
// MPI_Allgather and MPI_Bcast of MPI_BYTE (copies; MPI never reduces here).
// Every call first all-gathers the 32-byte CallHeader and checks it on every
// rank.
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "common/out_of_memory.h"
#include "detdit/comm.h"
#include "parallel/call_check.h"

#if defined(DETDIT_WITH_MPI)
#include <mpi.h>
#endif

namespace detdit {

bool launched_by_mpi() {
  // Open MPI, MPICH/Hydra and Slurm's PMI set these in every launched process.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::atoi(value) > 1) return true;
  }
  return false;
}

#if defined(DETDIT_WITH_MPI)

using comm_detail::AgreeRecord;
using comm_detail::CallHeader;
using comm_detail::CallOp;

namespace {

Status mpi_error(const char* what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return Status::runtime_error(std::string(what) + " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

class MpiCommunicator final : public Communicator {
 public:
  // The gathered headers and records are allocated here, once: a call
  // allocates nothing, so none can fail on one rank while its peers wait.
  MpiCommunicator(MPI_Comm comm, int rank, int world)
      : comm_(comm), rank_(rank), world_(world), headers_(static_cast<std::size_t>(world)),
        records_(static_cast<std::size_t>(world)) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Device device() const override { return Device::cpu(); }
  const char* backend_id() const override { return "mpi"; }
  using Communicator::agree;

  Status all_gather(const void* send, std::size_t bytes, void* recv, DType dtype, Stream) override {
    Status local = comm_detail::check_local_all_gather(send, bytes, recv, dtype, world_);
    // MPI counts are int: larger payloads are a clear error on every rank (all
    // ranks see the same bytes once the headers agree).
    if (local.ok() && bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      local = Status::value_error("the MPI all_gather moves at most 2^31 - 1 bytes per rank, got " +
                                  std::to_string(bytes));
    CallHeader mine = comm_detail::make_header(sequence_++, CallOp::kAllGather, bytes, dtype, !local.ok());
    DETDIT_RETURN_IF_ERROR(gather_bytes(&mine, sizeof(CallHeader), headers_.data()));
    DETDIT_RETURN_IF_ERROR(comm_detail::check_call_headers(headers_.data(), world_, local));
    if (bytes == 0) return Status();
    return gather_bytes(send, bytes, recv);
  }

  Status broadcast(void* buffer, std::size_t bytes, int root, DType dtype, Stream) override {
    Status local = comm_detail::check_local_broadcast(buffer, bytes, root, dtype, world_);
    if (local.ok() && bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      local = Status::value_error("the MPI broadcast moves at most 2^31 - 1 bytes, got " + std::to_string(bytes));
    CallHeader mine = comm_detail::make_header(sequence_++, CallOp::kBroadcast, bytes, dtype, !local.ok(), root);
    DETDIT_RETURN_IF_ERROR(gather_bytes(&mine, sizeof(CallHeader), headers_.data()));
    DETDIT_RETURN_IF_ERROR(comm_detail::check_call_headers(headers_.data(), world_, local));
    if (bytes == 0) return Status();
    int code = MPI_Bcast(buffer, static_cast<int>(bytes), MPI_BYTE, root, comm_);
    if (code != MPI_SUCCESS) return mpi_error("MPI_Bcast", code);
    return Status();
  }

  Status agree(const Status& local, const std::string& signature) override {
    CallHeader mine = comm_detail::make_header(sequence_++, CallOp::kAgree, 0, DType::kI32, false);
    DETDIT_RETURN_IF_ERROR(gather_bytes(&mine, sizeof(CallHeader), headers_.data()));
    DETDIT_RETURN_IF_ERROR(comm_detail::check_call_headers(headers_.data(), world_, Status()));
    AgreeRecord record = comm_detail::make_record(local, signature);
    DETDIT_RETURN_IF_ERROR(gather_bytes(&record, sizeof(AgreeRecord), records_.data()));
    return comm_detail::resolve_agreement(records_.data(), world_, local, signature);
  }

 private:
  Status gather_bytes(const void* send, std::size_t bytes, void* recv) {
    const int count = static_cast<int>(bytes);
    int code = MPI_Allgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_);
    if (code != MPI_SUCCESS) return mpi_error("MPI_Allgather", code);
    return Status();
  }

  MPI_Comm comm_;
  int rank_, world_;
  std::vector<CallHeader> headers_;
  std::vector<AgreeRecord> records_;
  uint64_t sequence_ = 0;
};

}  // namespace

Status create_mpi_communicator(std::unique_ptr<Communicator>* comm, const void* mpi_comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (code != MPI_SUCCESS) return mpi_error("MPI_Init_thread", code);
    std::atexit(finalize_at_exit);
  }
  MPI_Comm handle = mpi_comm ? *static_cast<const MPI_Comm*>(mpi_comm) : MPI_COMM_WORLD;
  // Errors come back as codes (turned into RuntimeErrors), never an abort.
  MPI_Comm_set_errhandler(handle, MPI_ERRORS_RETURN);
  int rank = 0, world = 0;
  int code = MPI_Comm_rank(handle, &rank);
  if (code != MPI_SUCCESS) return mpi_error("MPI_Comm_rank", code);
  code = MPI_Comm_size(handle, &world);
  if (code != MPI_SUCCESS) return mpi_error("MPI_Comm_size", code);
  return out_of_memory_is_an_error(
      [&] { return "out of memory creating the MPI communicator of " + std::to_string(world) + " ranks"; },
      [&] {
        *comm = std::make_unique<MpiCommunicator>(handle, rank, world);
        return Status();
      });
}

#else

Status create_mpi_communicator(std::unique_ptr<Communicator>*, const void*) {
  return Status::runtime_error(
      "this detdit was built without MPI (no MPI found at configure time); install libopenmpi-dev and rebuild");
}

#endif

}  // namespace detdit
