/// @file
/// Verifying a model directory against its `SHA256SUMS`, so that a corrupted or partial
/// download is caught before it is used. Lines are `sha256sum` output, "<64 hex>  <file>"
/// (" *<file>" in binary mode) or its `--tag` form "SHA256 (<file>) = <64 hex>", with LF or
/// CRLF endings. Listed names must stay inside the directory (io/paths.hpp): the file is
/// metadata that came with the download, and must not make qflash read and print the hash of
/// other files. SHA-256 comes from OpenSSL's libcrypto. Host only.
#pragma once

#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/core/mapped_file.hpp"
#include "qflash/io/paths.hpp"
#include "qflash/io/progress.hpp"

namespace qflash::io {

inline constexpr std::string_view kChecksumFile = "SHA256SUMS";

struct ChecksumEntry {
  std::string digest;  ///< lower-case hex
  std::string file;    ///< relative to the directory, as listed
};

namespace detail {

/// Bytes passed to one EVP_DigestUpdate, so a progress bar advances within a multi-GB shard.
inline constexpr std::size_t kHashChunk = std::size_t{64} << 20;

/// Lower-case hex SHA-256 of `f`, hashed `chunk` bytes at a time; each chunk's pages are
/// released once hashed (the loader maps the file again), and `progress` advanced by it.
inline std::string sha256_hex(MappedFile const& f, Progress* progress,
                              std::size_t chunk = kHashChunk) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  bool ok = ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1;
  for (std::size_t off = 0; ok && off < f.size(); off += chunk) {
    std::span<std::byte const> const part = f.bytes().subspan(off, std::min(chunk, f.size() - off));
    ok = EVP_DigestUpdate(ctx.get(), part.data(), part.size()) == 1;
    release_mapped_pages(part);
    if (progress) progress->advance(part.size(), 0);
  }
  std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
  unsigned int md_len = 0;
  ok = ok && EVP_DigestFinal_ex(ctx.get(), md.data(), &md_len) == 1;
  QFLASH_CHECK(ok, f.path(), ": SHA-256 computation failed");
  constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned i = 0; i < md_len; ++i) {
    hex += kHex[md[i] >> 4];
    hex += kHex[md[i] & 15];
  }
  return hex;
}

/// `hex` lower-cased when it is 64 hex digits, else empty.
inline std::string sha256_digest(std::string_view hex) {
  if (hex.size() != 64) return {};
  std::string out(hex);
  for (char& c : out) {
    if (c >= 'A' && c <= 'F') c = static_cast<char>(c - 'A' + 'a');
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return {};
  }
  return out;
}

/// The key under which two spellings of one listed name ("a.bin", "./a.bin") meet.
inline std::string checksum_key(std::string_view file) {
  return std::filesystem::path(file).lexically_normal().generic_string();
}

}  // namespace detail

/// Lower-case hex SHA-256 of a file's bytes.
inline std::string sha256_hex(std::string const& path) {
  return detail::sha256_hex(MappedFile(path), nullptr);
}

