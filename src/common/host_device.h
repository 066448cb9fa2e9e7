// Shared by host and device code: the DETDIT_HD qualifier and the fast-math
// guard. Every source of the library includes this header (directly or
// through scalar_math.h), so a fast-math build fails to compile.
#pragma once

#if defined(__CUDACC__)
#define DETDIT_HD __host__ __device__ __forceinline__
#else
#define DETDIT_HD inline
#endif

// detdit's numerics contract (docs/numerics.md) needs correctly rounded IEEE
// operations in a fixed order. Fast math reorders, contracts and approximates
// them, so it is refused at compile time rather than allowed to change bits.
#if defined(__FAST_MATH__)
#error "detdit must not be built with -ffast-math: it breaks the bitwise numerics contract (docs/numerics.md)"
#endif
#if defined(__USE_FAST_MATH__)
#error "detdit must not be built with --use_fast_math: it breaks the bitwise numerics contract (docs/numerics.md)"
#endif
#if defined(__CUDA_ARCH__) && defined(__CUDA_FTZ) && __CUDA_FTZ
#error "detdit must not be built with --ftz=true: subnormals are part of the numerics contract"
#endif
