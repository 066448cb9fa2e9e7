// Timing on a device, for `detdit bench`: the median of repeated calls (the
// wall clock on the CPU; on CUDA a pair of events on the given stream, so the
// timed work must be enqueued on that stream) and the copy bandwidth of a
// device, the baseline of a bench row's "% of copy".
#pragma once

#include <cstddef>
#include <functional>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

// The median of `repeats` timed calls of `call` (its work on `stream` of
// `device`) after `warmup` untimed ones.
Status time_calls(const Device& device, Stream stream, int warmup, int repeats, const std::function<Status()>& call,
                  double* median_seconds);

// The copy bandwidth of `device` in bytes/s (read + write counted), measured
// now: the median of `repeats` copies of `bytes` after one untimed (memcpy on
// the CPU, a device-to-device copy on `stream` on CUDA).
Status measure_copy_bandwidth(const Device& device, Stream stream, std::size_t bytes, int repeats,
                              double* bytes_per_second);

}  // namespace cases
}  // namespace detdit
