// Regular-file reading and temporary-file bookkeeping (contract in files.h).
#include "io/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>

namespace detdit {
namespace io {
namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "an unknown file type";
}

// The registry lives in static storage so that a signal handler can read it.
// A slot is claimed (kClaimed, by one thread: compare-exchange), its path
// written, then published (kReady); the handler reads only kReady slots.
constexpr std::size_t kMaxPathBytes = 4096;
enum SlotState : int { kFree = 0, kClaimed = 1, kReady = 2 };
struct Slot {
  std::atomic<int> state{kFree};
  char path[kMaxPathBytes];
};
Slot g_slots[kMaxRegisteredTemporaries];
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler reads the states");

struct sigaction g_previous[2];
constexpr int kSignals[2] = {SIGINT, SIGTERM};

void on_signal(int sig) {
  remove_registered_temporaries();
  // Die of the signal as the program would have without this handler.
  for (int i = 0; i < 2; ++i) {
    if (kSignals[i] == sig) ::sigaction(sig, &g_previous[i], nullptr);
  }
  ::raise(sig);
}

bool process_is_alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

}  // namespace

Status open_regular_file(const std::string& path, int* fd, uint64_t* size) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
  // before fstat could tell what it is. It changes nothing for a regular file.
  const int opened = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (opened < 0) return Status::runtime_error(path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (::fstat(opened, &st) != 0) {
    const int err = errno;
    ::close(opened);
    return Status::runtime_error(path + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(opened);
    return Status::value_error(path + ": not a regular file (" + file_kind(st.st_mode) + ")");
  }
  *fd = opened;
  *size = static_cast<uint64_t>(st.st_size);
  return Status::ok_status();
}

Status read_regular_file(const std::string& path, std::string* contents) {
  int fd = -1;
  uint64_t size = 0;
  DETDIT_RETURN_IF_ERROR(open_regular_file(path, &fd, &size));
  std::string text;
  try {
    text.resize(static_cast<std::size_t>(size));
  } catch (const std::exception&) {  // bad_alloc, or length_error past max_size()
    ::close(fd);
    return Status::runtime_error(path + ": cannot allocate " + std::to_string(size) + " bytes to read it");
  }
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd, &text[done], text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      ::close(fd);
      return Status::runtime_error(path + ": read failed: " + std::strerror(err));
    }
    if (got == 0) break;  // the file shrank while being read: what is there is the file
    done += static_cast<std::size_t>(got);
  }
  ::close(fd);
  text.resize(done);
  *contents = std::move(text);
  return Status::ok_status();
}

Status check_replaceable(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::ok_status();
    return Status::runtime_error(path + ": cannot stat: " + std::strerror(errno));
  }
  if (S_ISREG(st.st_mode)) return Status::ok_status();
  return Status::value_error(path + ": exists and is not a regular file (" + file_kind(st.st_mode) +
                             "); detdit replaces only regular files");
}

Status write_file_atomically(const std::string& path, const std::string& contents) {
  DETDIT_RETURN_IF_ERROR(check_replaceable(path));
  remove_stale_temporaries(path);
  const std::string tmp = temporary_path(path);
  DETDIT_RETURN_IF_ERROR(register_temporary(tmp));
  auto discard = [&](Status status) {
    ::unlink(tmp.c_str());
    unregister_temporary(tmp);
    return status;
  };
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  if (out == nullptr) return discard(Status::runtime_error(path + ": cannot create " + tmp + ": " + std::strerror(errno)));
  const bool written = std::fwrite(contents.data(), 1, contents.size(), out) == contents.size();
  const int write_errno = errno;
  if (std::fclose(out) != 0 || !written) {
    return discard(Status::runtime_error(path + ": write failed: " + std::strerror(written ? errno : write_errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return discard(Status::runtime_error(path + ": cannot rename " + tmp + " into place: " + std::strerror(errno)));
  }
  unregister_temporary(tmp);
  return Status::ok_status();
}

std::string temporary_path(const std::string& path) { return path + ".tmp." + std::to_string(::getpid()); }

Status register_temporary(const std::string& tmp) {
  if (tmp.size() >= kMaxPathBytes) return Status::runtime_error(tmp + ": path too long for a temporary file");
  for (Slot& slot : g_slots) {
    int expected = kFree;
    if (!slot.state.compare_exchange_strong(expected, kClaimed, std::memory_order_acquire)) continue;
    std::memcpy(slot.path, tmp.c_str(), tmp.size() + 1);
    slot.state.store(kReady, std::memory_order_release);
    return Status::ok_status();
  }
  return Status::runtime_error(tmp + ": more than " + std::to_string(kMaxRegisteredTemporaries) +
                               " temporary files at once");
}

void unregister_temporary(const std::string& tmp) {
  for (Slot& slot : g_slots) {
    if (slot.state.load(std::memory_order_acquire) == kReady && tmp == slot.path) {
      slot.state.store(kFree, std::memory_order_release);
      return;
    }
  }
}

void remove_registered_temporaries() {
  for (Slot& slot : g_slots) {
    if (slot.state.load(std::memory_order_acquire) == kReady) ::unlink(slot.path);
  }
}

void remove_stale_temporaries(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
  const std::string prefix = path.substr(slash == std::string::npos ? 0 : slash + 1) + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;  // the writer reports the directory's problem itself
  while (const dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0 || name.size() == prefix.size() ||
        name.size() - prefix.size() > 9) {
      continue;  // pids have at most 9 digits here (pid_max <= 2^22)
    }
    const std::string digits = name.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid > 0 && !process_is_alive(pid)) ::unlink((dir + "/" + name).c_str());
  }
  ::closedir(d);
}

void remove_temporaries_on_signals() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  for (int i = 0; i < 2; ++i) {
    struct sigaction action;
    std::memset(&action, 0, sizeof action);
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(kSignals[i], nullptr, &g_previous[i]);
    // A signal the program ignores (nohup) stays ignored.
    if (g_previous[i].sa_handler == SIG_IGN) continue;
    ::sigaction(kSignals[i], &action, nullptr);
  }
}

Status make_directories(const std::string& dir) {
  for (std::size_t at = 1; at <= dir.size(); ++at) {
    if (at != dir.size() && dir[at] != '/') continue;
    const std::string prefix = dir.substr(0, at);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return Status::runtime_error(prefix + ": cannot create directory: " + std::strerror(errno));
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status::runtime_error(dir + ": not a directory");
  }
  return Status::ok_status();
}

}  // namespace io
}  // namespace detdit
