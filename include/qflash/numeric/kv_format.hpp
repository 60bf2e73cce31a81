/// @file
/// How the KV cache stores one token's K (or V) vector of one attention head, and what that
/// costs in bytes: the unit the paged cache, the per-head compression map and the memory
/// planner count in.
///
/// | format   | per value        | per token-head                                   |
/// |----------|------------------|--------------------------------------------------|
/// | bf16     | 2 bytes          | -                                                |
/// | fp8_e4m3 | 1 byte           | fp32 scale                                       |
/// | int8     | 1 byte           | fp16 scale + fp16 min per group of kKvGroup      |
/// | int6     | 3 bytes per 4    | fp16 scale + fp16 min per group of kKvGroup      |
///
/// int8 and int6 are asymmetric (x = min + scale * q), the last group of a head may be short.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "qflash/core/error.hpp"
#include "qflash/numeric/int6.hpp"

namespace qflash {

enum class KvFormat : std::uint8_t { kBf16, kFp8E4m3, kInt8, kInt6 };

inline constexpr std::array<std::pair<KvFormat, std::string_view>, 4> kKvFormats{{
    {KvFormat::kBf16, "bf16"},
    {KvFormat::kFp8E4m3, "fp8_e4m3"},
    {KvFormat::kInt8, "int8"},
    {KvFormat::kInt6, "int6"},
}};

/// Values that share one (scale, min) in int8 and int6.
inline constexpr int kKvGroup = 64;

constexpr std::string_view to_string(KvFormat f) {
  for (auto const& [k, name] : kKvFormats)
    if (k == f) return name;
  return "unknown";
}

/// "bf16", "fp8_e4m3" (or "fp8"), "int8", "int6"; throws Error listing them otherwise.
inline KvFormat parse_kv_format(std::string_view name) {
  if (name == "fp8") return KvFormat::kFp8E4m3;
  std::string choices;
  for (auto const& [k, n] : kKvFormats) {
    if (n == name) return k;
    choices += (choices.empty() ? "" : ", ") + std::string(n);
  }
  QFLASH_FAIL("unknown KV format '", name, "' (expected one of: ", choices, ")");
}

/// Bytes of one token-head vector of d_head values in format f, scales included.
constexpr std::int64_t kv_head_bytes(KvFormat f, std::int64_t d_head) {
  std::int64_t const groups = (d_head + kKvGroup - 1) / kKvGroup;
  switch (f) {
    case KvFormat::kBf16: return 2 * d_head;
    case KvFormat::kFp8E4m3: return d_head + 4;
    case KvFormat::kInt8: return d_head + 4 * groups;
    case KvFormat::kInt6: {
      // each group packs on its own, so a short group pads to whole 3-byte words
      std::int64_t bytes = 4 * groups;
      for (std::int64_t g = 0; g < groups; ++g)
        bytes += static_cast<std::int64_t>(int6_packed_bytes(static_cast<std::size_t>(
            g + 1 < groups ? kKvGroup : d_head - g * kKvGroup)));
      return bytes;
    }
  }
  return 0;
}

}  // namespace qflash
