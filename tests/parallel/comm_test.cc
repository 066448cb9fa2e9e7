// Communicators: the rank-ordered all-gather and the broadcast are exact byte
// copies for every world size and root, and mismatched or invalid calls fail
// on every rank (no hang, no copy). In-process on the CPU and on one GPU; MPI
// across processes.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "support/test_util.h"
#include "detdit/comm.h"
#include "parallel/call_check.h"
#include "parallel/parallel_util.h"

#if defined(DETDIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif
#if defined(DETDIT_WITH_MPI)
#include <mpi.h>
#endif

namespace detdit {
namespace {

using testing::run_under_mpi;

int count_of_text(const std::string& text, const std::string& needle) {
  int count = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

// Rank r's payload byte i: distinct per rank and position.
uint8_t payload_byte(int rank, std::size_t i) { return static_cast<uint8_t>(rank * 37 + i * 11 + 5); }

std::vector<uint8_t> payload(int rank, std::size_t bytes) {
  std::vector<uint8_t> v;
  v.reserve(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v.push_back(payload_byte(rank, i));
  return v;
}

// What every rank must hold after the gather: rank blocks in rank order.
std::vector<uint8_t> expected_gather(int world, std::size_t bytes) {
  std::vector<uint8_t> v;
  for (int r = 0; r < world; ++r) {
    std::vector<uint8_t> p = payload(r, bytes);
    v.insert(v.end(), p.begin(), p.end());
  }
  return v;
}

Status gather_and_check(Communicator& comm, std::size_t bytes) {
  const int world = comm.world_size();
  std::vector<uint8_t> send = payload(comm.rank(), bytes);
  std::vector<uint8_t> recv(bytes * world, 0xA5);
  DETDIT_RETURN_IF_ERROR(comm.all_gather(send.data(), bytes, recv.data(), DType::kF32, nullptr));
  if (recv != expected_gather(world, bytes))
    return Status::runtime_error("rank " + std::to_string(comm.rank()) + " gathered the wrong bytes");
  return Status();
}

// Broadcast from `root`: every rank starts with its own payload, and every
// rank ends with root's (the root's buffer unchanged).
Status broadcast_and_check(Communicator& comm, std::size_t bytes, int root) {
  std::vector<uint8_t> buffer = payload(comm.rank(), bytes);
  DETDIT_RETURN_IF_ERROR(comm.broadcast(buffer.data(), bytes, root, DType::kF32, nullptr));
  if (buffer != payload(root, bytes))
    return Status::runtime_error("rank " + std::to_string(comm.rank()) + " got the wrong bytes from root " +
                                 std::to_string(root));
  return Status();
}

TEST(InProcessComm, AllGatherIsRankOrderedForEveryWorldSize) {
  for (int world = 1; world <= 8; ++world) {
    SCOPED_TRACE("world " + std::to_string(world));
    DETDIT_EXPECT_OK(InProcessGroup::run(world, [&](Communicator& comm) -> Status {
      if (comm.world_size() != world) return Status::runtime_error("wrong world size");
      // Several calls in a row, of different sizes (including zero bytes).
      for (std::size_t bytes : {std::size_t{4}, std::size_t{4096}, std::size_t{0}, std::size_t{12 * 1024 + 8}})
        DETDIT_RETURN_IF_ERROR(gather_and_check(comm, bytes));
      return Status();
    }));
  }
}

TEST(InProcessComm, MismatchedBytesFailOnEveryRankWithoutCopying) {
  const int world = 4;
  std::vector<Status> results(world);
  // char, not bool: each rank's thread writes its own entry, and
  // std::vector<bool> packs neighbours into one word (a data race that lost
  // an entry once in 30 runs on 16 cores).
  std::vector<char> untouched(world, false);
  Status run = InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    const std::size_t bytes = comm.rank() == 2 ? 8 : 16;
    std::vector<uint8_t> send = payload(comm.rank(), bytes);
    std::vector<uint8_t> recv(16 * world, 0xA5);
    results[comm.rank()] = comm.all_gather(send.data(), bytes, recv.data(), DType::kF32, nullptr);
    untouched[comm.rank()] = recv == std::vector<uint8_t>(16 * world, 0xA5);
    return results[comm.rank()];
  });
  EXPECT_EQ(run.kind(), ErrorKind::kValue) << run.to_string();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].kind(), ErrorKind::kValue) << "rank " << r << ": " << results[r].to_string();
    EXPECT_NE(results[r].message().find("rank 2 called all_gather #0 with 8 bytes"), std::string::npos)
        << results[r].message();
    EXPECT_TRUE(untouched[r]) << "rank " << r << " recv was written";
  }
}

