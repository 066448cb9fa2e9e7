// Files the way detdit's readers and writers use them (fail closed):
//
// Reading: only regular files. A path is opened with O_NONBLOCK and then
// fstat'ed, so a FIFO (whose open() would wait for a writer), a directory, a
// device or a socket is a ValueError "PATH: not a regular file (a FIFO)"
// without blocking. OS failures are RuntimeErrors naming the path.
//
// Writing: a file is written as "<path>.tmp.<pid>" and renamed into place.
// While it is being written its temporary is registered here, and
// remove_registered_temporaries() (async-signal-safe) deletes every registered
// one: a program that handles SIGINT/SIGTERM calls it from its handler (the
// library installs no handler itself; the detdit CLI does,
// remove_temporaries_on_signals). A temporary left by a process that died
// without that chance (SIGKILL, power loss) is deleted by the next writer of
// the same path: remove_stale_temporaries deletes "<path>.tmp.<pid>" whose pid
// is no live process on this host (a live pid's file is kept: it may be
// being written right now).
#pragma once

#include <cstdint>
#include <string>

#include "detdit/status.h"

namespace detdit {
namespace io {

// Opens a regular file read-only (the caller closes *fd) and returns its size.
Status open_regular_file(const std::string& path, int* fd, uint64_t* size);
// The whole contents of a regular file.
Status read_regular_file(const std::string& path, std::string* contents);

// OK when `path` does not exist or is a regular file (lstat: a symbolic link
// is not one), so that renaming a finished temporary onto it cannot fail for
// what it is; else a ValueError "PATH: exists and is not a regular file (a
// directory); detdit replaces only regular files". Writers check this before
// they produce anything.
Status check_replaceable(const std::string& path);
// Writes `contents` to `path` through a registered temporary and a rename
// (check_replaceable first, stale temporaries removed).
Status write_file_atomically(const std::string& path, const std::string& contents);

// mkdir -p: `dir` and every missing parent (0755); a RuntimeError naming the
// first that cannot be made, or `dir` when it is not a directory.
Status make_directories(const std::string& dir);

// "<path>.tmp.<pid of this process>".
std::string temporary_path(const std::string& path);
// Registers / unregisters a temporary being written. At most kMaxRegistered
// at a time (a RuntimeError beyond that, before anything is created).
constexpr int kMaxRegisteredTemporaries = 8;
Status register_temporary(const std::string& tmp);
void unregister_temporary(const std::string& tmp);
// Unlinks every registered temporary; async-signal-safe.
void remove_registered_temporaries();
// Unlinks "<path>.tmp.<pid>" of every pid that is not a live process.
void remove_stale_temporaries(const std::string& path);
// Installs SIGINT and SIGTERM handlers that remove the registered temporaries
// and then die of the signal as before (once per process; for programs).
void remove_temporaries_on_signals();

}  // namespace io
}  // namespace detdit
