// The MPI communicator: CPU ranks as processes, on a private MPI_Comm_dup of
// the caller's MPI_Comm (so its collectives never match another detdit
// communicator's or the caller's own). Payloads move with MPI_Allgather and
// MPI_Bcast of MPI_BYTE (copies; MPI never reduces here). Every call first
// all-gathers the 32-byte CallHeader with MPI_Iallgather + MPI_Wait and checks
// it on every rank.
//
// Leaving is the communicator's last collective: its destructor, or MPI
// finalisation (the library's at exit, or the caller's) for every
// communicator still alive, posts one kLeave header with MPI_Iallgather and
// does not wait (the destructor then frees the duplicate; MPI frees it once
// the leave completes). A non-blocking collective matches only the peers'
// header exchanges, which are non-blocking too, never a blocking payload
// collective. A peer waiting in a call (the rank that left skipped it) gets a
// RuntimeError naming the rank that left, and so does every later call on
// that peer, without MPI traffic. MPI finalisation waits for every pending
// leave and the rank that left prints that verdict on stderr there; its
// MPI_Finalize completes once its peers, having stopped, finalise too. A
// process that ends without finalising (a crash, a signal) is the launcher's
// to end: Open MPI's mpirun aborts the job.
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
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

class MpiCommunicator;

// A leave posted and not yet waited for: MPI reads and writes its buffers
// until the request completes, so they live here, not in the communicator.
struct PendingLeave {
  MPI_Request request = MPI_REQUEST_NULL;
  CallHeader mine;
  std::vector<CallHeader> headers;  // one per rank
};

// The communicators alive in this process, in creation order, for the leave at
// MPI finalisation, and the leaves still pending. Never destroyed: a static
// communicator may outlive the other statics.
struct LiveCommunicators {
  std::mutex mutex;
  std::vector<MpiCommunicator*> comms;
  std::vector<std::unique_ptr<PendingLeave>> pending;
  bool leave_at_finalize = false;  // the MPI_COMM_SELF attribute is set
};
LiveCommunicators& live_communicators() {
  static LiveCommunicators* live = new LiveCommunicators;
  return *live;
}

class MpiCommunicator final : public Communicator {
 public:
  // The gathered headers and records are allocated here, once: a call
  // allocates nothing, so none can fail on one rank while its peers wait.
  MpiCommunicator(MPI_Comm comm, int rank, int world)
      : comm_(comm), rank_(rank), world_(world), headers_(static_cast<std::size_t>(world)),
        records_(static_cast<std::size_t>(world)) {
    LiveCommunicators& live = live_communicators();
    std::lock_guard<std::mutex> lock(live.mutex);
    live.comms.push_back(this);
  }

