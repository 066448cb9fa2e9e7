// SHA-256 through libcrypto's EVP interface (the one OpenSSL 3 keeps; the
// SHA256_* functions are deprecated there).
#include "io/sha256.h"

#include <openssl/err.h>
#include <openssl/evp.h>

#include <sstream>
#include <stdexcept>

#include "io/files.h"

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

Status check_sha256_list(const std::string& sums_path, const SafetensorsFile& file,
                         std::vector<std::string>* differences, int* checked) {
  std::string text;
  DETDIT_RETURN_IF_ERROR(read_regular_file(sums_path, &text));
  std::istringstream in(text);
  std::string line;
  int line_number = 0, listed = 0;
  const std::string base = file.path().substr(file.path().find_last_of('/') + 1);
  while (std::getline(in, line)) {
    ++line_number;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string hex, name;
    fields >> hex >> name;
    if (!name.empty() && name[0] == '*') name.erase(0, 1);
    bool hex_ok = hex.size() >= 8 && hex.size() <= 64;
    for (char& ch : hex) {
      if (ch >= 'A' && ch <= 'F') ch = static_cast<char>(ch - 'A' + 'a');
      hex_ok = hex_ok && ((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'));
    }
    if (!hex_ok || name.empty()) {
      return Status::value_error(sums_path + ":" + std::to_string(line_number) +
                                 ": expected '<sha256 hex>  <tensor or file name>', got '" + line + "'");
    }
    ++listed;
    std::string actual;
    if (name == base) {
      actual = sha256_hex(file.file_bytes(), file.file_size());
    } else if (const TensorEntry* e = file.find(name)) {
      actual = sha256_hex(file.data(*e), e->nbytes());
    } else {
      differences->push_back("sha256: " + name + " is listed in " + sums_path + " but not in the file");
      continue;
    }
    ++*checked;
    if (actual.compare(0, hex.size(), hex) != 0)
      differences->push_back("sha256: " + name + " is " + actual + ", expected " + hex);
  }
  if (listed == 0) {
    return Status::value_error(sums_path + ": holds no checksum line ('<sha256 hex>  <tensor or file name>')");
  }
  return Status::ok_status();
}

}  // namespace io
}  // namespace detdit