TEST(InProcessComm, MismatchedDtypeFailsOnEveryRank) {
  const int world = 3;
  std::vector<Status> results(world);
  (void)InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    std::vector<uint8_t> send(8), recv(8 * world);
    const DType dtype = comm.rank() == 1 ? DType::kBF16 : DType::kF32;
    results[comm.rank()] = comm.all_gather(send.data(), 8, recv.data(), dtype, nullptr);
    return results[comm.rank()];
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].kind(), ErrorKind::kValue) << results[r].to_string();
    EXPECT_NE(results[r].message().find("bfloat16"), std::string::npos) << results[r].message();
  }
}

TEST(InProcessComm, InvalidArgumentsOnOneRankFailEveryRank) {
  const int world = 3;
  std::vector<Status> results(world);
  (void)InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    std::vector<uint8_t> send(8), recv(8 * world, 0xA5);
    // rank 0 passes a null send buffer: it still takes part, so nobody hangs.
    const void* data = comm.rank() == 0 ? nullptr : send.data();
    results[comm.rank()] = comm.all_gather(data, 8, recv.data(), DType::kF32, nullptr);
    return results[comm.rank()];
  });
  EXPECT_NE(results[0].message().find("send buffer is null"), std::string::npos) << results[0].message();
  for (int r = 1; r < world; ++r)
    EXPECT_NE(results[r].message().find("invalid arguments on rank(s) 0"), std::string::npos) << results[r].message();
}

TEST(InProcessComm, ARankThatSkipsACallMakesTheOthersFailInsteadOfHanging) {
  // rank 0 makes one more call than the others: it finds them gone.
  Status run = InProcessGroup::run(3, [&](Communicator& comm) -> Status {
    DETDIT_RETURN_IF_ERROR(gather_and_check(comm, 64));
    if (comm.rank() == 0) return gather_and_check(comm, 64);
    return Status();
  });
  EXPECT_EQ(run.kind(), ErrorKind::kRuntime) << run.to_string();
  EXPECT_NE(run.message().find("left the group"), std::string::npos) << run.message();
}

TEST(InProcessComm, BroadcastCopiesTheRootsBytesForEveryWorldSizeAndRoot) {
  for (int world = 1; world <= 8; ++world) {
    SCOPED_TRACE("world " + std::to_string(world));
    DETDIT_EXPECT_OK(InProcessGroup::run(world, [&](Communicator& comm) -> Status {
      for (int root = 0; root < world; ++root)
        for (std::size_t bytes : {std::size_t{4}, std::size_t{0}, std::size_t{12 * 1024 + 8}})
          DETDIT_RETURN_IF_ERROR(broadcast_and_check(comm, bytes, root));
      // Interleaved with all-gathers: one call sequence.
      DETDIT_RETURN_IF_ERROR(gather_and_check(comm, 64));
      return broadcast_and_check(comm, 64, world - 1);
    }));
  }
}

