// The NCCL communicator: GPU ranks. Payloads move with ncclAllGather and
// ncclBroadcast of ncclUint8 (copies; NCCL's reductions are never called). With
// NcclOptions::check_calls the 32-byte CallHeader is all-gathered first and
// read on the host (one stream synchronisation per call) so that mismatched
// calls fail on every rank instead of hanging or corrupting.
#include <cstring>
#include <string>
#include <vector>

#include "common/out_of_memory.h"
#include "detdit/comm.h"
#include "parallel/call_check.h"

#if defined(DETDIT_WITH_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif
#if defined(DETDIT_WITH_NCCL) && defined(DETDIT_WITH_MPI)
#include <mpi.h>
#endif

namespace detdit {

#if defined(DETDIT_WITH_NCCL)

using comm_detail::AgreeRecord;
using comm_detail::CallHeader;
using comm_detail::CallOp;

namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "NcclUniqueId must hold an ncclUniqueId");

Status nccl_error(const char* what, ncclResult_t code) {
  return Status::runtime_error(std::string(what) + " failed: " + ncclGetErrorString(code));
}
Status cuda_error(const char* what, cudaError_t code) {
  return Status::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(code));
}
#define DETDIT_NCCL_TRY(call)                                        \
  do {                                                               \
    ncclResult_t code_ = (call);                                     \
    if (code_ != ncclSuccess) return nccl_error(#call, code_);       \
  } while (0)
#define DETDIT_CUDA_TRY(call)                                        \
  do {                                                               \
    cudaError_t code_ = (call);                                      \
    if (code_ != cudaSuccess) return cuda_error(#call, code_);       \
  } while (0)

// Bytes of one check exchange: the larger of a header and an agree record.
constexpr std::size_t kCheckBytes = sizeof(AgreeRecord);

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, bool owned, int rank, int world, Device device, NcclOptions options)
      : comm_(comm), owned_(owned), rank_(rank), world_(world), device_(device), options_(options) {}
  ~NcclCommunicator() override {
    if (device_check_) cudaFree(device_check_);
    if (host_check_) cudaFreeHost(host_check_);
    if (owned_) ncclCommDestroy(comm_);
  }

  Status init() {
    DETDIT_CUDA_TRY(cudaSetDevice(device_.index));
    // [own record | world records], on the device and pinned on the host.
    const std::size_t total = kCheckBytes * static_cast<std::size_t>(world_ + 1);
    DETDIT_CUDA_TRY(cudaMalloc(&device_check_, total));
    DETDIT_CUDA_TRY(cudaMallocHost(&host_check_, total));
    return Status();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Device device() const override { return device_; }
  const char* backend_id() const override { return "nccl"; }
  using Communicator::agree;

  Status all_gather(const void* send, std::size_t bytes, void* recv, DType dtype, Stream stream) override {
    DETDIT_CUDA_TRY(cudaSetDevice(device_.index));
    const Status local = comm_detail::check_local_all_gather(send, bytes, recv, dtype, world_);
    DETDIT_RETURN_IF_ERROR(check_call(
        comm_detail::make_header(sequence_++, CallOp::kAllGather, bytes, dtype, !local.ok()), local, stream));
    if (bytes == 0) return Status();
    DETDIT_NCCL_TRY(ncclAllGather(send, recv, bytes, ncclUint8, comm_, static_cast<cudaStream_t>(stream)));
    return Status();
  }

  Status broadcast(void* buffer, std::size_t bytes, int root, DType dtype, Stream stream) override {
    DETDIT_CUDA_TRY(cudaSetDevice(device_.index));
    const Status local = comm_detail::check_local_broadcast(buffer, bytes, root, dtype, world_);
    DETDIT_RETURN_IF_ERROR(check_call(
        comm_detail::make_header(sequence_++, CallOp::kBroadcast, bytes, dtype, !local.ok(), root), local, stream));
    if (bytes == 0) return Status();
    // In place: the root's buffer is the source, every other rank's the destination.
    DETDIT_NCCL_TRY(ncclBroadcast(buffer, buffer, bytes, ncclUint8, root, comm_, static_cast<cudaStream_t>(stream)));
    return Status();
  }

  Status agree(const Status& local, const std::string& signature) override {
    if (!options_.check_calls) return local;
    DETDIT_CUDA_TRY(cudaSetDevice(device_.index));
    CallHeader mine = comm_detail::make_header(sequence_++, CallOp::kAgree, 0, DType::kI32, false);
    const char* gathered = nullptr;
    DETDIT_RETURN_IF_ERROR(exchange(&mine, sizeof(CallHeader), nullptr, &gathered));
    DETDIT_RETURN_IF_ERROR(
        comm_detail::check_call_headers(reinterpret_cast<const CallHeader*>(gathered), world_, Status()));
    AgreeRecord record = comm_detail::make_record(local, signature);
    DETDIT_RETURN_IF_ERROR(exchange(&record, sizeof(AgreeRecord), nullptr, &gathered));
    return comm_detail::resolve_agreement(reinterpret_cast<const AgreeRecord*>(gathered), world_, local, signature);
  }

 private:
  // All-gathers `bytes` (<= kCheckBytes) host bytes through the device and
  // reads the result on the host (synchronises `stream`). *gathered points at
  // the world records in the pinned buffer, valid until the next exchange: a
  // call allocates nothing, so none can fail on one rank while its peers wait.
  // The call check of every collective (comm.h): with check_calls the
  // headers are exchanged and compared on every rank, else only this rank's
  // own arguments count.
  Status check_call(const CallHeader& mine, const Status& local, Stream stream) {
    if (!options_.check_calls) return local;
    const char* gathered = nullptr;
    DETDIT_RETURN_IF_ERROR(exchange(&mine, sizeof(CallHeader), stream, &gathered));
    return comm_detail::check_call_headers(reinterpret_cast<const CallHeader*>(gathered), world_, local);
  }

  Status exchange(const void* host_send, std::size_t bytes, Stream stream, const char** gathered) {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    char* host = static_cast<char*>(host_check_);
    char* device = static_cast<char*>(device_check_);
    std::memcpy(host, host_send, bytes);
    DETDIT_CUDA_TRY(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, s));
    DETDIT_NCCL_TRY(ncclAllGather(device, device + kCheckBytes, bytes, ncclUint8, comm_, s));
    DETDIT_CUDA_TRY(cudaMemcpyAsync(host + kCheckBytes, device + kCheckBytes, bytes * world_,
                                    cudaMemcpyDeviceToHost, s));
    DETDIT_CUDA_TRY(cudaStreamSynchronize(s));
    *gathered = host + kCheckBytes;
    return Status();
  }

  ncclComm_t comm_;
  bool owned_;
  int rank_, world_;
  Device device_;
  NcclOptions options_;
  uint64_t sequence_ = 0;
  void* device_check_ = nullptr;
  void* host_check_ = nullptr;
};

