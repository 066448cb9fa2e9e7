#include "progress.h"

#include <unistd.h>

#include <cstdio>
#include <string>

namespace detdit {
namespace cli {

Progress::Progress(std::string command, std::size_t total, bool enabled)
    : command_(std::move(command)),
      total_(total),
      enabled_(enabled),
      terminal_(enabled && ::isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      case_start_(start_) {}

double Progress::since(std::chrono::steady_clock::time_point t) const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string Progress::counter(std::size_t n) const {
  return "[" + std::to_string(n) + (total_ > 0 ? "/" + std::to_string(total_) : "") + "]";
}

void Progress::started(const std::string& name) {
  case_start_ = std::chrono::steady_clock::now();
  if (!terminal_) return;
  std::fprintf(stderr, "\r\033[K%s %s ... %.1f s", counter(done_ + 1).c_str(), name.c_str(), since(start_));
  std::fflush(stderr);
  live_ = true;
}

void Progress::finished(const std::string& name, const std::string& outcome) {
  ++done_;
  if (!enabled_ || terminal_) return;
  std::fprintf(stderr, "%s: %s %s: %s%.1f s (%.1f s elapsed)\n", command_.c_str(), counter(done_).c_str(), name.c_str(),
               outcome.empty() ? "" : (outcome + ", ").c_str(), since(case_start_), since(start_));
  std::fflush(stderr);
}

void Progress::clear() {
  if (!live_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  live_ = false;
}

}  // namespace cli
}  // namespace detdit