// A broadcast call that differs on one rank (root, bytes, dtype, or an
// all_gather in its place) is the same ValueError on every rank and moves
// nothing; no rank hangs.
TEST(InProcessComm, MismatchedBroadcastsFailOnEveryRankWithoutCopying) {
  struct Case {
    const char* what;
    std::function<Status(Communicator&, std::vector<uint8_t>&)> call;
    const char* needle;
  };
  const int world = 4;
  const std::vector<Case> cases = {
      {"root", [](Communicator& c, std::vector<uint8_t>& b) {
         return c.broadcast(b.data(), 16, c.rank() == 2 ? 1 : 0, DType::kF32, nullptr);
       }, "rank 2 called broadcast #0 with 16 bytes of float32 from root 1"},
      {"bytes", [](Communicator& c, std::vector<uint8_t>& b) {
         return c.broadcast(b.data(), c.rank() == 3 ? 8 : 16, 0, DType::kF32, nullptr);
       }, "rank 3 called broadcast #0 with 8 bytes"},
      {"dtype", [](Communicator& c, std::vector<uint8_t>& b) {
         return c.broadcast(b.data(), 16, 0, c.rank() == 1 ? DType::kBF16 : DType::kF32, nullptr);
       }, "bfloat16"},
      {"op", [](Communicator& c, std::vector<uint8_t>& b) {
         std::vector<uint8_t> recv(16 * 4);
         if (c.rank() == 1) return c.all_gather(b.data(), 16, recv.data(), DType::kF32, nullptr);
         return c.broadcast(b.data(), 16, 0, DType::kF32, nullptr);
       }, "rank 1 called all_gather #0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<Status> results(world);
    std::vector<char> untouched(world, false);  // char: see above
    Status run = InProcessGroup::run(world, [&](Communicator& comm) -> Status {
      std::vector<uint8_t> buffer = payload(comm.rank(), 16);
      results[comm.rank()] = c.call(comm, buffer);
      untouched[comm.rank()] = buffer == payload(comm.rank(), 16);
      return results[comm.rank()];
    });
    EXPECT_EQ(run.kind(), ErrorKind::kValue) << run.to_string();
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(results[r].kind(), ErrorKind::kValue) << "rank " << r << ": " << results[r].to_string();
      EXPECT_NE(results[r].message().find(c.needle), std::string::npos) << results[r].message();
      EXPECT_TRUE(untouched[r]) << "rank " << r << " buffer was written";
    }
  }
}

TEST(InProcessComm, InvalidBroadcastArgumentsFailEveryRank) {
  const int world = 3;
  // The same out-of-range root on every rank: each rank's own error.
  std::vector<Status> results(world);
  (void)InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    std::vector<uint8_t> buffer(8);
    results[comm.rank()] = comm.broadcast(buffer.data(), 8, 3, DType::kF32, nullptr);
    return results[comm.rank()];
  });
  for (int r = 0; r < world; ++r)
    EXPECT_NE(results[r].message().find("broadcast root must be in [0, 3), got 3"), std::string::npos)
        << results[r].message();
  // A null buffer on rank 1: it still takes part, the others fail naming it.
  std::vector<char> untouched(world, false);  // char: see above
  (void)InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    std::vector<uint8_t> buffer = payload(comm.rank(), 8);
    results[comm.rank()] = comm.broadcast(comm.rank() == 1 ? nullptr : buffer.data(), 8, 0, DType::kF32, nullptr);
    untouched[comm.rank()] = buffer == payload(comm.rank(), 8);
    return results[comm.rank()];
  });
  EXPECT_NE(results[1].message().find("broadcast buffer is null"), std::string::npos) << results[1].message();
  for (int r : {0, 2})
    EXPECT_NE(results[r].message().find("broadcast #0 was called with invalid arguments on rank(s) 1"),
              std::string::npos)
        << results[r].message();
  for (int r = 0; r < world; ++r) EXPECT_TRUE(untouched[r]) << "rank " << r;
  // Bytes that are not whole elements.
  (void)InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    std::vector<uint8_t> buffer(8);
    results[comm.rank()] = comm.broadcast(buffer.data(), 6, 0, DType::kF32, nullptr);
    return results[comm.rank()];
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(results[r].kind(), ErrorKind::kValue) << results[r].to_string();
}

