// detdit/numerics.h: the two numerics profiles and the stream handle.
//
// kPortable (default): bitwise identical on the CPU reference and on every
//   CUDA GPU (sm_80 and newer). Only correctly rounded IEEE operations in a
//   documented order; exp, sin, cos and rsqrt are detdit's own functions.
// kTorch: identical to kPortable except that rsqrt, exp, sin and cos are the
//   ones PyTorch's CUDA kernels use (hardware rsqrtf, precise libdevice
//   expf/sinf/cosf), so the forward of the eager-replayable ops is bitwise
//   equal to PyTorch eager on the same GPU. CUDA only: asking for it on the CPU
//   is a ValueError.
// docs/numerics.md is the normative statement of every op's order of
// operations and rounding points.
#pragma once

namespace detdit {

enum class Numerics { kPortable = 0, kTorch = 1 };

const char* numerics_name(Numerics numerics);  // "portable" / "torch"

// A CUDA stream as an opaque handle, so public headers need no CUDA header.
// nullptr is the legacy default stream. Ignored by the CPU backend.
using Stream = void*;

}  // namespace detdit