/// Parses the text of a SHA256SUMS file. `source` names it in messages (`<dir>/SHA256SUMS`),
/// `dir` is the directory every listed name must stay inside. Blank lines are skipped; a name
/// listed twice with the same digest counts once. Throws Error naming `source:<line>` for a
/// malformed line, a name that is absolute, has a '..' component or a NUL byte, or a name
/// listed twice with different digests; and for a file that lists nothing.
inline std::vector<ChecksumEntry> parse_checksums(std::string_view text, std::string const& source,
                                                  std::string const& dir) {
  std::vector<ChecksumEntry> out;
  std::map<std::string, std::pair<int, std::size_t>> first;  // checksum_key -> (line, index)
  int n = 0;
  for (std::size_t pos = 0; pos < text.size();) {
    std::size_t const eol = std::min(text.find('\n', pos), text.size());
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    ++n;
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;

    std::string const where = source + ":" + std::to_string(n);
    std::string digest;
    std::string_view file;
    constexpr std::string_view kTag = "SHA256 (", kTagEnd = ") = ";
    if (line.starts_with(kTag) && line.size() >= kTag.size() + kTagEnd.size() + 64 &&
        line.substr(line.size() - 64 - kTagEnd.size(), kTagEnd.size()) == kTagEnd) {
      digest = detail::sha256_digest(line.substr(line.size() - 64));
      file = line.substr(kTag.size(), line.size() - 64 - kTagEnd.size() - kTag.size());
    } else if (line.size() > 66 && line[64] == ' ' && (line[65] == ' ' || line[65] == '*')) {
      digest = detail::sha256_digest(line.substr(0, 64));
      file = line.substr(66);
    }
    QFLASH_CHECK(!digest.empty() && !file.empty(), where,
                 ": expected '<64 hex digits>  <file>' or 'SHA256 (<file>) = <64 hex digits>', got '",
                 line.substr(0, 200), line.size() > 200 ? "...'" : "'");
    QFLASH_CHECK(file.find('\0') == std::string_view::npos, where,
                 ": file name contains a NUL byte");
    (void)path_inside(dir, file, where);

    auto const [it, added] = first.try_emplace(detail::checksum_key(file), n, out.size());
    if (!added) {
      std::string const& before = out[it->second.second].digest;
      QFLASH_CHECK(before == digest, where, ": '", file, "' is listed again with digest ", digest,
                   ", but line ", it->second.first, " says ", before);
      continue;
    }
    out.push_back({std::move(digest), std::string(file)});
  }
  QFLASH_CHECK(!out.empty(), source, ": lists no files");
  return out;
}

/// Parses `<dir>/SHA256SUMS` (see `parse_checksums`).
inline std::vector<ChecksumEntry> read_checksums(std::string const& dir) {
  std::string const path = dir + "/" + std::string(kChecksumFile);
  MappedFile const f(path);
  auto const b = f.bytes();
  return parse_checksums(std::string_view(reinterpret_cast<char const*>(b.data()), b.size()),
                         path, dir);
}

/// True when `dir` has a SHA256SUMS file.
inline bool has_checksums(std::string const& dir) {
  std::error_code ec;
  return std::filesystem::exists(dir + "/" + std::string(kChecksumFile), ec);
}

/// Checks every file SHA256SUMS lists. Every listed file is opened before any is hashed, so a
/// missing one (or a directory, FIFO, ...) fails at once, not after gigabytes of hashing; then
/// each is hashed and the first mismatch throws Error naming the file and what to do about it.
/// @param required  names (relative to `dir`) the caller is about to read; those SHA256SUMS
///                  does not list are named in one warning, as they go unverified
/// @param progress  draw a progress bar over all listed bytes when stderr is a terminal
inline void verify_checksums(std::string const& dir, std::span<std::string const> required = {},
                             bool progress = false) {
  std::string const source = dir + "/" + std::string(kChecksumFile);
  std::vector<ChecksumEntry> const entries = read_checksums(dir);

  std::vector<std::string> listed;
  for (auto const& e : entries) listed.push_back(detail::checksum_key(e.file));
  std::sort(listed.begin(), listed.end());
  std::string unlisted;
  int n_unlisted = 0;
  for (auto const& r : required) {
    if (std::binary_search(listed.begin(), listed.end(), detail::checksum_key(r))) continue;
    unlisted += (n_unlisted++ ? ", " : "") + r;
  }
  if (n_unlisted > 0)
    QFLASH_LOG_WARN(source, " does not list ", unlisted,
                    n_unlisted == 1 ? ": that file is not verified" : ": those files are not verified");

  std::vector<std::string> paths;
  std::uint64_t total = 0;
  for (auto const& e : entries) {
    std::string const& path = paths.emplace_back(path_inside(dir, e.file, source));
    std::error_code ec;
    QFLASH_CHECK(std::filesystem::exists(path, ec), path, ": listed in ", kChecksumFile,
                 " but missing");
    total += MappedFile(path).size();  // throws for a directory, FIFO, ...
  }

  Progress bar("verifying " + std::string(kChecksumFile), total, progress && ::isatty(2) != 0);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    MappedFile const f(paths[i]);
    std::string const got = detail::sha256_hex(f, &bar);
    bar.advance(0, 1);
    QFLASH_CHECK(got == entries[i].digest, f.path(), ": SHA-256 mismatch (", kChecksumFile,
                 " says ", entries[i].digest, ", file has ", got,
                 "); the file is corrupt or was changed — restore it, or pass --no-verify");
  }
}

}  // namespace qflash::io