TEST(InProcessComm, AgreeReportsTheFirstFailingRankOnEveryRank) {
  const int world = 5;
  std::vector<Status> results(world);
  (void)InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    DETDIT_RETURN_IF_ERROR(comm.agree(Status()));  // all OK agrees OK
    Status local = comm.rank() == 3 ? Status::type_error("x must be bfloat16, got float16") : Status();
    results[comm.rank()] = comm.agree(local);
    return Status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].kind(), ErrorKind::kType) << "rank " << r;
    EXPECT_NE(results[r].message().find("x must be bfloat16, got float16"), std::string::npos)
        << results[r].message();
  }
  EXPECT_NE(results[0].message().find("rank 3"), std::string::npos) << results[0].message();
}

TEST(InProcessComm, AgreeRejectsDifferentSignatures) {
  const int world = 3;
  std::vector<Status> results(world);
  (void)InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    DETDIT_RETURN_IF_ERROR(comm.agree(Status(), "op(a)"));  // equal signatures agree
    results[comm.rank()] = comm.agree(Status(), comm.rank() == 1 ? "op(b)" : "op(a)");
    return Status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].kind(), ErrorKind::kValue) << results[r].to_string();
    EXPECT_NE(results[r].message().find("rank 1's call does not match rank 0's"), std::string::npos)
        << results[r].message();
  }
}

TEST(InProcessComm, RunReportsExceptionsAndRejectsBadWorlds) {
  Status run = InProcessGroup::run(2, [&](Communicator& comm) -> Status {
    if (comm.rank() == 1) throw std::runtime_error("boom");
    return Status();
  });
  EXPECT_EQ(run.kind(), ErrorKind::kRuntime);
  EXPECT_NE(run.message().find("rank 1: exception: boom"), std::string::npos) << run.message();
  EXPECT_EQ(InProcessGroup::run(0, [](Communicator&) { return Status(); }).kind(), ErrorKind::kValue);
  std::shared_ptr<InProcessGroup> group;
  DETDIT_ASSERT_OK(InProcessGroup::create(2, Device::cpu(), &group));
  std::unique_ptr<Communicator> comm;
  EXPECT_EQ(group->communicator(2, &comm).kind(), ErrorKind::kValue);
  DETDIT_EXPECT_OK(group->communicator(1, &comm));
  EXPECT_EQ(group->communicator(1, &comm).kind(), ErrorKind::kValue);
}

TEST(InProcessCommCuda, AllGatherOnOneGpuIsRankOrdered) {
  DETDIT_SKIP_WITHOUT_CUDA();
#if defined(DETDIT_WITH_CUDA)
  for (int world : {1, 2, 3, 5, 8}) {
    SCOPED_TRACE("world " + std::to_string(world));
    DETDIT_EXPECT_OK(InProcessGroup::run(world, [&](Communicator& comm) -> Status {
      const std::size_t bytes = 64 * 1024 + 12;
      cudaSetDevice(0);
      cudaStream_t stream;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      void *send = nullptr, *recv = nullptr;
      cudaMalloc(&send, bytes);
      cudaMalloc(&recv, bytes * world);
      std::vector<uint8_t> host = payload(comm.rank(), bytes);
      cudaMemcpyAsync(send, host.data(), bytes, cudaMemcpyHostToDevice, stream);
      Status s = Status();
      for (int repeat = 0; repeat < 3 && s.ok(); ++repeat) s = comm.all_gather(send, bytes, recv, DType::kBF16, stream);
      std::vector<uint8_t> got(bytes * world);
      cudaMemcpyAsync(got.data(), recv, bytes * world, cudaMemcpyDeviceToHost, stream);
      cudaStreamSynchronize(stream);
      cudaFree(send);
      cudaFree(recv);
      cudaStreamDestroy(stream);
      DETDIT_RETURN_IF_ERROR(s);
      if (got != expected_gather(world, bytes)) return Status::runtime_error("wrong bytes on the GPU");
      return Status();
    }, Device::cuda(0)));
  }
#endif
}

