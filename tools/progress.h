// Progress of a long run (verify, bench) on stderr, one case at a time, so a
// run of minutes shows where it is. On a terminal a live line names the case
// running ("\r[3/20] rmsnorm / S=4097 ... 12.3 s"), cleared at the end;
// otherwise (a log, CI) one line per finished case with its time and the
// time elapsed since the start. Silent on ranks other than the leader.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace detdit {
namespace cli {

class Progress {
 public:
  // command: "detdit verify"; total: the number of cases, 0 when not known
  // in advance ("[3]" instead of "[3/20]"); enabled: false on ranks other
  // than rank 0.
  Progress(std::string command, std::size_t total, bool enabled);
  ~Progress() { clear(); }
  void started(const std::string& name);
  // outcome: a few words after the time ("3/3 ok"); may be empty.
  void finished(const std::string& name, const std::string& outcome = "");
  void clear();  // on a terminal, erases the live line (before the table)

 private:
  double since(std::chrono::steady_clock::time_point t) const;
  std::string counter(std::size_t n) const;  // "[n/total]" or "[n]"
  std::string command_;
  std::size_t total_, done_ = 0;
  bool enabled_, terminal_, live_ = false;
  std::chrono::steady_clock::time_point start_, case_start_;
};

}  // namespace cli
}  // namespace detdit
