// SHA-256 (FIPS 180-4), for `detdit weights verify --sha256` and the
// checksums `detdit weights synth` records, computed by OpenSSL's libcrypto
// (a well-kept implementation; Debian's libssl-dev).
#pragma once

#include <cstddef>
#include <string>

namespace detdit {
namespace io {

// The digest of a byte range as 64 lowercase hex characters. libcrypto fails
// only when it cannot run at all (its default provider missing from a broken
// OpenSSL configuration, or no memory): then this throws std::runtime_error
// with libcrypto's reason, since no digest string could be trusted.
std::string sha256_hex(const void* data, std::size_t bytes);

}  // namespace io
}  // namespace detdit
