// No exception leaves the library when host memory runs out: the backends'
// working memory (also inside parallel_for's worker threads, and when no
// worker thread can start), the timestep range check's host copy, an SpPlan's
// tables and an in-process group's slots are RuntimeErrors naming what could
// not be allocated. Each case runs in a child whose address space may grow by
// a few MB past its inputs (RLIMIT_AS); an exception escaping the library
// ends the child with kExceptionEscaped (it used to, in every case).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <new>
#include <string>

#include "support/cases.h"
#include "support/child_process.h"
#include "support/test_util.h"
#include "cpu/parallel.h"
#include "detdit/comm.h"
#include "detdit/linear.h"
#include "detdit/parallel.h"
#include "detdit/rmsnorm.h"
#include "detdit/timestep.h"

namespace detdit {
namespace {

using testing::HostTensor;

constexpr uint64_t kHeadroom = uint64_t{4} << 20;

// Runs `call` in a child after `prepare` (unlimited) and the memory limit.
// Exit 0: `call` returned a RuntimeError that says "out of memory" and
// `needle`; 1: it succeeded; 2: another Status (printed).
testing::ChildOutcome out_of_memory(const std::function<void()>& prepare, const std::function<Status()>& call,
                                    const std::string& needle) {
  return testing::run_in_child(
      [&] {
        prepare();
        if (!testing::limit_address_space(kHeadroom)) return 3;
        const Status s = call();
        if (s.ok()) return 1;
        const bool named = s.message().find("out of memory") != std::string::npos &&
                           s.message().find(needle) != std::string::npos;
        if (s.kind() == ErrorKind::kRuntime && named) return 0;
        std::fprintf(stderr, "%s\n", s.to_string().c_str());
        return 2;
      },
      /*timeout_seconds=*/120);
}

#define DETDIT_SKIP_UNDER_ASAN()                                                                          \
  do {                                                                                                    \
    if (kUnderAsan) GTEST_SKIP() << "RLIMIT_AS cannot bound an AddressSanitizer process (its shadow memory)"; \
  } while (0)
#if defined(DETDIT_UNDER_ASAN)
constexpr bool kUnderAsan = true;
#else
constexpr bool kUnderAsan = false;
#endif

const char* const kOutcomes = "exit 1: succeeded, 2: another error, 125: an exception escaped; ";

// linear's CPU backend upcasts x (T, K) to FP32 on the calling thread: 32 MB here.
TEST(OutOfMemory, CpuBackendWorkingMemoryIsARuntimeError) {
  DETDIT_SKIP_UNDER_ASAN();
  const int64_t k = int64_t{1} << 23;
  HostTensor x, weight, out;
  const auto outcome = out_of_memory(
      [&] {
        x = HostTensor(DType::kBF16, {1, k});
        weight = HostTensor(DType::kBF16, {1, k});
        out = HostTensor(DType::kF32, {1, 1});
      },
      [&] {
        LinearParams p;
        p.x = x.view();
        p.weight = weight.view();
        p.out = out.view();
        return linear_forward(p);
      },
      "the CPU backend of linear_forward");
  EXPECT_TRUE(outcome.passed()) << kOutcomes << outcome.describe();
}

// An exception in a parallel_for block on a worker thread reaches the caller
// (it used to end the process: std::terminate), where the dispatch catches it.
TEST(OutOfMemory, ParallelForHandsAWorkersExceptionToTheCaller) {
  const auto outcome = testing::run_in_child(
      [] {
        try {
          cpu::parallel_for(0, 64, [](int64_t i) {
            if (i == 63) throw std::bad_alloc();  // the last block: a worker's where there are two cores
          });
        } catch (const std::bad_alloc&) {
          return 0;
        }
        return 1;
      },
      /*timeout_seconds=*/60);
  EXPECT_TRUE(outcome.passed()) << "exit 1: nothing thrown; " << outcome.describe();
}

// rmsnorm's dx keeps one (H,) FP32 row per row in flight, inside
// parallel_for's blocks (8 MB each here). The workers' 8 MB stacks do not fit
// either: the blocks run on the calling thread (a thread that cannot start
// used to throw std::system_error out of the library), whose allocation fails.
TEST(OutOfMemory, WorkersThatCannotStartLeaveTheirBlocksToTheCaller) {
  DETDIT_SKIP_UNDER_ASAN();
  const int64_t h = int64_t{1} << 21;
  HostTensor x, weight, grad, rstd, dx;
  const auto outcome = out_of_memory(
      [&] {
        x = HostTensor(DType::kBF16, {2, h});
        weight = HostTensor(DType::kBF16, {h});
        grad = HostTensor(DType::kBF16, {2, h});
        rstd = HostTensor(DType::kF32, {2});
        dx = HostTensor(DType::kBF16, {2, h});
      },
      [&] {
        RmsnormBackwardParams p;
        p.in.x = x.view();
        p.in.weight = weight.view();
        p.rstd = rstd.view();
        p.grad = grad.view();
        p.dx = dx.view();
        return rmsnorm_backward(p);
      },
      "the CPU backend of rmsnorm_backward_rows");
  EXPECT_TRUE(outcome.passed()) << kOutcomes << outcome.describe();
}

// The range check copies the (T,) timesteps to the host: 8 MB here.
TEST(OutOfMemory, TimestepRangeCheckCopyIsARuntimeError) {
  DETDIT_SKIP_UNDER_ASAN();
  const int64_t t = int64_t{1} << 22;
  HostTensor timesteps, features;
  const auto outcome = out_of_memory(
      [&] {
        timesteps = HostTensor(DType::kF16, {t});
        features = HostTensor(DType::kF32, {t, 2});
      },
      [&] {
        TimestepSinusoidParams p;
        p.in.timesteps = timesteps.view();
        p.features = features.view();
        return timestep_sinusoid_forward(p);
      },
      "host copy of timesteps");
  EXPECT_TRUE(outcome.passed()) << kOutcomes << outcome.describe();
}

// An SpPlan's host tables are O(B*S): 24 MB at S = 2^20, B = 2.
TEST(OutOfMemory, SpPlanTablesAreARuntimeError) {
  DETDIT_SKIP_UNDER_ASAN();
  IndexPlan plan;
  const auto outcome = out_of_memory(
      [&] {
        const testing::IndexCase c = testing::make_index_case(testing::Packing::kBlock, int64_t{1} << 20, 3, 2);
        plan = testing::adaln_plan(c);
      },
      [&] {
        SpPlan sp;
        return SpPlan::create(plan, 2, 1, &sp);
      },
      "building the SpPlan");
  EXPECT_TRUE(outcome.passed()) << kOutcomes << outcome.describe();
}

// An in-process group keeps a slot per rank: 2^20 ranks need about 300 MB.
TEST(OutOfMemory, InProcessGroupSlotsAreARuntimeError) {
  DETDIT_SKIP_UNDER_ASAN();
  const auto outcome = out_of_memory([] {},
                                     [] { return InProcessGroup::run(1 << 20, [](Communicator&) { return Status(); }); },
                                     "in-process group of 1048576 ranks");
  EXPECT_TRUE(outcome.passed()) << kOutcomes << outcome.describe();
}

}  // namespace
}  // namespace detdit