TEST(InProcessCommCuda, BroadcastOnOneGpuCopiesTheRoot) {
  DETDIT_SKIP_WITHOUT_CUDA();
#if defined(DETDIT_WITH_CUDA)
  for (int world : {1, 2, 3, 8}) {
    SCOPED_TRACE("world " + std::to_string(world));
    DETDIT_EXPECT_OK(InProcessGroup::run(world, [&](Communicator& comm) -> Status {
      const std::size_t bytes = 64 * 1024 + 12;
      cudaSetDevice(0);
      cudaStream_t stream;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      void* buffer = nullptr;
      cudaMalloc(&buffer, bytes);
      Status s = Status();
      std::vector<uint8_t> got(bytes);
      for (int root = 0; root < world && s.ok(); ++root) {
        std::vector<uint8_t> host = payload(comm.rank(), bytes);
        cudaMemcpyAsync(buffer, host.data(), bytes, cudaMemcpyHostToDevice, stream);
        s = comm.broadcast(buffer, bytes, root, DType::kBF16, stream);
        cudaMemcpyAsync(got.data(), buffer, bytes, cudaMemcpyDeviceToHost, stream);
        cudaStreamSynchronize(stream);
        if (s.ok() && got != payload(root, bytes)) s = Status::runtime_error("wrong bytes on the GPU");
      }
      cudaFree(buffer);
      cudaStreamDestroy(stream);
      return s;
    }, Device::cuda(0)));
  }
#endif
}

TEST(NcclComm, WorldSizeOneAllGatherIsACopy) {
  DETDIT_SKIP_WITHOUT_CUDA();
#if defined(DETDIT_WITH_NCCL)
  std::unique_ptr<Communicator> comm;
  DETDIT_ASSERT_OK(testing::one_rank_nccl_communicator(&comm));
  const std::size_t bytes = 4096;
  void *send = nullptr, *recv = nullptr;
  cudaMalloc(&send, bytes);
  cudaMalloc(&recv, bytes);
  std::vector<uint8_t> host = payload(0, bytes), got(bytes);
  cudaMemcpy(send, host.data(), bytes, cudaMemcpyHostToDevice);
  DETDIT_EXPECT_OK(comm->all_gather(send, bytes, recv, DType::kF32, nullptr));
  cudaMemcpy(got.data(), recv, bytes, cudaMemcpyDeviceToHost);
  EXPECT_EQ(got, host);
  EXPECT_EQ(comm->all_gather(send, 6, recv, DType::kF32, nullptr).kind(), ErrorKind::kValue);
  DETDIT_EXPECT_OK(comm->broadcast(recv, bytes, 0, DType::kF32, nullptr));
  cudaMemcpy(got.data(), recv, bytes, cudaMemcpyDeviceToHost);
  EXPECT_EQ(got, host);
  EXPECT_EQ(comm->broadcast(recv, bytes, 1, DType::kF32, nullptr).kind(), ErrorKind::kValue);
  cudaFree(send);
  cudaFree(recv);
#else
  GTEST_SKIP() << "built without NCCL";
#endif
}

// ---- MPI: the launcher runs the DISABLED_ worker below on N processes.

TEST(DISABLED_MpiWorker, AllGather) {
  std::unique_ptr<Communicator> comm;
  DETDIT_ASSERT_OK(create_mpi_communicator(&comm));
  EXPECT_STREQ(comm->backend_id(), "mpi");
  for (std::size_t bytes : {std::size_t{4}, std::size_t{100000}, std::size_t{0}}) DETDIT_EXPECT_OK(gather_and_check(*comm, bytes));
  // A mismatched call fails on every rank (rank 1 sends fewer bytes).
  const std::size_t bytes = comm->rank() == 1 ? 8 : 16;
  std::vector<uint8_t> send(bytes), recv(16 * comm->world_size(), 0xA5);
  Status s = comm->all_gather(send.data(), bytes, recv.data(), DType::kF32, nullptr);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_EQ(recv, std::vector<uint8_t>(16 * comm->world_size(), 0xA5));
  // agree: rank 0 rejects, everyone hears it.
  Status a = comm->agree(comm->rank() == 0 ? Status::value_error("bad shape on rank 0") : Status());
  EXPECT_NE(a.message().find("bad shape on rank 0"), std::string::npos) << a.message();
  // Broadcasts from every root, then a mismatched root fails on every rank
  // without writing (rank 1 names root 1, the others root 0).
  for (int root = 0; root < comm->world_size(); ++root)
    for (std::size_t bytes : {std::size_t{4}, std::size_t{100000}, std::size_t{0}})
      DETDIT_EXPECT_OK(broadcast_and_check(*comm, bytes, root));
  std::vector<uint8_t> buffer = payload(comm->rank(), 16);
  Status b = comm->broadcast(buffer.data(), 16, comm->rank() == 1 ? 1 : 0, DType::kF32, nullptr);
  EXPECT_EQ(b.kind(), ErrorKind::kValue) << b.to_string();
  EXPECT_NE(b.message().find("from root 1"), std::string::npos) << b.message();
  EXPECT_EQ(buffer, payload(comm->rank(), 16));
  // And the communicator still works afterwards.
  DETDIT_EXPECT_OK(gather_and_check(*comm, 256));
}

