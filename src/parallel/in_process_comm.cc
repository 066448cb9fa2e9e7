// The in-process communicator: N ranks as threads of one process.
//
// One all_gather is two barriers. Before the first, each rank publishes its
// CallHeader, its send pointer and (CUDA) an event recorded on its stream after
// the send data. Between them every rank checks the same headers, then pulls
// every rank's send block into its own recv in rank order (memcpy on the CPU;
// on CUDA its stream waits for the peer's event, then copies device to device
// and records a done event). After the second barrier a CUDA rank's stream
// waits for every peer's done event, so its send buffer is not overwritten
// while a peer still reads it. A broadcast is the same two barriers: every
// rank but the root pulls the root's buffer, and only the root's stream waits
// for the peers' done events. The host never waits for the device. The events
// live as long as the group, since a peer may pass one to its stream after its
// owner has returned.
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/out_of_memory.h"
#include "detdit/comm.h"
#include "parallel/call_check.h"
#include "parallel/comm_copy.h"

namespace detdit {

using comm_detail::AgreeRecord;
using comm_detail::CallHeader;
using comm_detail::CallOp;

struct InProcessGroup::State {
  struct Slot {
    CallHeader header;
    const void* send = nullptr;
    void* ready_event = nullptr;  // CUDA: send data is ready
    void* done_event = nullptr;   // CUDA: this rank finished reading its peers
    AgreeRecord record;
  };

  int world = 0;
  Device device;
  std::mutex mutex;
  std::condition_variable wake;
  uint64_t generation = 0;  // completed barriers
  int arrived = 0;
  int departed = -1;        // first rank that left the group, -1 while all are present
  std::vector<bool> taken;
  std::vector<Slot> slots;

  // A rank's events go with the group, not with its communicator: a rank may
  // return and destroy its communicator while a peer, just past the second
  // barrier, has yet to pass that rank's done event to cudaStreamWaitEvent.
  ~State() {
    for (const Slot& slot : slots) {
      if (slot.ready_event) cuda::comm_event_destroy(slot.ready_event);
      if (slot.done_event) cuda::comm_event_destroy(slot.done_event);
    }
  }

  // Every rank arrives or the call fails: a rank that left can never arrive.
  Status barrier(int rank) {
    std::unique_lock<std::mutex> lock(mutex);
    if (departed >= 0) return left_error(rank);
    const uint64_t entered = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      wake.notify_all();
      return Status();
    }
    wake.wait(lock, [&] { return generation != entered || departed >= 0; });
    if (generation != entered) return Status();
    return left_error(rank);
  }

  Status left_error(int rank) const {
    return Status::runtime_error("in-process group: rank " + std::to_string(departed) +
                                 " left the group while rank " + std::to_string(rank) +
                                 " waited in a collective (mismatched collective calls)");
  }

  void depart(int rank) {
    std::lock_guard<std::mutex> lock(mutex);
    if (departed < 0) departed = rank;
    wake.notify_all();
  }
};

namespace {

class InProcessCommunicator final : public Communicator {
 public:
  // The per-call copies of the peers' slots are allocated here, once: a call
  // allocates nothing, so none can fail between its two barriers.
  InProcessCommunicator(std::shared_ptr<InProcessGroup::State> state, int rank)
      : state_(std::move(state)), rank_(rank), headers_(state_->world), records_(state_->world),
        done_events_(state_->world) {}
  ~InProcessCommunicator() override { state_->depart(rank_); }  // its events are its slot's (State)

  int rank() const override { return rank_; }
  int world_size() const override { return state_->world; }
  Device device() const override { return state_->device; }
  const char* backend_id() const override { return "in_process"; }
  using Communicator::agree;

  Status all_gather(const void* send, std::size_t bytes, void* recv, DType dtype, Stream stream) override {
    const int world = state_->world;
    const bool on_cuda = state_->device.is_cuda();
    Status verdict;
    DETDIT_RETURN_IF_ERROR(begin_call(CallOp::kAllGather, send, bytes, dtype, 0,
                                      comm_detail::check_local_all_gather(send, bytes, recv, dtype, world), stream,
                                      &verdict));
    if (verdict.ok() && bytes > 0) verdict = pull(bytes, static_cast<char*>(recv), stream);
    // Always the second barrier, also on error: a peer may still read the slots.
    DETDIT_RETURN_IF_ERROR(state_->barrier(rank_));
    DETDIT_RETURN_IF_ERROR(verdict);
    if (on_cuda && bytes > 0) {
      for (int r = 0; r < world; ++r)
        if (r != rank_) DETDIT_RETURN_IF_ERROR(cuda::comm_stream_wait(stream, done_events_[r]));
    }
    return Status();
  }