Status check_device(const Device& device) {
  if (!device.is_cuda())
    return Status::value_error("a NCCL communicator needs a CUDA device, got " + device.to_string());
  return Status();
}

// The communicator of a NCCL handle (destroyed with it when `owned`, also
// when this fails).
Status wrap(ncclComm_t handle, bool owned, int rank, int world, const Device& device, const NcclOptions& options,
            std::unique_ptr<Communicator>* comm) {
  std::unique_ptr<NcclCommunicator> made;
  const Status created = out_of_memory_is_an_error(
      [&] { return "out of memory creating the NCCL communicator of rank " + std::to_string(rank); },
      [&] {
        made = std::make_unique<NcclCommunicator>(handle, owned, rank, world, device, options);
        return Status();
      });
  if (!created.ok()) {
    if (owned) ncclCommDestroy(handle);
    return created;
  }
  DETDIT_RETURN_IF_ERROR(made->init());
  *comm = std::move(made);
  return Status();
}

}  // namespace

Status nccl_unique_id(NcclUniqueId* id) {
  ncclUniqueId raw;
  DETDIT_NCCL_TRY(ncclGetUniqueId(&raw));
  std::memcpy(id->bytes, &raw, sizeof(raw));
  return Status();
}

Status create_nccl_communicator(void* nccl_comm, Device device, std::unique_ptr<Communicator>* comm,
                                NcclOptions options) {
  DETDIT_RETURN_IF_ERROR(check_device(device));
  if (nccl_comm == nullptr) return Status::value_error("nccl_comm is required, got nullptr");
  ncclComm_t handle = static_cast<ncclComm_t>(nccl_comm);
  int rank = 0, world = 0;
  DETDIT_NCCL_TRY(ncclCommUserRank(handle, &rank));
  DETDIT_NCCL_TRY(ncclCommCount(handle, &world));
  return wrap(handle, false, rank, world, device, options, comm);
}

