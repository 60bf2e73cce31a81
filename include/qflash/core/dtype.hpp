/// @file
/// Element types of tensors, as tags for type-erased views and file formats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace qflash {

enum class DType : std::uint8_t { kF32, kF16, kBF16, kFp8E4m3, kFp8E5m2, kI32, kI64, kU8 };

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kFp8E4m3: return 1;
    case DType::kFp8E5m2: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  return 0;
}

constexpr std::string_view to_string(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kFp8E4m3: return "fp8_e4m3";
    case DType::kFp8E5m2: return "fp8_e5m2";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
  }
  return "unknown";
}

}  // namespace qflash
