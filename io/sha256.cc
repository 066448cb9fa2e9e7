// SHA-256 through libcrypto's EVP interface (the one OpenSSL 3 keeps; the
// SHA256_* functions are deprecated there).
#include "io/sha256.h"

#include <openssl/err.h>
#include <openssl/evp.h>

#include <stdexcept>

namespace detdit {
namespace io {

std::string sha256_hex(const void* data, std::size_t bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_Digest(data, bytes, digest, &size, EVP_sha256(), nullptr) != 1 || size != 32) {
    char reason[256] = "no reason given";
    if (unsigned long code = ERR_get_error()) ERR_error_string_n(code, reason, sizeof reason);
    throw std::runtime_error(std::string("SHA-256: libcrypto failed (") + reason + ")");
  }
  static const char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 0xf]);
  }
  return hex;
}

}  // namespace io
}  // namespace detdit