TEST(MpiComm, AllGatherAcrossProcesses) {
#if defined(DETDIT_WITH_MPI)
  for (int ranks : {2, 3}) EXPECT_TRUE(run_under_mpi(ranks, "DISABLED_MpiWorker.AllGather"));
#else
  GTEST_SKIP() << "built without MPI";
#endif
}

// ---- MPI: a rank that leaves. Rank 1 makes one call with its peers, then
// leaves instead of making the next one: it destroys its communicator (or
// ends its process with the communicator alive); its peers call agree, the
// first collective of a region's backward. The peers run as a program that
// stops on an error (exit code 3); the launcher checks that the job ends.

// The verdict on gathered headers with leaves: the ranks that left are named
// on every rank (with the call of the first rank still calling), whatever
// the others' arguments; ranks that all leave agree.
TEST(CallCheck, LeavesNameTheRanksThatLeftUnlessAllLeave) {
  using comm_detail::CallHeader;
  using comm_detail::CallOp;
  using comm_detail::make_header;
  const CallHeader mixed[] = {make_header(2, CallOp::kLeave, 0, DType::kI32, false),
                              make_header(4, CallOp::kAllGather, 16, DType::kF32, true),
                              make_header(3, CallOp::kLeave, 0, DType::kI32, false)};
  EXPECT_TRUE(comm_detail::any_rank_left(mixed, 3));
  for (const Status& local : {Status(), Status::value_error("bad send buffer")}) {
    Status s = comm_detail::check_call_headers(mixed, 3, local);
    EXPECT_EQ(s.kind(), ErrorKind::kRuntime) << s.to_string();
    EXPECT_EQ(s.message(), "ranks 0, 2 left the communicator (destroyed it, or its process ended) while rank 1 "
                           "called all_gather #4 with 16 bytes of float32; a communicator that a rank has left "
                           "cannot be used again");
  }
  const CallHeader all_leave[] = {make_header(5, CallOp::kLeave, 0, DType::kI32, false),
                                  make_header(5, CallOp::kLeave, 0, DType::kI32, false)};
  DETDIT_EXPECT_OK(comm_detail::check_call_headers(all_leave, 2, Status()));
  const CallHeader none_left[] = {make_header(5, CallOp::kAgree, 0, DType::kI32, false),
                                  make_header(5, CallOp::kAgree, 0, DType::kI32, false)};
  EXPECT_FALSE(comm_detail::any_rank_left(none_left, 2));
}

void rank_one_leaves(bool destroy_first) {
  std::unique_ptr<Communicator> comm;
  DETDIT_ASSERT_OK(create_mpi_communicator(&comm));
  DETDIT_ASSERT_OK(gather_and_check(*comm, 16));
  if (comm->rank() == 1) {
    if (destroy_first) comm.reset();
    std::fprintf(stderr, "rank 1 leaves\n");
    std::exit(0);
  }
  Status s = comm->agree(Status());
  // The communicator stays failed: the next call returns at once.
  Status again = comm->all_gather(nullptr, 0, nullptr, DType::kF32, nullptr);
  std::fprintf(stderr, "rank %d: agree: %s; then all_gather: %s\n", comm->rank(), s.to_string().c_str(),
               again.to_string().c_str());
  if (!s.ok()) std::exit(3);
}

