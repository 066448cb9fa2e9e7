// fn(i) for every i in [begin, end) on the host's cores: the library's
// reference-backend parallel_for (contiguous blocks, each index computed once
// with the code of a serial loop, an exception rethrown after every thread has
// joined), for the oracles and input generators of the CLI, which sees no
// private library header. Each call of fn goes through std::function: give it
// a block of work (an output row, 65536 elements), not one element.
#pragma once

#include <cstdint>
#include <functional>

namespace detdit {
namespace cases {

void parallel_for(int64_t begin, int64_t end, const std::function<void(int64_t)>& fn);

}  // namespace cases
}  // namespace detdit
