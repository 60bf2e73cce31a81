/// @file
/// Writing safetensors files in tests: tensors laid out back to back after a JSON header
/// padded to 8 bytes, as the reference writer does; or raw headers for malformed cases.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace qflash::test {

inline std::vector<std::byte> to_bytes(void const* p, std::size_t n) {
  std::vector<std::byte> out(n);
  if (n) std::memcpy(out.data(), p, n);
  return out;
}
template <class T>
inline std::vector<std::byte> to_bytes(std::vector<T> const& v) {
  return to_bytes(v.data(), v.size() * sizeof(T));
}

struct Entry {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;
};

/// Writes raw bytes: the 8-byte length (or `length_override`), the header text, the data.
inline void write_raw(std::string const& path, std::string const& header,
               std::vector<std::byte> const& data, std::int64_t length_override = -1) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  std::uint64_t n = length_override >= 0 ? static_cast<std::uint64_t>(length_override)
                                         : header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  f.write(reinterpret_cast<char const*>(len), 8);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<char const*>(data.data()), static_cast<std::streamsize>(data.size()));
}

/// The header a conforming writer produces for `entries` laid out back to back, padded with
/// spaces to a multiple of 8 bytes (as the reference writer does).
inline std::string header_for(std::vector<Entry> const& entries,
                       std::map<std::string, std::string> const& metadata = {}) {
  nlohmann::json h = nlohmann::json::object();
  std::size_t off = 0;
  for (auto const& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {off, off + e.data.size()}}};
    off += e.data.size();
  }
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::string s = h.dump();
  while (s.size() % 8) s += ' ';
  return s;
}

inline std::vector<std::byte> data_for(std::vector<Entry> const& entries) {
  std::vector<std::byte> d;
  for (auto const& e : entries) d.insert(d.end(), e.data.begin(), e.data.end());
  return d;
}

inline void write_safetensors(std::string const& path, std::vector<Entry> const& entries,
                       std::map<std::string, std::string> const& metadata = {}) {
  write_raw(path, header_for(entries, metadata), data_for(entries));
}

}  // namespace qflash::test
