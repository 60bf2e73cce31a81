/// @file
/// NumPy .npy files (format 1.x, little-endian float32, C order): the stable interface
/// `qflash logits` hands to external tools, and how reference logits come back in tests.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "qflash/core/error.hpp"

namespace qflash::io {

inline void write_npy_f32(std::string const& path, std::span<float const> data,
                          std::vector<std::int64_t> const& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  QFLASH_CHECK(n == static_cast<std::int64_t>(data.size()), path, ": shape holds ", n,
               " values but ", data.size(), " were given");
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) dict += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? ", " : "");
  dict += "), }";
  // magic (6) + version (2) + header length (2) + dict, padded with spaces to 64 bytes, '\n' last.
  std::size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::ofstream f(path, std::ios::binary);
  QFLASH_CHECK(f.good(), path, ": cannot open for writing: ", std::strerror(errno));
  f.write("\x93NUMPY\x01\x00", 8);
  std::uint16_t const len = static_cast<std::uint16_t>(dict.size());
  char const len_bytes[2] = {static_cast<char>(len & 0xFF), static_cast<char>(len >> 8)};
  f.write(len_bytes, 2);
  f.write(dict.data(), static_cast<std::streamsize>(dict.size()));
  f.write(reinterpret_cast<char const*>(data.data()), static_cast<std::streamsize>(data.size_bytes()));
  QFLASH_CHECK(f.good(), path, ": write failed");
}

struct NpyF32 {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

/// Reads a float32 ('<f4', C order) .npy file; throws Error naming the file otherwise.
inline NpyF32 read_npy_f32(std::string const& path) {
  std::ifstream f(path, std::ios::binary);
  QFLASH_CHECK(f.good(), path, ": cannot open: ", std::strerror(errno));
  std::string const bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  QFLASH_CHECK(bytes.size() >= 10 && bytes.compare(0, 6, "\x93NUMPY") == 0 && bytes[6] == 1, path,
               ": not a version 1 .npy file");
  std::size_t const len = static_cast<unsigned char>(bytes[8]) | (static_cast<std::size_t>(static_cast<unsigned char>(bytes[9])) << 8);
  QFLASH_CHECK(10 + len <= bytes.size(), path, ": truncated .npy header");
  std::string const dict = bytes.substr(10, len);
  QFLASH_CHECK(dict.find("'descr': '<f4'") != std::string::npos && dict.find("'fortran_order': False") != std::string::npos,
               path, ": expected a little-endian float32 array in C order, header ", dict);
  NpyF32 out;
  std::size_t const open = dict.find("'shape': (");
  QFLASH_CHECK(open != std::string::npos, path, ": .npy header has no shape");
  std::int64_t n = 1;
  for (std::size_t i = open + 10; i < dict.size() && dict[i] != ')';) {
    if (dict[i] < '0' || dict[i] > '9') {
      ++i;
      continue;
    }
    std::int64_t v = 0;
    while (i < dict.size() && dict[i] >= '0' && dict[i] <= '9' && v < (std::int64_t{1} << 40)) v = v * 10 + (dict[i++] - '0');
    out.shape.push_back(v);
    n *= v;
  }
  std::size_t const body = 10 + len;
  QFLASH_CHECK(n >= 0 && bytes.size() - body == static_cast<std::size_t>(n) * 4, path, ": shape holds ", n,
               " values but the file has ", (bytes.size() - body) / 4);
  out.data.resize(static_cast<std::size_t>(n));
  std::memcpy(out.data.data(), bytes.data() + body, static_cast<std::size_t>(n) * 4);
  return out;
}

}  // namespace qflash::io
