// Helpers of the parallel tests: per-rank results collected on the test
// thread, and the launcher of the MPI variants (the test binary re-runs itself
// under mpirun with a filter naming a DISABLED_ worker test).
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace detdit {
namespace testing {

// Runs `worker_test` (e.g. "DISABLED_MpiWorker.AllGather") of this binary on
// `ranks` MPI processes and succeeds only if mpirun exits 0 and every rank
// reports that exactly one test passed. The output is attached on failure.
::testing::AssertionResult run_under_mpi(int ranks, const std::string& worker_test);

}  // namespace testing
}  // namespace detdit
