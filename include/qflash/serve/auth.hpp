/// @file
/// The API key of `qflash serve --api-key`: requests present it as `Authorization: Bearer
/// <key>`. Keys are compared as SHA-256 digests with CRYPTO_memcmp, so the time a check takes
/// depends neither on where a wrong key first differs nor on its length. Host only; OpenSSL's
/// libcrypto (which qflash::qflash links).
#pragma once

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <array>
#include <cctype>
#include <string>
#include <string_view>

#include "qflash/core/error.hpp"

namespace qflash::serve {

using Sha256 = std::array<unsigned char, 32>;

inline Sha256 sha256(std::string_view data) {
  Sha256 md{};
  unsigned int len = 0;
  QFLASH_CHECK(EVP_Digest(data.data(), data.size(), md.data(), &len, EVP_sha256(), nullptr) == 1 && len == md.size(),
               "SHA-256 failed (OpenSSL)");
  return md;
}

/// True when `a` equals `b`, in time independent of their contents.
inline bool constant_time_equal(std::string_view a, std::string_view b) {
  Sha256 const x = sha256(a), y = sha256(b);
  return CRYPTO_memcmp(x.data(), y.data(), x.size()) == 0;
}

/// The token of an Authorization header value "Bearer <token>" (scheme in any case, spaces
/// around the token ignored); empty when the value is not of that form.
inline std::string_view bearer_token(std::string_view authorization) {
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() < kScheme.size()) return {};
  for (std::size_t i = 0; i < kScheme.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(authorization[i])) != kScheme[i]) return {};
  std::string_view t = authorization.substr(kScheme.size());
  while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
  while (!t.empty() && t.back() == ' ') t.remove_suffix(1);
  return t;
}

/// The key a server requires; an empty key requires none.
class ApiKey {
 public:
  explicit ApiKey(std::string_view key = {}) : enabled_(!key.empty()), digest_(sha256(key)) {}

  [[nodiscard]] bool enabled() const { return enabled_; }

  /// Whether an Authorization header value presents the key (always, when none is required).
  [[nodiscard]] bool authorizes(std::string_view authorization) const {
    if (!enabled_) return true;
    Sha256 const given = sha256(bearer_token(authorization));
    return CRYPTO_memcmp(given.data(), digest_.data(), given.size()) == 0;
  }

 private:
  bool enabled_;
  Sha256 digest_;
};

}  // namespace qflash::serve