TEST(DISABLED_MpiLeaveWorker, DestroysItsCommunicator) { rank_one_leaves(true); }
TEST(DISABLED_MpiLeaveWorker, ExitsWithItsCommunicator) { rank_one_leaves(false); }

TEST(MpiComm, RankThatLeavesEndsTheJobWithAnError) {
#if defined(DETDIT_WITH_MPI)
  for (const char* worker : {"DestroysItsCommunicator", "ExitsWithItsCommunicator"}) {
    for (int ranks : {2, 3}) {
      SCOPED_TRACE(std::string(worker) + ", " + std::to_string(ranks) + " ranks");
      std::string output;
      // A hang is a failure after 60 s (killed: 124 or 137), not at ctest's clock.
      const int code = testing::launch_under_mpi(ranks, std::string("DISABLED_MpiLeaveWorker.") + worker, 60, &output);
      // mpirun's status is the first failing process's: the waiting ranks' 3
      // (124 or 137: killed at the timeout, a hang; 23 or 1: a sanitizer's).
      EXPECT_EQ(code, 3) << output;
      EXPECT_EQ(output.find("Sanitizer"), std::string::npos) << output;
      EXPECT_EQ(count_of_text(output, "rank 1 leaves"), 1) << output;
      // Every waiting rank gets a RuntimeError naming the rank that left, from
      // agree and again from the next call.
      const std::string left = "RuntimeError: rank 1 left the communicator";
      for (int r = 0; r < ranks; ++r) {
        if (r == 1) continue;
        EXPECT_NE(output.find("rank " + std::to_string(r) + ": agree: " + left), std::string::npos) << output;
      }
      EXPECT_EQ(count_of_text(output, "then all_gather: " + left), ranks - 1) << output;
      // The rank that left says so on its stderr.
      EXPECT_EQ(count_of_text(output, "detdit: " + left.substr(std::strlen("RuntimeError: ")) +
                                          " (destroyed it, or its process ended) while rank 0 called agree #1"),
                1)
          << output;
    }
  }
#else
  GTEST_SKIP() << "built without MPI";
#endif
}

// ---- MPI: leaves in another order than the peers' calls. Each rank's
// program is valid on its own: destroying a communicator does not wait for the
// peers, and each detdit communicator is a private duplicate of its MPI_Comm,
// so a leave never meets a call of another communicator or of the caller.

#if defined(DETDIT_WITH_MPI)
void report(int rank, const char* call, const Status& s) {
  std::fprintf(stderr, "rank %d: %s: %s\n", rank, call, s.to_string().c_str());
}

// Two communicators on MPI_COMM_WORLD: rank 1 destroys B, then calls A; rank 0
// calls A, then B. A succeeds; B fails on rank 0, naming the leave.
TEST(DISABLED_MpiLeaveOrderWorker, TwoCommunicatorsOnOneMpiComm) {
  std::unique_ptr<Communicator> a, b;
  DETDIT_ASSERT_OK(create_mpi_communicator(&a));
  DETDIT_ASSERT_OK(create_mpi_communicator(&b));
  const int rank = a->rank();
  if (rank == 1) b.reset();
  Status s = a->agree(Status());
  report(rank, "A.agree", s);
  DETDIT_EXPECT_OK(s);
  if (rank == 0) {
    s = b->agree(Status());
    report(rank, "B.agree", s);
    EXPECT_EQ(s.kind(), ErrorKind::kRuntime) << s.to_string();
  }
}

