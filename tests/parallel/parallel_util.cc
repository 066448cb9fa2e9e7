#include "parallel/parallel_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace detdit {
namespace testing {

#if defined(DETDIT_MPIEXEC)
namespace {
std::string self_path() {
  char buffer[4096];
  const ssize_t length = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  return length > 0 ? std::string(buffer, static_cast<std::size_t>(length)) : std::string();
}

int count_of(const std::string& text, const std::string& needle) {
  int count = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}
}  // namespace
#endif

::testing::AssertionResult run_under_mpi(int ranks, const std::string& worker_test) {
#if defined(DETDIT_MPIEXEC)
  // --oversubscribe: more ranks than the 2 cores of CI; --allow-run-as-root: CI
  // runs as root. The shared-memory transport is enough on one host.
  const std::string command = std::string(DETDIT_MPIEXEC) + " --oversubscribe --allow-run-as-root --mca btl self,vader" +
                              " -np " + std::to_string(ranks) + " " + self_path() +
                              " --gtest_color=no --gtest_also_run_disabled_tests --gtest_filter=" + worker_test + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return ::testing::AssertionFailure() << "cannot start: " << command;
  std::string output;
  char chunk[4096];
  while (std::size_t n = std::fread(chunk, 1, sizeof(chunk), pipe)) output.append(chunk, n);
  const int status = pclose(pipe);
  const int exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  const int passed = count_of(output, "[  PASSED  ] 1 test.");
  if (exit_code != 0 || passed != ranks)
    return ::testing::AssertionFailure() << command << "\nexit code " << exit_code << ", " << passed << " of "
                                         << ranks << " ranks passed; output:\n"
                                         << output;
  return ::testing::AssertionSuccess() << ranks << " ranks passed";
#else
  (void)ranks;
  (void)worker_test;
  return ::testing::AssertionFailure() << "built without MPI";
#endif
}

}  // namespace testing
}  // namespace detdit
