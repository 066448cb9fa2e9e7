#include "detdit/status.h"

#include "detdit/numerics.h"

namespace detdit {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kOk: return "Ok";
    case ErrorKind::kType: return "TypeError";
    case ErrorKind::kValue: return "ValueError";
    case ErrorKind::kIndex: return "IndexError";
    case ErrorKind::kRuntime: return "RuntimeError";
  }
  return "UnknownError";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(error_kind_name(kind_)) + ": " + message_;
}

const char* numerics_name(Numerics numerics) {
  return numerics == Numerics::kTorch ? "torch" : "portable";
}

}  // namespace detdit