Status create_nccl_communicator_from_id(const NcclUniqueId& id, int world, int rank, Device device,
                                        std::unique_ptr<Communicator>* comm, NcclOptions options) {
  DETDIT_RETURN_IF_ERROR(check_device(device));
  if (world < 1 || rank < 0 || rank >= world)
    return Status::value_error("need 0 <= rank < world, got rank=" + std::to_string(rank) +
                               ", world=" + std::to_string(world));
  DETDIT_CUDA_TRY(cudaSetDevice(device.index));
  ncclUniqueId raw;
  std::memcpy(&raw, id.bytes, sizeof(raw));
  ncclComm_t handle = nullptr;
  DETDIT_NCCL_TRY(ncclCommInitRank(&handle, world, raw, rank));
  return wrap(handle, true, rank, world, device, options, comm);
}

#if defined(DETDIT_WITH_MPI)
Status create_nccl_communicator_mpi(Device device, std::unique_ptr<Communicator>* comm, NcclOptions options) {
  // The MPI communicator initialises MPI and gives rank and world.
  std::unique_ptr<Communicator> mpi;
  DETDIT_RETURN_IF_ERROR(create_mpi_communicator(&mpi));
  NcclUniqueId id{};
  // Broadcast = rank-ordered all-gather, keep rank 0's block; its buffer
  // before the agreement, which covers a failed allocation too.
  std::vector<char> all;
  Status made = out_of_memory_is_an_error([] { return std::string("out of memory receiving the NCCL unique id"); },
                                          [&] {
                                            all.resize(kNcclUniqueIdBytes * static_cast<std::size_t>(mpi->world_size()));
                                            return Status();
                                          });
  if (made.ok() && mpi->rank() == 0) made = nccl_unique_id(&id);
  DETDIT_RETURN_IF_ERROR(mpi->agree(made));
  DETDIT_RETURN_IF_ERROR(mpi->all_gather(id.bytes, kNcclUniqueIdBytes, all.data(), DType::kI32, nullptr));
  std::memcpy(id.bytes, all.data(), kNcclUniqueIdBytes);
  return create_nccl_communicator_from_id(id, mpi->world_size(), mpi->rank(), device, comm, options);
}
#else
Status create_nccl_communicator_mpi(Device, std::unique_ptr<Communicator>*, NcclOptions) {
  return Status::runtime_error("this detdit was built without MPI, which bootstraps multi-process NCCL; "
                               "use create_nccl_communicator_from_id and distribute the id yourself");
}
#endif

#else  // !DETDIT_WITH_NCCL

namespace {
Status no_nccl() {
  return Status::runtime_error(
      "this detdit was built without NCCL (needs CUDA and nccl.h/libnccl at configure time); rebuild with NCCL");
}
}  // namespace

Status nccl_unique_id(NcclUniqueId*) { return no_nccl(); }
Status create_nccl_communicator(void*, Device, std::unique_ptr<Communicator>*, NcclOptions) { return no_nccl(); }
Status create_nccl_communicator_from_id(const NcclUniqueId&, int, int, Device, std::unique_ptr<Communicator>*,
                                        NcclOptions) {
  return no_nccl();
}
Status create_nccl_communicator_mpi(Device, std::unique_ptr<Communicator>*, NcclOptions) { return no_nccl(); }

#endif

}  // namespace detdit
