// Runs a test body in a forked child under a deadline, so that code under test
// which hangs (a FIFO opened for reading), runs for minutes (a quadratic
// parse), aborts (an exception escaping the library) or must run under a
// memory limit (setrlimit) fails the test with the reason instead of hanging
// CI or killing the test binary. The body returns the child's exit code
// (0: passed; any other value is the test's own failure code; an exception
// out of it is kExceptionEscaped); it must not use gtest assertions, whose
// failures would stay in the child.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

// RLIMIT_AS cannot bound an AddressSanitizer process (its shadow memory is
// address space): the memory-limit tests skip under it.
#if defined(__SANITIZE_ADDRESS__)
#define DETDIT_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DETDIT_UNDER_ASAN 1
#endif
#endif

namespace detdit {
namespace testing {

constexpr int kExceptionEscaped = 125;  // the child's exit code when the body threw

struct ChildOutcome {
  bool timed_out = false;
  int exit_code = -1;  // when the child exited
  int signal = 0;      // when a signal ended it (SIGKILL after a timeout)
  double seconds = 0;
  bool passed() const { return !timed_out && signal == 0 && exit_code == 0; }
  std::string describe() const {
    if (timed_out) return "timed out after " + std::to_string(seconds) + " s (killed)";
    if (signal != 0) return "killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
    if (exit_code == kExceptionEscaped) return "an exception escaped the body";
    return "exited with code " + std::to_string(exit_code) + " after " + std::to_string(seconds) + " s";
  }
};

inline ChildOutcome run_in_child(const std::function<int()>& body, double timeout_seconds) {
  ChildOutcome outcome;
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) {
    outcome.exit_code = -2;
    return outcome;
  }
  if (pid == 0) {
    // Catch here: an exception must not unwind into the forked copy of the
    // test runner, which would go on running the remaining tests.
    int code = kExceptionEscaped;
    try {
      code = body();
    } catch (...) {
    }
    ::_exit(code);  // not exit(): the runner's buffered output stays the parent's
  }
  int status = 0;
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (done == pid) break;
    if (outcome.seconds > timeout_seconds) {
      outcome.timed_out = true;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return outcome;
    }
    const timespec pause = {0, 5 * 1000 * 1000};  // 5 ms
    ::nanosleep(&pause, nullptr);
  }
  if (WIFEXITED(status)) outcome.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) outcome.signal = WTERMSIG(status);
  return outcome;
}

// The bytes of address space this process maps now (/proc/self/statm).
inline uint64_t mapped_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  unsigned long long pages = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%llu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  return pages * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

// In a child: lets the address space grow by `headroom` bytes past what it
// maps now. False when the limit cannot be set.
inline bool limit_address_space(uint64_t headroom) {
  const uint64_t limit = mapped_bytes() + headroom;
  const rlimit address_space = {limit, limit};
  return ::setrlimit(RLIMIT_AS, &address_space) == 0;
}

}  // namespace testing
}  // namespace detdit
