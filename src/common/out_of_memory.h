// No exception leaves the library: every entry point returns a Status. A
// Status-returning body that allocates host memory (std::vector, std::string,
// make_shared) runs through out_of_memory_is_an_error at the narrowest place
// that covers its allocations, and std::bad_alloc becomes a RuntimeError that
// names what could not be allocated. (The backends' scratch never throws: it
// is allocated with std::nothrow, src/cpu/scratch.cc.)
#pragma once

#include <new>
#include <string>

#include "detdit/status.h"

namespace detdit {

// body() -> Status; what() -> std::string, the RuntimeError's message (called
// only after a std::bad_alloc, when the failed allocation has been released).
template <typename What, typename Body>
Status out_of_memory_is_an_error(What&& what, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Status::runtime_error(what());
  }
}

}  // namespace detdit
