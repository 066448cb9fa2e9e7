// SHA-256 (FIPS 180-4), for `detdit weights verify --sha256` and the
// checksums `detdit weights synth` records, computed by OpenSSL's libcrypto
// (a well-kept implementation; Debian's libssl-dev).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "detdit/status.h"
#include "io/safetensors.h"

namespace detdit {
namespace io {

// The digest of a byte range as 64 lowercase hex characters. libcrypto fails
// only when it cannot run at all (its default provider missing from a broken
// OpenSSL configuration, or no memory): then this throws std::runtime_error
// with libcrypto's reason, since no digest string could be trusted.
std::string sha256_hex(const void* data, std::size_t bytes);

// Checks `file` against the checksum list `sums_path`: lines "<hex>  <name>"
// (sha256sum's format; "*name" too; hex in either case, as sha256sum reads
// it, and may be a prefix of at least 8 digits, as the reference manifest
// prints them), '#' lines and empty ones ignored. <name> is a tensor of the
// file, or the file's own name for a whole-file digest. Each digest that
// differs, and each name the file lacks, is a *differences line; *checked
// counts the digests compared. A malformed line, and a list without one
// checksum line (checking nothing must not read as "OK"), is a ValueError.
Status check_sha256_list(const std::string& sums_path, const SafetensorsFile& file,
                         std::vector<std::string>* differences, int* checked);

}  // namespace io
}  // namespace detdit
