// detdit's scratch memory on CUDA devices.
//
// Backwards and composite ops take their temporaries (the canonical
// reduction's chunk partials, FP32 copies, hidden activations) from one memory
// pool per CUDA device that detdit owns, stream-ordered on the op's stream.
// Freed temporaries stay mapped in the pool across host synchronisations, so a
// call does not map its scratch again after the previous one was waited on.
// The pool keeps what it mapped (about the largest scratch its ops held at
// once; CUDA does not bound it exactly) until release_scratch_memory, or until
// an allocation finds the device full, which trims the pool and tries once
// more. Other allocators (torch's caching allocator) cannot take that memory
// meanwhile. Scratch taken inside a CUDA-graph capture belongs to the graph,
// not to the pool. Nothing here changes a bit of any output.
#pragma once

#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// Returns the memory of `device`'s scratch pool that no allocation holds to
// the driver (cudaMemPoolTrimTo to 0). Memory whose stream-ordered free has
// not completed stays in the pool: call it when no detdit op is in flight on
// the device (after synchronising its streams). The next op maps what it needs
// again. The CPU has no pool: OK, nothing to do. Thread safe.
// Errors: RuntimeError for an ordinal this process has no device for, no GPU,
// or a build without CUDA; the message starts "release_scratch_memory(cuda:N)".
Status release_scratch_memory(const Device& device);

}  // namespace detdit
