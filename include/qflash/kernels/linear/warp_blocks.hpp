/// @file
/// Block-format weights as a warp decodes them on CUDA: the lanes of a warp share each block,
/// so a warp's loads cover contiguous bytes and every lane decodes a few values into registers
/// (the idea of Marlin), where a lane owning a whole block would decode it into local memory.
///
/// WarpBlocks<kF> says, for format kF, how many lanes share a block (kLanesPerBlock), how many
/// values each decodes (kValues), which of the block's values they are (index), and decodes
/// them with the same float operations as the format's dequantizer (gguf_blocks.hpp, int4.hpp),
/// so the values equal dequantize_row's. Host-device code: tests check it on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "qflash/core/config.hpp"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/int4.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::linear_cuda {

namespace detail {
/// A 16-bit load from a block's bytes at an even offset (blocks are 2-byte aligned).
QFLASH_HD inline std::uint16_t load_u16(std::byte const* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<std::uint16_t const*>(p);
#else
  std::uint16_t v = 0;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}
QFLASH_HD inline float fp16_at(std::byte const* p) { return to_float(Fp16{load_u16(p)}); }
}  // namespace detail

template <WeightFormat kF>
struct WarpBlocks;

/// q8_0 (34 bytes, 32 values): 8 lanes per block, 4 consecutive values each.
template <>
struct WarpBlocks<WeightFormat::kQ8_0> {
  static constexpr int kLanesPerBlock = 8;
  static constexpr int kValues = 4;
  QFLASH_HD static constexpr int index(int part, int v) { return 4 * part + v; }
  QFLASH_HD static void decode(std::byte const* block, int part, float (&w)[kValues]) {
    float const d = detail::fp16_at(block + offsetof(gguf::BlockQ8_0, d));
    std::byte const* const codes = block + offsetof(gguf::BlockQ8_0, qs) + 4 * part;
    std::uint32_t const q = detail::load_u16(codes) | std::uint32_t{detail::load_u16(codes + 2)} << 16;
    for (int v = 0; v < kValues; ++v) w[v] = static_cast<float>(static_cast<std::int8_t>(q >> (8 * v))) * d;
  }
};

/// q4_k (144 bytes, 256 values): 32 lanes per block. Lane p reads codes bytes 4p..4p+3, whose
/// low nibbles are values 64h + m .. + 3 (sub-block 2h) and high nibbles values 64h + 32 + m
/// .. + 3 (sub-block 2h + 1), h = p / 8, m = 4 (p % 8).
template <>
struct WarpBlocks<WeightFormat::kQ4K> {
  static constexpr int kLanesPerBlock = 32;
  static constexpr int kValues = 8;
  QFLASH_HD static constexpr int index(int part, int v) {
    return 64 * (part / 8) + 32 * (v / 4) + 4 * (part % 8) + v % 4;
  }
  QFLASH_HD static void decode(std::byte const* block, int part, float (&w)[kValues]) {
    float const d = detail::fp16_at(block + offsetof(gguf::BlockQ4K, d));
    float const dmin = detail::fp16_at(block + offsetof(gguf::BlockQ4K, dmin));
    auto const* scales = reinterpret_cast<std::uint8_t const*>(block + offsetof(gguf::BlockQ4K, scales));
    std::byte const* const codes = block + offsetof(gguf::BlockQ4K, qs) + 4 * part;
    std::uint32_t const q = detail::load_u16(codes) | std::uint32_t{detail::load_u16(codes + 2)} << 16;
    for (int half = 0; half < 2; ++half) {
      gguf::Q4KScaleMin const sm = gguf::q4_k_scale_min(scales, 2 * (part / 8) + half);
      float const dj = d * static_cast<float>(sm.scale);
      float const mj = dmin * static_cast<float>(sm.min);
      for (int v = 0; v < 4; ++v) w[4 * half + v] = dj * static_cast<float>(q >> (8 * v + 4 * half) & 0xF) - mj;
    }
  }
};

/// q6_k (210 bytes, 256 values): 32 lanes per block. Lane p decodes values 128h + 32k + l + e
/// for k in 0..3, e in 0..1 (h = p / 16, l = 2 (p % 16)): two low-nibble bytes from each half
/// of ql's 64, two high-bit bytes from qh.
template <>
struct WarpBlocks<WeightFormat::kQ6K> {
  static constexpr int kLanesPerBlock = 32;
  static constexpr int kValues = 8;
  QFLASH_HD static constexpr int index(int part, int v) { return 128 * (part / 16) + 32 * (v / 2) + 2 * (part % 16) + v % 2; }
  QFLASH_HD static void decode(std::byte const* block, int part, float (&w)[kValues]) {
    int const h = part / 16, l = 2 * (part % 16);
    float const d = detail::fp16_at(block + offsetof(gguf::BlockQ6K, d));
    std::byte const* const low = block + offsetof(gguf::BlockQ6K, ql) + 64 * h + l;
    std::uint32_t const ql[2] = {detail::load_u16(low), detail::load_u16(low + 32)};
    std::uint32_t const qh = detail::load_u16(block + offsetof(gguf::BlockQ6K, qh) + 32 * h + l);
    auto const* sc = reinterpret_cast<std::int8_t const*>(block + offsetof(gguf::BlockQ6K, scales) + 8 * h + l / 16);
    for (int k = 0; k < 4; ++k) {
      float const dsc = d * static_cast<float>(sc[2 * k]);
      for (int e = 0; e < 2; ++e) {
        int const lo = static_cast<int>(ql[k % 2] >> (8 * e + 4 * (k / 2)) & 0xF);
        int const hi = static_cast<int>(qh >> (8 * e + 2 * k) & 3);
        w[2 * k + e] = dsc * static_cast<float>((lo | hi << 4) - 32);
      }
    }
  }
};

/// int4 group-128 (68 bytes, 128 values): 32 lanes per block, 4 consecutive values each. A
/// row's last block may be short: values at or past the row's end are zero codes, not values.
template <>
struct WarpBlocks<WeightFormat::kInt4> {
  static constexpr int kLanesPerBlock = 32;
  static constexpr int kValues = 4;
  QFLASH_HD static constexpr int index(int part, int v) { return 4 * part + v; }
  QFLASH_HD static void decode(std::byte const* block, int part, float (&w)[kValues]) {
    float const scale = detail::fp16_at(block + offsetof(BlockInt4G128, scale));
    float const min = detail::fp16_at(block + offsetof(BlockInt4G128, min));
    std::uint32_t const q = detail::load_u16(block + offsetof(BlockInt4G128, qs) + 2 * part);
    for (int v = 0; v < kValues; ++v) w[v] = scale * static_cast<float>(q >> (4 * v) & 0xF) + min;
  }
};

/// Blocks a warp decodes at once: 32 / kLanesPerBlock.
template <WeightFormat kF>
inline constexpr int kWarpBlocks = 32 / WarpBlocks<kF>::kLanesPerBlock;

}  // namespace qflash::kernels::linear_cuda
