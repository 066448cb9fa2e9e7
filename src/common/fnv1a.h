// FNV-1a, 64-bit: the one hash of the tree, for what processes must compute
// alike without exchanging it (a synthetic tensor's stream key in io/synth.cc,
// a call signature, an index plan's fingerprint). Not a checksum against
// tampering: it tells accidental differences apart (two inputs of one length
// that differ in one byte never hash alike).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace detdit {

constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ull;

// `hash` continued over bytes [data, data + bytes): chain calls to hash
// several pieces as one sequence.
inline uint64_t fnv1a(const void* data, std::size_t bytes, uint64_t hash = kFnv1aOffset) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ull;
  return hash;
}
inline uint64_t fnv1a(const std::string& text, uint64_t hash = kFnv1aOffset) {
  return fnv1a(text.data(), text.size(), hash);
}
// For large arrays (an index plan's rows): the FNV-1a step over 8-byte words
// in four independent chains, word i in chain i mod 4 (each starting from
// `hash`), then the tail bytes and the four chain states hashed bytewise.
// One chain is bound by its multiplies' latency (one per word: 60 us at
// S = 131072 int32 rows, 40 % of a block-packed plan build); four overlap
// (15 us). Each step is a bijection of its word, so one differing word
// always changes its chain's state.
inline uint64_t fnv1a_lanes(const void* data, std::size_t bytes, uint64_t hash = kFnv1aOffset) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t lanes[4] = {hash, hash, hash, hash};
  std::size_t i = 0;
  for (; i + sizeof lanes <= bytes; i += sizeof lanes) {
    uint64_t words[4];
    std::memcpy(words, p + i, sizeof words);
    for (int k = 0; k < 4; ++k) lanes[k] = (lanes[k] ^ words[k]) * 0x100000001b3ull;
  }
  return fnv1a(lanes, sizeof lanes, fnv1a(p + i, bytes - i, hash));
}

}  // namespace detdit
