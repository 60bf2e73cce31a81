/// @file
/// How attention K/V are stored. A compile-time spec field: a uniform scheme compiles its one
/// format's quantize-append and attention code; kMixed and kAny dispatch on each head's
/// format at run time (kv/map.hpp).
#pragma once

#include <string_view>

#include "qflash/numeric/weight_format.hpp"  // WeightFormat, the other format field of a spec

namespace qflash {

enum class KvScheme : int {
  kAny = -1,     ///< decided at run time (the generic instance)
  kBf16 = 0,
  kFp8E4m3 = 1,  ///< one e4m3 byte per value, scale per token-head
  kInt6 = 2,     ///< asymmetric 6-bit, scale and zero per token-head group, 4 values in 3 bytes
  kMixed = 3,    ///< per-(layer, head) choice among the formats, from a calibration map
  kInt8 = 4,     ///< asymmetric 8-bit, scale and zero per token-head group
  kF32 = 5,      ///< exact fp32: the reference
};

constexpr std::string_view to_string(KvScheme k) {
  switch (k) {
    case KvScheme::kAny: return "any";
    case KvScheme::kBf16: return "bf16";
    case KvScheme::kFp8E4m3: return "fp8_e4m3";
    case KvScheme::kInt6: return "int6";
    case KvScheme::kMixed: return "mixed";
    case KvScheme::kInt8: return "int8";
    case KvScheme::kF32: return "f32";
  }
  return "unknown";
}

}  // namespace qflash