  Status broadcast(void* buffer, std::size_t bytes, int root, DType dtype, Stream stream) override {
    const int world = state_->world;
    const bool on_cuda = state_->device.is_cuda();
    Status verdict;
    DETDIT_RETURN_IF_ERROR(begin_call(CallOp::kBroadcast, buffer, bytes, dtype, root,
                                      comm_detail::check_local_broadcast(buffer, bytes, root, dtype, world), stream,
                                      &verdict));
    // The headers agree, so root is valid and the same on every rank.
    if (verdict.ok() && bytes > 0 && rank_ != root) verdict = pull_from(root, bytes, static_cast<char*>(buffer), stream);
    DETDIT_RETURN_IF_ERROR(state_->barrier(rank_));
    DETDIT_RETURN_IF_ERROR(verdict);
    if (on_cuda && bytes > 0 && rank_ == root) {
      for (int r = 0; r < world; ++r)
        if (r != rank_) DETDIT_RETURN_IF_ERROR(cuda::comm_stream_wait(stream, done_events_[r]));
    }
    return Status();
  }

  Status agree(const Status& local, const std::string& signature) override {
    const int world = state_->world;
    State::Slot& mine = state_->slots[rank_];
    mine.header = comm_detail::make_header(sequence_++, CallOp::kAgree, 0, DType::kI32, false);
    mine.record = comm_detail::make_record(local, signature);
    DETDIT_RETURN_IF_ERROR(state_->barrier(rank_));
    for (int r = 0; r < world; ++r) {
      headers_[r] = state_->slots[r].header;
      records_[r] = state_->slots[r].record;
    }
    DETDIT_RETURN_IF_ERROR(state_->barrier(rank_));
    DETDIT_RETURN_IF_ERROR(comm_detail::check_call_headers(headers_.data(), world, Status()));
    return comm_detail::resolve_agreement(records_.data(), world, local, signature);
  }

 private:
  using State = InProcessGroup::State;

  // Created once, kept in this rank's slot from their creation on, so the
  // group destroys them (State) even if this call then fails.
  Status ensure_events() {
    State::Slot& mine = state_->slots[rank_];
    if (!ready_event_) DETDIT_RETURN_IF_ERROR(cuda::comm_event_create(state_->device, &ready_event_));
    mine.ready_event = ready_event_;
    if (!done_event_) DETDIT_RETURN_IF_ERROR(cuda::comm_event_create(state_->device, &done_event_));
    mine.done_event = done_event_;
    return Status();
  }

  // The first half of a collective: publish this rank's header (and, on a
  // CUDA device, the event its data is ready at) and send buffer, pass the
  // first barrier, read every rank's header and done event, and compare the
  // headers: *verdict is the call's outcome on every rank. Slots are read
  // only between the two barriers (a peer rewrites its slot once it has
  // passed the second one), so the caller always passes the second.
  Status begin_call(CallOp op, const void* send, std::size_t bytes, DType dtype, int root, Status local,
                    Stream stream, Status* verdict) {
    const int world = state_->world;
    const bool on_cuda = state_->device.is_cuda();
    if (local.ok() && on_cuda) local = ensure_events();
    if (local.ok() && on_cuda) local = cuda::comm_event_record(ready_event_, stream);
    State::Slot& mine = state_->slots[rank_];
    mine.header = comm_detail::make_header(sequence_++, op, bytes, dtype, !local.ok(), root);
    mine.send = send;  // (CUDA: the slot holds this rank's events since ensure_events)
    DETDIT_RETURN_IF_ERROR(state_->barrier(rank_));
    for (int r = 0; r < world; ++r) {
      headers_[r] = state_->slots[r].header;
      done_events_[r] = state_->slots[r].done_event;
    }
    *verdict = comm_detail::check_call_headers(headers_.data(), world, local);
    return Status();
  }

  // recv[r*bytes, (r+1)*bytes) = rank r's send, r ascending.
  Status pull(std::size_t bytes, char* recv, Stream stream) {
    for (int r = 0; r < state_->world; ++r) {
      const State::Slot& peer = state_->slots[r];
      if (!state_->device.is_cuda()) {
        std::memcpy(recv + r * bytes, peer.send, bytes);
        continue;
      }
      DETDIT_RETURN_IF_ERROR(cuda::comm_stream_wait(stream, peer.ready_event));
      DETDIT_RETURN_IF_ERROR(cuda::comm_copy_async(recv + r * bytes, peer.send, bytes, stream));
    }
    if (state_->device.is_cuda()) DETDIT_RETURN_IF_ERROR(cuda::comm_event_record(done_event_, stream));
    return Status();
  }