// Communicators on two MPI_Comms: rank 1 destroys A, then calls B; rank 0
// calls B, then destroys A. Then the caller frees B's MPI_Comm while B lives.
TEST(DISABLED_MpiLeaveOrderWorker, DestroysInAnotherOrderThanItsPeer) {
  std::unique_ptr<Communicator> a, b;
  DETDIT_ASSERT_OK(create_mpi_communicator(&a));
  MPI_Comm mine = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &mine), MPI_SUCCESS);
  DETDIT_ASSERT_OK(create_mpi_communicator(&b, &mine));
  const int rank = b->rank();
  if (rank == 1) a.reset();
  Status s = b->agree(Status());
  report(rank, "B.agree", s);
  DETDIT_EXPECT_OK(s);
  if (rank == 0) a.reset();
  EXPECT_EQ(MPI_Comm_free(&mine), MPI_SUCCESS);
  DETDIT_EXPECT_OK(gather_and_check(*b, 16));
  std::fprintf(stderr, "rank %d: done\n", rank);
}

// One communicator on MPI_COMM_WORLD: rank 1 destroys it, then joins the
// caller's own barrier on MPI_COMM_WORLD; rank 0 joins the barrier, then
// destroys it.
TEST(DISABLED_MpiLeaveOrderWorker, DestroysBeforeTheCallersBarrier) {
  std::unique_ptr<Communicator> a;
  DETDIT_ASSERT_OK(create_mpi_communicator(&a));
  const int rank = a->rank();
  DETDIT_EXPECT_OK(a->agree(Status()));
  if (rank == 1) a.reset();
  EXPECT_EQ(MPI_Barrier(MPI_COMM_WORLD), MPI_SUCCESS);
  if (rank == 0) a.reset();
  std::fprintf(stderr, "rank %d: done\n", rank);
}

// Runs the worker on 2 ranks: the job must end (a hang is killed after 60 s,
// not at ctest's clock) with status 0, both ranks' test passed and no
// sanitizer report.
std::string expect_leave_order_job_completes(const std::string& worker) {
  std::string output;
  const int code = testing::launch_under_mpi(2, "DISABLED_MpiLeaveOrderWorker." + worker, 60, &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(count_of_text(output, "[  PASSED  ] 1 test."), 2) << output;
  EXPECT_EQ(output.find("Sanitizer"), std::string::npos) << output;
  return output;
}
#endif

TEST(MpiComm, LeaveOfOneCommunicatorFailsOnlyItsOwnCalls) {
#if defined(DETDIT_WITH_MPI)
  const std::string output = expect_leave_order_job_completes("TwoCommunicatorsOnOneMpiComm");
  EXPECT_EQ(count_of_text(output, "rank 0: A.agree: ok"), 1) << output;
  EXPECT_EQ(count_of_text(output, "rank 1: A.agree: ok"), 1) << output;
  const std::string left =
      "rank 1 left the communicator (destroyed it, or its process ended) while rank 0 called agree #0";
  EXPECT_EQ(count_of_text(output, "rank 0: B.agree: RuntimeError: " + left), 1) << output;
  // The rank that left prints the verdict when MPI finalises.
  EXPECT_EQ(count_of_text(output, "detdit: " + left), 1) << output;
#else
  GTEST_SKIP() << "built without MPI";
#endif
}

TEST(MpiComm, DestroyingInAnotherOrderThanThePeerCompletes) {
#if defined(DETDIT_WITH_MPI)
  const std::string output = expect_leave_order_job_completes("DestroysInAnotherOrderThanItsPeer");
  EXPECT_EQ(count_of_text(output, ": B.agree: ok"), 2) << output;
  EXPECT_EQ(count_of_text(output, ": done"), 2) << output;
  // Every rank left every communicator: no verdict is printed.
  EXPECT_EQ(count_of_text(output, "detdit: "), 0) << output;
#else
  GTEST_SKIP() << "built without MPI";
#endif
}

TEST(MpiComm, DestroyingBeforeTheCallersBarrierCompletes) {
#if defined(DETDIT_WITH_MPI)
  const std::string output = expect_leave_order_job_completes("DestroysBeforeTheCallersBarrier");
  EXPECT_EQ(count_of_text(output, ": done"), 2) << output;
  EXPECT_EQ(count_of_text(output, "detdit: "), 0) << output;
#else
  GTEST_SKIP() << "built without MPI";
#endif
}

}  // namespace
}  // namespace detdit
