// SHA-256 (FIPS 180-4), for `detdit weights verify --sha256` and the
// checksums `detdit weights synth` records. Incremental: update() any number
// of times, then hex_digest().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace detdit {
namespace io {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t bytes);
  // The digest as 64 lowercase hex characters; the object is spent afterwards.
  std::string hex_digest();

 private:
  void compress(const uint8_t block[64]);
  uint32_t state_[8];
  uint8_t buffer_[64];
  std::size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

// One-shot digest of a byte range.
std::string sha256_hex(const void* data, std::size_t bytes);

}  // namespace io
}  // namespace detdit