  // Destroying a communicator leaves it without waiting for the peers (see
  // the top of the file), and marks the duplicate for freeing, which MPI
  // defers until the leave completes. After MPI_Finalize the finalisation has
  // left it already and MPI has freed everything.
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    LiveCommunicators& live = live_communicators();
    std::lock_guard<std::mutex> lock(live.mutex);
    if (!finalized) {
      post_leave(&live);
      MPI_Comm_free(&comm_);
    }
    for (auto it = live.comms.begin(); it != live.comms.end(); ++it)
      if (*it == this) {
        live.comms.erase(it);
        break;
      }
  }

  // Posts this rank's last collective (see the top of the file) into
  // live->pending; once only, and not after a peer has left (the peers
  // finished with the communicator then). The caller holds live->mutex.
  void post_leave(LiveCommunicators* live) {
    if (!closed_.ok()) return;
    closed_ = Status::runtime_error("this rank has left the MPI communicator");
    // A record that cannot be allocated, or a leave MPI refuses, is reported
    // on stderr and not posted: a peer's call that would meet it waits, as
    // for a rank that never left.
    std::unique_ptr<PendingLeave> leave;
    auto what = [] { return std::string("out of memory leaving the MPI communicator"); };
    Status allocated = out_of_memory_is_an_error(what, [&] {
      leave = std::make_unique<PendingLeave>();
      leave->headers.resize(static_cast<std::size_t>(world_));
      live->pending.reserve(live->pending.size() + 1);
      return Status();
    });
    if (!allocated.ok()) {
      std::fprintf(stderr, "detdit: %s\n", allocated.message().c_str());
      return;
    }
    leave->mine = comm_detail::make_header(sequence_++, CallOp::kLeave, 0, DType::kI32, false);
    const int count = static_cast<int>(sizeof(CallHeader));
    int code = MPI_Iallgather(&leave->mine, count, MPI_BYTE, leave->headers.data(), count, MPI_BYTE, comm_,
                              &leave->request);
    if (code != MPI_SUCCESS) {
      std::fprintf(stderr, "detdit: %s\n", mpi_error("MPI_Iallgather of the leave", code).message().c_str());
      return;
    }
    live->pending.push_back(std::move(leave));
  }

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
    DETDIT_RETURN_IF_ERROR(exchange_headers(CallOp::kAllGather, bytes, dtype, local));
    if (bytes == 0) return Status();
    return gather_bytes(send, bytes, recv);
  }

  Status broadcast(void* buffer, std::size_t bytes, int root, DType dtype, Stream) override {
    Status local = comm_detail::check_local_broadcast(buffer, bytes, root, dtype, world_);
    if (local.ok() && bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      local = Status::value_error("the MPI broadcast moves at most 2^31 - 1 bytes, got " + std::to_string(bytes));
    DETDIT_RETURN_IF_ERROR(exchange_headers(CallOp::kBroadcast, bytes, dtype, local, root));
    if (bytes == 0) return Status();
    int code = MPI_Bcast(buffer, static_cast<int>(bytes), MPI_BYTE, root, comm_);
    if (code != MPI_SUCCESS) return mpi_error("MPI_Bcast", code);
    return Status();
  }

  Status agree(const Status& local, const std::string& signature) override {
    DETDIT_RETURN_IF_ERROR(exchange_headers(CallOp::kAgree, 0, DType::kI32, Status()));
    AgreeRecord record = comm_detail::make_record(local, signature);
    DETDIT_RETURN_IF_ERROR(gather_bytes(&record, sizeof(AgreeRecord), records_.data()));
    return comm_detail::resolve_agreement(records_.data(), world_, local, signature);
  }

 private:
  // Gathers this call's header and checks the gathered headers. Once a rank
  // has left, this call and every later one fail, the later ones at once.
  Status exchange_headers(CallOp op, std::size_t bytes, DType dtype, const Status& local, int root = 0) {
    if (!closed_.ok()) return closed_;
    CallHeader mine = comm_detail::make_header(sequence_++, op, bytes, dtype, !local.ok(), root);
    // Non-blocking, as the leave it may meet is (blocking and non-blocking
    // collectives never match each other).
    const int count = static_cast<int>(sizeof(CallHeader));
    MPI_Request request = MPI_REQUEST_NULL;
    int code = MPI_Iallgather(&mine, count, MPI_BYTE, headers_.data(), count, MPI_BYTE, comm_, &request);
    if (code == MPI_SUCCESS) code = MPI_Wait(&request, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return mpi_error("MPI_Iallgather", code);
    Status verdict = comm_detail::check_call_headers(headers_.data(), world_, local);
    if (comm_detail::any_rank_left(headers_.data(), world_)) closed_ = verdict;
    return verdict;
  }

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
  Status closed_;  // not ok once a rank (this one or a peer) has left
};

// MPI_Finalize deletes MPI_COMM_SELF's attributes first, while MPI still
// works: the communicators still alive leave there, the newest first, and
// every pending leave is waited for. A destructor or MPI_Finalize has no
// caller to return to: a rank that left while its peers called says so here,
// in the order it left.
int leave_at_finalize(MPI_Comm, int, void*, void*) {
  LiveCommunicators& live = live_communicators();
  std::lock_guard<std::mutex> lock(live.mutex);
  for (auto it = live.comms.rbegin(); it != live.comms.rend(); ++it) (*it)->post_leave(&live);
  // Every leave of this rank is posted before the first wait, and MPI
  // progresses all of them while it waits for one: waiting in order is
  // waiting for all.
  bool all_completed = true;
  for (const auto& leave : live.pending) {
    int code = MPI_Wait(&leave->request, MPI_STATUS_IGNORE);
    const int world = static_cast<int>(leave->headers.size());
    Status verdict = code != MPI_SUCCESS ? mpi_error("MPI_Wait for the leave", code)
                                         : comm_detail::check_call_headers(leave->headers.data(), world, Status());
    if (!verdict.ok()) std::fprintf(stderr, "detdit: %s\n", verdict.message().c_str());
    all_completed = all_completed && code == MPI_SUCCESS;
  }
  // A failed wait may leave its request active: then the buffers stay
  // (reachable, in live.pending) for MPI to finish with.
  if (!all_completed) return MPI_SUCCESS;
  live.pending.clear();
  return MPI_SUCCESS;
}

Status set_leave_at_finalize() {
  LiveCommunicators& live = live_communicators();
  std::lock_guard<std::mutex> lock(live.mutex);
  if (live.leave_at_finalize) return Status();
  int keyval = MPI_KEYVAL_INVALID;
  int code = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, leave_at_finalize, &keyval, nullptr);
  if (code != MPI_SUCCESS) return mpi_error("MPI_Comm_create_keyval", code);
  code = MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr);
  if (code != MPI_SUCCESS) return mpi_error("MPI_Comm_set_attr", code);
  live.leave_at_finalize = true;
  return Status();
}

}  // namespace

