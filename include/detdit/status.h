// detdit/status.h: the error vocabulary of the library.
//
// Every public entry point returns a Status. An error carries a kind (the
// class of mistake, mapped to TypeError / ValueError / IndexError /
// RuntimeError by the Python binding) and a message that names the argument,
// what was expected and what was got. The library never aborts; only tests and
// the CLI decide to stop.
#pragma once

#include <string>
#include <utility>

namespace detdit {

enum class ErrorKind {
  kOk = 0,
  kType,     // wrong dtype or wrong kind of object
  kValue,    // wrong shape, size, range, device, alignment or layout
  kIndex,    // an index entry outside its valid range
  kRuntime,  // the environment failed (CUDA, NCCL, MPI, I/O, unsupported build)
};

const char* error_kind_name(ErrorKind kind);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorKind kind, std::string message) : kind_(kind), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }
  static Status type_error(std::string m) { return Status(ErrorKind::kType, std::move(m)); }
  static Status value_error(std::string m) { return Status(ErrorKind::kValue, std::move(m)); }
  static Status index_error(std::string m) { return Status(ErrorKind::kIndex, std::move(m)); }
  static Status runtime_error(std::string m) { return Status(ErrorKind::kRuntime, std::move(m)); }

  bool ok() const { return kind_ == ErrorKind::kOk; }
  ErrorKind kind() const { return kind_; }
  const std::string& message() const { return message_; }
  // "ValueError: x must be ..." (or "ok").
  std::string to_string() const;

 private:
  ErrorKind kind_ = ErrorKind::kOk;
  std::string message_;
};

}  // namespace detdit

// Relay an error up the stack unchanged.
#define DETDIT_RETURN_IF_ERROR(expr)            \
  do {                                          \
    ::detdit::Status detdit_status_ = (expr);   \
    if (!detdit_status_.ok()) return detdit_status_; \
  } while (0)
