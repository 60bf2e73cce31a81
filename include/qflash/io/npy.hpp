/// @file
/// Writing NumPy .npy files (format 1.0, little-endian float32, C order): the stable
/// interface `qflash logits` hands to external tools.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
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

}  // namespace qflash::io
