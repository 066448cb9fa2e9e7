// Deterministic synthetic MiniMax-H3 conditioning weights: the manifest's
// names, shapes and dtypes with realistic scales, the embedded default of
// every detdit command that needs weights (real ones come with --weights).
//
// Values (synth version 1):
//   linear weights ~ N(0, 1/sqrt(fan_in)), biases ~ N(0, 0.02),
//   norm weights ~ 1 + N(0, 0.05),
// each element = mean + std * z computed in double, rounded once to FP32 (RNE)
// and, for bf16 tensors, from FP32 to bf16 (RNE).
// z comes from a counter-based generator: key = splitmix64 mix of the seed and
// the FNV-1a hash of the tensor name; the pair j of uniforms is the
// splitmix64 outputs (2j, 2j+1) of that key; Box-Muller in double
// (r = sqrt(-2 ln u1), z_{2j} = r cos(2 pi u2), z_{2j+1} = r sin(2 pi u2)).
// So a tensor depends only on (seed, its name, its shape): it is independent
// of the other tensors, of the block count and of the thread count. ln, cos
// and sin are the C library's double functions: after rounding to FP32/bf16
// a last-bit libm difference between platforms changes a value only when it
// sits on a rounding tie, so the per-tensor SHA-256s synth records detect
// such a platform rather than assume it away.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "detdit/status.h"
#include "io/manifest.h"

namespace detdit {
namespace io {

constexpr int kSynthVersion = 1;

// numel values mean + std * z of the stream (seed, stream_name), rounded to
// `dtype` (a float dtype) and stored little-endian into out (numel * dtype
// size bytes). Synthetic weights use the tensor name as the stream name; the
// verify and bench cases use it for their inputs.
void fill_normal(DType dtype, int64_t numel, uint64_t seed, const std::string& stream_name, double mean, double std,
                 uint8_t* out);

// The bytes of one synthetic tensor (bytes == numel * dtype size).
Status synth_tensor(const ManifestEntry& entry, uint64_t seed, uint8_t* out, uint64_t bytes);

struct SynthOptions {
  ManifestConfig config;
  uint64_t seed = 0;
  std::string only;  // write only the tensors whose name contains this (empty: all)
};

// Writes DIR/h3_conditioning.safetensors (metadata records the kind, manifest
// version, synth version, seed and dimensions) and DIR/SHA256SUMS (one
// "<sha256>  <tensor name>" line per tensor). DIR is made (mkdir -p) when missing.
Status write_synthetic_weights(const std::string& dir, const SynthOptions& options);

}  // namespace io
}  // namespace detdit
