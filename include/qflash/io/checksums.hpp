/// @file
/// Verifying a model directory against its `SHA256SUMS` (the `sha256sum` output format:
/// "<64 hex digits>  <file>" per line, or " *<file>" for binary mode), so a corrupted or
/// partial download is caught before it is used. SHA-256 comes from OpenSSL's libcrypto.
#pragma once

#include <openssl/evp.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/mapped_file.hpp"

namespace qflash::io {

inline constexpr std::string_view kChecksumFile = "SHA256SUMS";

/// Lower-case hex SHA-256 of a file's bytes.
inline std::string sha256_hex(std::string const& path) {
  MappedFile const f(path);
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
  unsigned int md_len = 0;
  bool const ok = ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1 &&
                  EVP_DigestUpdate(ctx.get(), f.data(), f.size()) == 1 &&
                  EVP_DigestFinal_ex(ctx.get(), md.data(), &md_len) == 1;
  QFLASH_CHECK(ok, path, ": SHA-256 computation failed");
  std::string hex;
  char buf[3];
  for (unsigned i = 0; i < md_len; ++i) {
    std::snprintf(buf, sizeof buf, "%02x", md[i]);
    hex += buf;
  }
  return hex;
}

struct ChecksumEntry {
  std::string digest;  ///< lower-case hex
  std::string file;    ///< relative to the directory
};

/// Parses `<dir>/SHA256SUMS`; throws Error naming the line that is malformed.
inline std::vector<ChecksumEntry> read_checksums(std::string const& dir) {
  std::string const path = dir + "/" + std::string(kChecksumFile);
  std::ifstream in(path);
  QFLASH_CHECK(in.good(), path, ": cannot open");
  std::vector<ChecksumEntry> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    bool const shape_ok = line.size() > 66 && line[64] == ' ' && (line[65] == ' ' || line[65] == '*');
    std::string digest = shape_ok ? line.substr(0, 64) : "";
    bool hex = shape_ok;
    for (char& c : digest) {
      if (c >= 'A' && c <= 'F') c = static_cast<char>(c - 'A' + 'a');
      hex = hex && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
    }
    QFLASH_CHECK(hex, path, ":", n, ": expected '<64 hex digits>  <file>', got '", line, "'");
    out.push_back({digest, line.substr(66)});
  }
  QFLASH_CHECK(!out.empty(), path, ": lists no files");
  return out;
}

/// True when `dir` has a SHA256SUMS file.
inline bool has_checksums(std::string const& dir) {
  return std::filesystem::exists(dir + "/" + std::string(kChecksumFile));
}

/// Checks every file SHA256SUMS lists; throws Error naming the first missing or mismatching
/// file (and what to do about it).
inline void verify_checksums(std::string const& dir) {
  for (auto const& e : read_checksums(dir)) {
    std::string const path = dir + "/" + e.file;
    QFLASH_CHECK(std::filesystem::exists(path), path, ": listed in ", kChecksumFile, " but missing");
    std::string const got = sha256_hex(path);
    QFLASH_CHECK(got == e.digest, path, ": SHA-256 mismatch (", kChecksumFile, " says ", e.digest,
                 ", file has ", got, "); the file is corrupt or was changed — restore it, or pass --no-verify");
  }
}

}  // namespace qflash::io