Status create_mpi_communicator(std::unique_ptr<Communicator>* comm, const void* mpi_comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // Serialized: a communicator may be used, and destroyed, from any
    // thread, one MPI call at a time in the process (include/detdit/comm.h).
    int provided = 0;
    int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (code != MPI_SUCCESS) return mpi_error("MPI_Init_thread", code);
    std::atexit(finalize_at_exit);
    if (provided < MPI_THREAD_SERIALIZED)
      return Status::runtime_error("this MPI provides thread level " + std::to_string(provided) +
                                   ", below MPI_THREAD_SERIALIZED (" + std::to_string(MPI_THREAD_SERIALIZED) +
                                   "), which the MPI communicator needs");
  }
  DETDIT_RETURN_IF_ERROR(set_leave_at_finalize());
  MPI_Comm caller = mpi_comm ? *static_cast<const MPI_Comm*>(mpi_comm) : MPI_COMM_WORLD;
  MPI_Comm handle = MPI_COMM_NULL;
  int code = MPI_Comm_dup(caller, &handle);
  if (code != MPI_SUCCESS) return mpi_error("MPI_Comm_dup", code);
  // Errors come back as codes (turned into RuntimeErrors), never an abort; on
  // the duplicate only, the caller's MPI_Comm keeps its own handler.
  MPI_Comm_set_errhandler(handle, MPI_ERRORS_RETURN);
  int rank = 0, world = 0;
  Status made;
  code = MPI_Comm_rank(handle, &rank);
  if (code != MPI_SUCCESS) made = mpi_error("MPI_Comm_rank", code);
  code = MPI_Comm_size(handle, &world);
  if (made.ok() && code != MPI_SUCCESS) made = mpi_error("MPI_Comm_size", code);
  if (made.ok())
    made = out_of_memory_is_an_error(
        [&] { return "out of memory creating the MPI communicator of " + std::to_string(world) + " ranks"; },
        [&] {
          *comm = std::make_unique<MpiCommunicator>(handle, rank, world);
          return Status();
        });
  if (!made.ok()) MPI_Comm_free(&handle);
  return made;
}

#else

Status create_mpi_communicator(std::unique_ptr<Communicator>*, const void*) {
  return Status::runtime_error(
      "this detdit was built without MPI (no MPI found at configure time); install libopenmpi-dev and rebuild");
}

#endif

}  // namespace detdit