  // buffer[0, bytes) = rank root's buffer.
  Status pull_from(int root, std::size_t bytes, char* buffer, Stream stream) {
    const State::Slot& peer = state_->slots[root];
    if (!state_->device.is_cuda()) {
      std::memcpy(buffer, peer.send, bytes);
      return Status();
    }
    DETDIT_RETURN_IF_ERROR(cuda::comm_stream_wait(stream, peer.ready_event));
    DETDIT_RETURN_IF_ERROR(cuda::comm_copy_async(buffer, peer.send, bytes, stream));
    return cuda::comm_event_record(done_event_, stream);
  }

  std::shared_ptr<State> state_;
  int rank_;
  std::vector<CallHeader> headers_;
  std::vector<AgreeRecord> records_;
  std::vector<void*> done_events_;
  uint64_t sequence_ = 0;
  void* ready_event_ = nullptr;
  void* done_event_ = nullptr;
};

}  // namespace

Status InProcessGroup::create(int world, Device device, std::shared_ptr<InProcessGroup>* group) {
  if (world < 1) return Status::value_error("world must be >= 1, got " + std::to_string(world));
  return out_of_memory_is_an_error(
      [&] { return "out of memory creating an in-process group of " + std::to_string(world) + " ranks"; },
      [&] {
        auto state = std::make_shared<State>();
        state->world = world;
        state->device = device;
        state->taken.assign(static_cast<std::size_t>(world), false);
        state->slots.resize(static_cast<std::size_t>(world));
        *group = std::make_shared<InProcessGroup>(std::move(state));
        return Status();
      });
}

Status InProcessGroup::communicator(int rank, std::unique_ptr<Communicator>* comm) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (rank < 0 || rank >= state_->world)
    return Status::value_error("need 0 <= rank < world, got rank=" + std::to_string(rank) +
                               ", world=" + std::to_string(state_->world));
  if (state_->taken[rank])
    return Status::value_error("the communicator of rank " + std::to_string(rank) + " was already created");
  DETDIT_RETURN_IF_ERROR(out_of_memory_is_an_error(
      [&] { return "out of memory creating the communicator of rank " + std::to_string(rank); },
      [&] {
        *comm = std::make_unique<InProcessCommunicator>(state_, rank);
        return Status();
      }));
  state_->taken[rank] = true;
  return Status();
}

Status InProcessGroup::run(int world, const std::function<Status(Communicator&)>& fn, Device device) {
  std::shared_ptr<InProcessGroup> group;
  DETDIT_RETURN_IF_ERROR(create(world, device, &group));
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<Status> results;
  std::vector<std::thread> threads;
  DETDIT_RETURN_IF_ERROR(out_of_memory_is_an_error(
      [&] { return "out of memory starting an in-process group of " + std::to_string(world) + " ranks"; },
      [&] {
        comms.resize(static_cast<std::size_t>(world));
        results.resize(static_cast<std::size_t>(world));
        threads.reserve(static_cast<std::size_t>(world));
        return Status();
      }));
  for (int r = 0; r < world; ++r) DETDIT_RETURN_IF_ERROR(group->communicator(r, &comms[r]));
  for (int r = 0; r < world; ++r) {
    auto rank_body = [&, r] {
      try {
        results[r] = fn(*comms[r]);
      } catch (const std::exception& e) {
        results[r] = Status::runtime_error(std::string("exception: ") + e.what());
      } catch (...) {
        results[r] = Status::runtime_error("unknown exception");
      }
      // Leaving the group wakes any peer still waiting for this rank.
      comms[r].reset();
    };
    try {
      threads.emplace_back(rank_body);
    } catch (const std::exception& e) {  // std::system_error (no thread), std::bad_alloc (its state)
      // No thread for rank r: ranks r.. leave the group, so the started
      // ranks fail their collectives instead of waiting for them.
      for (int q = r; q < world; ++q) {
        results[q] = Status::runtime_error(std::string("could not start the thread of the rank: ") + e.what());
        comms[q].reset();
      }
      break;
    }
  }
  for (auto& t : threads) t.join();
  // Every failing rank is reported: the first one's kind, all messages (a rank
  // that waited for a failed peer reports that, the peer reports the cause).
  Status first;
  std::string messages;
  for (int r = 0; r < world; ++r) {
    if (results[r].ok()) continue;
    if (first.ok()) first = results[r];
    messages += (messages.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + results[r].message());
  }
  if (first.ok()) return first;
  return Status(first.kind(), messages);
}

}  // namespace detdit
