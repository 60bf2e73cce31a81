/// @file
/// AMX tiles for bf16 weights (AMX-BF16) and q8_0, q4_k, q6_k and int4 weights (AMX-INT8),
/// arch::CpuIsa::kAmx, used when a projection has at least kAmxMinTokens tokens (prefill,
/// batched decode), kAmxMinRows rows and whole 32-column chunks. bf16 and q8_0 weights are
/// read in place (an A tile is 16 weight rows at the matrix's row stride); k-quant and int4
/// codes are unpacked to bytes per block of 16 rows. Activations are packed once per call, per tile of 16 tokens; a
/// pass holds 2 A, 2 B and 4 C tiles (32 rows x 32 tokens).
///
/// bf16: the fp32 activations are split into kAmxParts bf16 terms, x = hi + mid + lo (each
/// the rounded remainder of the one before; three cover fp32's 24-bit significand), in the
/// tiles' pair layout. Products of bf16 weights with bf16 terms are exact in fp32 and the
/// tiles accumulate in fp32, so a sum differs from the float tiles' only in the order of its
/// additions, never by rounding the activations to bf16.
///
/// q8_0: the activations' q8_0 blocks (the codes and scales the VNNI dot products use); one
/// TDPBSSD per 32-column block and tile gives exact int32 block sums, added into fp32 as
/// sum * (d_w * d_x) block after block.
///
/// q4_k, q6_k: the activations' q8_k blocks; one TDPBUSD per sub-block (32 / 16 columns), scaled
/// by its integer scale in int32, so each 256-column block's int32 sum is the VNNI kernel's
/// (AmxKQuantTiles).
///
/// int4: the activations' q8_0 pairs; one TDPBUSD per 32-column chunk, added into fp32 as
/// sum * (scale_w * d_x), and the group's min term (AmxInt4Tiles).
///
/// One token stays on the row kernels: a token's sums in a batch of kAmxMinTokens or more
/// equal its one-token sums within fp32 rounding, not bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/common/cpu_simd.hpp"
#include "qflash/kernels/linear/cpu_quant_avx512.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/int4.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::cpu {

using gguf::BlockQ4K;
using gguf::BlockQ6K;
using gguf::BlockQ8_0;
using gguf::BlockQ8K;

/// bf16 terms per fp32 activation.
inline constexpr int kAmxParts = 3;
/// Fewest tokens a projection runs on tiles with (fewer: the float tiles; a tile pads to 16).
inline constexpr std::int64_t kAmxMinTokens = 8;
/// Fewest output rows: packing the activations costs about as much as 50 rows of the row
/// kernels (bf16, 16 tokens of 192 columns: 1.7 us hot, 4.4 us in a decode step), so a
/// router, a gate or a small head projection skips it.
inline constexpr std::int64_t kAmxMinRows = 64;
/// Tokens, weight rows and columns of one tile.
inline constexpr std::int64_t kAmxTokens = 16, kAmxRows = 16, kAmxCols = 32;

/// True when `rows` rows of `cols` columns in format f times `n_tokens` tokens run on AMX
/// tiles at `isa`.
inline bool amx_applies(arch::CpuIsa isa, WeightFormat f, std::int64_t rows, std::int64_t cols, std::int64_t n_tokens) {
  bool const format = f == WeightFormat::kBf16 || f == WeightFormat::kQ8_0 || f == WeightFormat::kQ4K ||
                      f == WeightFormat::kQ6K || f == WeightFormat::kInt4;
  return isa >= arch::CpuIsa::kAmx && format && cols % kAmxCols == 0 && n_tokens >= kAmxMinTokens &&
         rows >= kAmxMinRows;
}

/// Bytes of one q8_0 block of a token tile: 8 x 64 codes, then 16 fp32 scales.
inline constexpr std::int64_t kAmxQ8BlockBytes = 512 + 64;
/// Bytes of one q8_k block of a token tile (for q4_k and q6_k rows): its 256 codes as 8 x 64
/// per 32 columns (so 4 x 64 per 16), the tokens' bsums as int16 pairs (pair p: bsums 2p and
/// 2p + 1, one dword per token), then 16 fp32 scales.
inline constexpr std::int64_t kAmxQ8KBlockBytes = 4096 + 8 * 64 + 64;
inline constexpr std::int64_t kAmxQ8KSums = 4096, kAmxQ8KScales = 4096 + 8 * 64;

/// Bytes of one token tile for int4 rows of `chunks` 32-column chunks: per chunk a q8_0 block
/// of the tile (kAmxQ8BlockBytes), then per group of 128 the tokens' fp32 activation sums.
inline std::int64_t amx_int4_tile_bytes(std::int64_t chunks) {
  return chunks * kAmxQ8BlockBytes + (chunks + 3) / 4 * 64;
}

/// Bytes the packed activations of n_tokens x cols take for weights in format f (tokens padded
/// to whole tiles).
inline std::int64_t amx_packed_bytes(WeightFormat f, std::int64_t n_tokens, std::int64_t cols) {
  std::int64_t const tiles = (n_tokens + kAmxTokens - 1) / kAmxTokens;
  if (f == WeightFormat::kQ8_0) return tiles * cols / kAmxCols * kAmxQ8BlockBytes;
  if (f == WeightFormat::kQ4K || f == WeightFormat::kQ6K)
    return tiles * cols / gguf::kQ4KBlockSize * kAmxQ8KBlockBytes;
  if (f == WeightFormat::kInt4) return tiles * amx_int4_tile_bytes(cols / kAmxCols);
  return tiles * kAmxTokens * cols * kAmxParts * 2;
}

/// Tokens of token tile j of n_tokens; a partial tile's `bytes` at `tile` are zeroed first, so
/// the tokens past n_tokens contribute nothing.
inline std::int64_t amx_tile_tokens(std::int64_t n_tokens, std::int64_t j, void* tile, std::int64_t bytes) {
  std::int64_t const n_here = std::min(kAmxTokens, n_tokens - j * kAmxTokens);
  if (n_here < kAmxTokens) std::memset(tile, 0, static_cast<std::size_t>(bytes));
  return n_here;
}

/// Activations packed for the tiles of weights in `format`, per token tile j of 16 tokens:
/// bf16: part p, column chunk c is the 16 x 16 pairs at bf16(j, p) + c * 512;
/// q8_0: block c is 8 x 64 codes (4 per token) at q8(j, c), and its 16 scales after them;
/// q4_k, q6_k: 256-column block b at q8k(j, b), laid out as kAmxQ8KBlockBytes says;
/// int4: chunk c at int4(j, c) as q8_0's block c (codes in the nibbles' order: the chunk's 16
/// even values, then its 16 odd ones), group g's activation sums at int4_sums(j, g).
struct AmxActivations {
  std::byte const* data = nullptr;
  std::int64_t chunks = 0;  ///< cols / 32
  WeightFormat format = WeightFormat::kAny;
  [[nodiscard]] bf16_bits const* bf16(std::int64_t j, int part) const {
    return reinterpret_cast<bf16_bits const*>(data) + (j * kAmxParts + part) * chunks * 512;
  }
  [[nodiscard]] std::byte const* q8(std::int64_t j, std::int64_t c) const {
    return data + (j * chunks + c) * kAmxQ8BlockBytes;
  }
  [[nodiscard]] std::byte const* q8k(std::int64_t j, std::int64_t b) const {
    return data + (j * (chunks / 8) + b) * kAmxQ8KBlockBytes;
  }
  [[nodiscard]] std::byte const* int4(std::int64_t j, std::int64_t c) const {
    return data + j * amx_int4_tile_bytes(chunks) + c * kAmxQ8BlockBytes;
  }
  [[nodiscard]] float const* int4_sums(std::int64_t j, std::int64_t g) const {
    return reinterpret_cast<float const*>(int4(j, chunks) + g * 64);
  }
};

#if QFLASH_HAS_X86_SIMD
#define QFLASH_TARGET_AMX                                                                                     \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile," \
                        "amx-bf16,amx-int8")))

QFLASH_SIMD_BEGIN

/// The 16 x 16 block `c` of 32-bit values (64-byte aligned) transposed in place: [i][j] to
/// [j][i]. Shuffles only, so any bits pass through (bf16 pairs too).
QFLASH_TARGET_AMX inline void amx_transpose16(float* c) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  // r[4 g + e], 128-bit lane l: column 4 l + e of rows [4 g, 4 g + 4); gather the lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_store_ps(c + 16 * i, r[i]);
}

/// Token tile j (rows of x at x_of(t), t in [16 j, min(16 j + 16, n_tokens)); the rest zero)
/// of n_tokens x cols activations into `out` (AmxActivations' layout, this tile only). Per
/// 32-column chunk, each token's 16 pairs per term go in as a row of a 16 x 16 block, which
/// one transpose turns into the tile's [pair][token] rows (a scatter per token and term was
/// twice as slow).
template <class XOf>
QFLASH_TARGET_AMX void amx_pack_bf16_tile(XOf x_of, std::int64_t n_tokens, std::int64_t cols, std::int64_t j,
                                          bf16_bits* out) {
  std::int64_t const chunks = cols / kAmxCols;
  auto* words = reinterpret_cast<std::int32_t*>(out + j * kAmxParts * chunks * 512);
  // High halves of two registers' 32-bit lanes, in order: 32 bf16.
  __m512i const high_halves = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                               27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  std::int64_t const n_here = std::min(kAmxTokens, n_tokens - j * kAmxTokens);
  alignas(64) float block[kAmxParts][256];
  for (std::int64_t c = 0; c < chunks; ++c) {
    for (std::int64_t n = 0; n < kAmxTokens; ++n) {
      if (n >= n_here) {
        for (auto& b : block) _mm512_store_si512(b + 16 * n, _mm512_setzero_si512());
        continue;
      }
      float const* x = x_of(j * kAmxTokens + n) + c * kAmxCols;
      __m512 rest[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
      for (int part = 0; part < kAmxParts; ++part) {
        __m512i bits[2];
        for (int h = 0; h < 2; ++h) {
          // Rounded to nearest, or truncated where that would round a finite value up to
          // infinity; the remainder is exact, and none is left past a NaN or infinity.
          __mmask16 const special = _mm512_fpclass_ps_mask(rest[h], 0x99);  // QNaN, SNaN, +-inf
          bits[h] = simd::avx512_round_bf16_hi(rest[h]);
          __mmask16 const overflow = _mm512_fpclass_ps_mask(simd::avx512_bf16_hi_value(bits[h]), 0x18) & ~special;
          bits[h] = _mm512_mask_mov_epi32(bits[h], overflow, _mm512_castps_si512(rest[h]));
          __m512 const term = simd::avx512_bf16_hi_value(bits[h]);
          rest[h] = _mm512_maskz_sub_ps(static_cast<__mmask16>(~special), rest[h], term);
        }
        _mm512_store_si512(block[part] + 16 * n, _mm512_permutex2var_epi16(bits[0], high_halves, bits[1]));
      }
    }
    for (int part = 0; part < kAmxParts; ++part) {
      amx_transpose16(block[part]);
      std::int32_t* dst = words + (part * chunks + c) * 256;
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512(dst + 16 * k, _mm512_load_si512(block[part] + 16 * k));
    }
  }
}

struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

/// Zeroes the C tiles a block<MR, NT> uses (tile 2 i + k: weight rows block i, tokens block k).
template <int MR, int NT>
QFLASH_TARGET_AMX QFLASH_SIMD_INLINE void amx_zero_c() {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MR == 2) _tile_zero(2);
  if constexpr (MR == 2 && NT == 2) _tile_zero(3);
}

/// Stores those C tiles to c[2 i + k] (16 rows of 64 bytes each).
template <int MR, int NT, class T>
QFLASH_TARGET_AMX QFLASH_SIMD_INLINE void amx_store_c(T (*c)[256]) {
  _tile_stored(0, c[0], 64);
  if constexpr (NT == 2) _tile_stored(1, c[1], 64);
  if constexpr (MR == 2) _tile_stored(2, c[2], 64);
  if constexpr (MR == 2 && NT == 2) _tile_stored(3, c[3], 64);
}

/// The tiles of one weight format, as amx_rows runs them: configure() loads the tile
/// configuration; block<MR, NT>(w, row_bytes, x, j, c) sets c[2 i + k] to the fp32 sums of
/// weight rows [16 i, 16 i + 16) (from w, row_bytes apart) times token tile j + k, i < MR,
/// k < NT, as c[..][row * 16 + token].
struct AmxBf16Tiles {
  /// Tiles 0-3: C (rows block i, tokens block k at 2 i + k); 4, 5: A; 6, 7: B. All 16 x 64 bytes.
  QFLASH_TARGET_AMX static void configure() {
    AmxTileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
  }

  template <int MR, int NT>
  QFLASH_TARGET_AMX static void block(std::byte const* weights, std::int64_t row_bytes, AmxActivations const& x,
                                      std::int64_t j, float (*c)[256]) {
    auto const* w = reinterpret_cast<bf16_bits const*>(weights);
    amx_zero_c<MR, NT>();
    std::int64_t const row_elems = row_bytes / 2;
    for (std::int64_t ch = 0; ch < x.chunks; ++ch) {
      _tile_loadd(4, w + ch * kAmxCols, row_bytes);
      if constexpr (MR == 2) _tile_loadd(5, w + kAmxRows * row_elems + ch * kAmxCols, row_bytes);
      for (int part = 0; part < kAmxParts; ++part) {
        _tile_loadd(6, x.bf16(j, part) + ch * 512, 64);
        if constexpr (NT == 2) _tile_loadd(7, x.bf16(j + 1, part) + ch * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
        if constexpr (MR == 2) _tile_dpbf16ps(2, 5, 6);
        if constexpr (MR == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    amx_store_c<MR, NT>(c);
  }
};

/// Token tile j of q8_0 activation rows (x_of(t): nb = cols / 32 blocks) into `out`
/// (AmxActivations' q8_0 layout, this tile only; tokens past n_tokens zero).
template <class XOf>
QFLASH_TARGET_AMX void amx_pack_q8_tile(XOf x_of, std::int64_t n_tokens, std::int64_t nb, std::int64_t j,
                                        std::byte* out) {
  std::byte* tile = out + j * nb * kAmxQ8BlockBytes;
  std::int64_t const n_here = amx_tile_tokens(n_tokens, j, tile, nb * kAmxQ8BlockBytes);
  for (std::int64_t n = 0; n < n_here; ++n) {
    BlockQ8_0 const* x = x_of(j * kAmxTokens + n);
    for (std::int64_t b = 0; b < nb; ++b) {
      std::byte* block = tile + b * kAmxQ8BlockBytes;
      for (int k = 0; k < 8; ++k) std::memcpy(block + k * 64 + n * 4, x[b].qs + 4 * k, 4);
      float const d = _cvtsh_ss(x[b].d.bits);
      std::memcpy(block + 512 + n * 4, &d, 4);
    }
  }
}

/// AmxBf16Tiles' twin for q8_0 rows (x packed as q8_0).
struct AmxQ8Tiles {
  /// Tiles 0-3: C (16 x 16 int32); 4, 5: A (16 weight rows x 32 codes); 6, 7: B (8 x 64 codes).
  QFLASH_TARGET_AMX static void configure() {
    AmxTileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.colsb[i] = i == 4 || i == 5 ? 32 : 64, cfg.rows[i] = i >= 6 ? 8 : 16;
    _tile_loadconfig(&cfg);
  }

  template <int MR, int NT>
  QFLASH_TARGET_AMX static void block(std::byte const* w, std::int64_t row_bytes, AmxActivations const& x,
                                      std::int64_t j, float (*acc)[256]) {
    alignas(64) std::int32_t c[4][256];
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 256; i += 16) _mm512_store_ps(acc[t] + i, _mm512_setzero_ps());
    for (std::int64_t b = 0; b < x.chunks; ++b) {
      std::byte const* wb = w + b * static_cast<std::int64_t>(sizeof(BlockQ8_0));
      amx_zero_c<MR, NT>();
      _tile_loadd(4, wb + 2, row_bytes);
      if constexpr (MR == 2) _tile_loadd(5, wb + kAmxRows * row_bytes + 2, row_bytes);
      _tile_loadd(6, x.q8(j, b), 64);
      if constexpr (NT == 2) _tile_loadd(7, x.q8(j + 1, b), 64);
      _tile_dpbssd(0, 4, 6);
      if constexpr (NT == 2) _tile_dpbssd(1, 4, 7);
      if constexpr (MR == 2) _tile_dpbssd(2, 5, 6);
      if constexpr (MR == 2 && NT == 2) _tile_dpbssd(3, 5, 7);
      amx_store_c<MR, NT>(c);
      for (int i = 0; i < MR; ++i)
        for (int k = 0; k < NT; ++k) {
          __m512 const dx = _mm512_loadu_ps(reinterpret_cast<float const*>(x.q8(j + k, b) + 512));
          for (int m = 0; m < kAmxRows; ++m) {
            Fp16 dw;
            std::memcpy(&dw, wb + (i * kAmxRows + m) * row_bytes, 2);
            float* a = acc[2 * i + k] + 16 * m;
            __m512 const sum = _mm512_cvtepi32_ps(_mm512_load_si512(c[2 * i + k] + 16 * m));
            __m512 const d = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(dw.bits)), dx);
            _mm512_store_ps(a, _mm512_fmadd_ps(sum, d, _mm512_load_ps(a)));
          }
        }
    }
  }
};

/// Token tile j of q8_k activation rows (x_of(t): nb blocks) into `out` (AmxActivations' q8_k
/// layout, this tile only; tokens past n_tokens zero).
template <class XOf>
QFLASH_TARGET_AMX void amx_pack_q8k_tile(XOf x_of, std::int64_t n_tokens, std::int64_t nb, std::int64_t j,
                                         std::byte* out) {
  std::byte* tile = out + j * nb * kAmxQ8KBlockBytes;
  std::int64_t const n_here = amx_tile_tokens(n_tokens, j, tile, nb * kAmxQ8KBlockBytes);
  for (std::int64_t n = 0; n < n_here; ++n) {
    BlockQ8K const* x = x_of(j * kAmxTokens + n);
    for (std::int64_t b = 0; b < nb; ++b) {
      std::byte* block = tile + b * kAmxQ8KBlockBytes;
      for (int k = 0; k < 64; ++k) std::memcpy(block + (k / 8) * 512 + (k % 8) * 64 + n * 4, x[b].qs + 4 * k, 4);
      for (int p = 0; p < 8; ++p) std::memcpy(block + kAmxQ8KSums + p * 64 + n * 4, x[b].bsums + 2 * p, 4);
      std::memcpy(block + kAmxQ8KScales + n * 4, &x[b].d, 4);
    }
  }
}

/// Token tile j of int4 activation rows (x_of(t): ActQ8Pair pairs, then group sums) of
/// `chunks` 32-column chunks into `out` (AmxActivations' int4 layout, this tile only; tokens
/// past n_tokens zero).
template <class XOf>
QFLASH_TARGET_AMX void amx_pack_int4_tile(XOf x_of, std::int64_t n_tokens, std::int64_t chunks, std::int64_t j,
                                          std::byte* out) {
  std::byte* tile = out + j * amx_int4_tile_bytes(chunks);
  std::int64_t const n_here = amx_tile_tokens(n_tokens, j, tile, amx_int4_tile_bytes(chunks));
  for (std::int64_t n = 0; n < n_here; ++n) {
    ActQ8Pair const* x = x_of(j * kAmxTokens + n);
    for (std::int64_t c = 0; c < chunks; ++c) {
      ActQ8Pair const& pair = x[c / 2];
      std::int64_t const half = 16 * (c % 2);
      std::byte* block = tile + c * kAmxQ8BlockBytes;
      for (int k = 0; k < 4; ++k) {
        std::memcpy(block + k * 64 + n * 4, pair.even + half + 4 * k, 4);
        std::memcpy(block + (k + 4) * 64 + n * 4, pair.odd + half + 4 * k, 4);
      }
      std::memcpy(block + 512 + n * 4, &pair.d[4 * (c % 2)], 4);
    }
    float const* sums = group_sums(x, (chunks + 1) / 2);
    for (std::int64_t g = 0; g < (chunks + 3) / 4; ++g)
      std::memcpy(tile + chunks * kAmxQ8BlockBytes + g * 64 + n * 4, sums + g, 4);
  }
}

/// AmxBf16Tiles' twin for int4 rows (x packed as AmxActivations' int4 layout): per group of
/// 128, the 16-row tiles' nibbles unpacked to bytes in the activations' order; one TDPBUSD per
/// 32-column chunk gives exact int32 sums, added into fp32 as sum * (d_x * scale_w), and per
/// group min_w * (the tokens' activation sums). Results differ from the VNNI kernel's by fp32
/// rounding.
struct AmxInt4Tiles {
  QFLASH_TARGET_AMX static void configure() { AmxQ8Tiles::configure(); }

  /// A 16-row tile's group: chunk q's codes at codes[row][32 q] (16 even values, then 16 odd).
  struct Rows {
    alignas(64) std::uint8_t codes[kAmxRows][128];
    alignas(64) float scale[kAmxRows], min[kAmxRows];
  };

  QFLASH_TARGET_AMX static void unpack(std::byte const* w, std::int64_t row_bytes, Rows& out) {
    __m512i const nibble = _mm512_set1_epi8(0x0f);
    // 128-bit lanes of the low (even) and high (odd) nibbles, interleaved
    __m512i const first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    __m512i const second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (std::int64_t m = 0; m < kAmxRows; ++m) {
      auto const& g = *reinterpret_cast<BlockInt4G128 const*>(w + m * row_bytes);
      __m512i const q = _mm512_loadu_si512(g.qs);
      __m512i const lo = _mm512_and_si512(q, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
      _mm512_store_si512(out.codes[m], _mm512_permutex2var_epi64(lo, first, hi));
      _mm512_store_si512(out.codes[m] + 64, _mm512_permutex2var_epi64(lo, second, hi));
      out.scale[m] = _cvtsh_ss(g.scale.bits);
      out.min[m] = _cvtsh_ss(g.min.bits);
    }
  }

  template <int MR, int NT>
  QFLASH_TARGET_AMX static void block(std::byte const* w, std::int64_t row_bytes, AmxActivations const& x,
                                      std::int64_t j, float (*acc)[256]) {
    Rows rows[MR];
    alignas(64) std::int32_t c[4][256];
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 256; i += 16) _mm512_store_ps(acc[t] + i, _mm512_setzero_ps());
    for (std::int64_t g = 0; g * 4 < x.chunks; ++g) {
      for (int i = 0; i < MR; ++i)
        unpack(w + i * kAmxRows * row_bytes + g * static_cast<std::int64_t>(sizeof(BlockInt4G128)), row_bytes, rows[i]);
      for (std::int64_t ch = 4 * g; ch < std::min(x.chunks, 4 * g + 4); ++ch) {
        amx_zero_c<MR, NT>();
        _tile_loadd(4, rows[0].codes[0] + 32 * (ch % 4), 128);
        if constexpr (MR == 2) _tile_loadd(5, rows[MR - 1].codes[0] + 32 * (ch % 4), 128);
        _tile_loadd(6, x.int4(j, ch), 64);
        if constexpr (NT == 2) _tile_loadd(7, x.int4(j + 1, ch), 64);
        _tile_dpbusd(0, 4, 6);
        if constexpr (NT == 2) _tile_dpbusd(1, 4, 7);
        if constexpr (MR == 2) _tile_dpbusd(2, 5, 6);
        if constexpr (MR == 2 && NT == 2) _tile_dpbusd(3, 5, 7);
        amx_store_c<MR, NT>(c);
        for (int k = 0; k < NT; ++k) {
          __m512 const dx = _mm512_loadu_ps(reinterpret_cast<float const*>(x.int4(j + k, ch) + 512));
          for (int i = 0; i < MR; ++i)
            for (int m = 0; m < kAmxRows; ++m) {
              float* a = acc[2 * i + k] + 16 * m;
              __m512 const sum = _mm512_cvtepi32_ps(_mm512_load_si512(c[2 * i + k] + 16 * m));
              _mm512_store_ps(a, _mm512_fmadd_ps(sum, _mm512_mul_ps(dx, _mm512_set1_ps(rows[i].scale[m])),
                                                 _mm512_load_ps(a)));
            }
        }
      }
      for (int k = 0; k < NT; ++k) {
        __m512 const sums = _mm512_loadu_ps(x.int4_sums(j + k, g));
        for (int i = 0; i < MR; ++i)
          for (int m = 0; m < kAmxRows; ++m) {
            float* a = acc[2 * i + k] + 16 * m;
            _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(rows[i].min[m]), sums, _mm512_load_ps(a)));
          }
      }
    }
  }
};

/// The q4_k side of AmxKQuantTiles: sub-blocks of 32 with 6-bit scales and mins.
struct AmxQ4K {
  using Block = BlockQ4K;
  static constexpr int kSubBlocks = 8, kSubCols = 32;
  /// Unpacked codes keep the code registers' order: register h (bytes 64h..64h+63) gives
  /// sub-blocks 4h, 4h + 2 (low nibbles), then 4h + 1, 4h + 3 (high nibbles).
  static constexpr int code_offset(int s) { return 128 * (s / 4) + (s % 2) * 64 + ((s / 2) % 2) * 32; }

  /// A 16-row tile's block: codes as bytes, each sub-block's scale (int32), its min twice as
  /// an int16 pair (against a pair of 16-code sums), d and dmin.
  struct Rows {
    alignas(64) std::uint8_t codes[kAmxRows][256];
    alignas(64) std::int32_t scale[kAmxRows][kSubBlocks];
    alignas(64) std::int32_t min_pair[kAmxRows][kSubBlocks];
    float d[kAmxRows], dmin[kAmxRows];
  };

  QFLASH_TARGET_AMX static void unpack(std::byte const* w, std::int64_t row_bytes, Rows& out) {
    __m512i const nibble = _mm512_set1_epi8(0x0f);
    for (std::int64_t m = 0; m < kAmxRows; ++m) {
      auto const& wb = *reinterpret_cast<BlockQ4K const*>(w + m * row_bytes);
      for (int h = 0; h < 2; ++h) {
        __m512i const q = _mm512_loadu_si512(wb.qs + 64 * h);
        _mm512_store_si512(out.codes[m] + 128 * h, _mm512_and_si512(q, nibble));
        _mm512_store_si512(out.codes[m] + 128 * h + 64, _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble));
      }
      out.d[m] = _cvtsh_ss(wb.d.bits);
      out.dmin[m] = _cvtsh_ss(wb.dmin.bits);
    }
    for (std::int64_t g = 0; g < kAmxRows; g += 4) {
      __m512i packed = _mm512_setzero_si512();  // four rows' 12 scale bytes, one per 128-bit lane
      for (int r = 0; r < 4; ++r) {
        auto const& wb = *reinterpret_cast<BlockQ4K const*>(w + (g + r) * row_bytes);
        packed = _mm512_mask_broadcast_i32x4(packed, static_cast<__mmask16>(0xf << (4 * r)),
                                             _mm_loadu_si128(reinterpret_cast<__m128i const*>(wb.scales)));
      }
      alignas(64) std::uint8_t bytes[4][16];  // per row: 8 scales, 8 mins
      _mm512_store_si512(bytes, avx512_q4_k_scales(packed));
      for (int r = 0; r < 4; ++r) {
        __m128i const row = _mm_load_si128(reinterpret_cast<__m128i const*>(bytes[r]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out.scale[g + r]), _mm256_cvtepu8_epi32(row));
        __m256i const min = _mm256_cvtepu8_epi32(_mm_srli_si128(row, 8));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out.min_pair[g + r]),
                           _mm256_or_si256(min, _mm256_slli_epi32(min, 16)));
      }
    }
  }

  /// acc - d_x dmin sum_s m_s (bsums 2s + 2s+1) + d_x d sum, for row m and 16 tokens.
  QFLASH_TARGET_AMX QFLASH_SIMD_INLINE static __m512 finish(__m512 acc, Rows const& rows, int m, __m512i sum,
                                                            __m512i const* bsum_pairs, __m512 dx) {
    __m512i mins = _mm512_setzero_si512();
    for (int s = 0; s < kSubBlocks; ++s)
      mins = _mm512_dpwssd_epi32(mins, _mm512_set1_epi32(rows.min_pair[m][s]), bsum_pairs[s]);
    acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(_mm512_set1_ps(rows.dmin[m]), dx), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(rows.d[m]), dx), acc);
  }
};

/// The q6_k side of AmxKQuantTiles: sub-blocks of 16 with int8 scales; codes are q + 32.
struct AmxQ6K {
  using Block = BlockQ6K;
  static constexpr int kSubBlocks = 16, kSubCols = 16;
  /// Unpacked codes are in value order.
  static constexpr int code_offset(int g) { return 16 * g; }

  /// A 16-row tile's block: codes (q + 32) as bytes, each sub-block's scale as int32 and as
  /// int16 pairs (sub-blocks 2p, 2p + 1: against a pair of 16-code sums), and d.
  struct Rows {
    alignas(64) std::uint8_t codes[kAmxRows][256];
    alignas(64) std::int32_t scale[kAmxRows][kSubBlocks];
    alignas(64) std::int32_t scale_pair[kAmxRows][kSubBlocks / 2];
    float d[kAmxRows];
  };

  QFLASH_TARGET_AMX static void unpack(std::byte const* w, std::int64_t row_bytes, Rows& out) {
    __m512i const nibble = _mm512_set1_epi8(0x0f), two_bits = _mm512_set1_epi8(0x03);
    // Per 256-bit half: the shift of the high bits in qh for the low nibbles (k = 0, 1) and
    // the high ones (k = 2, 3).
    __m512i const shift_low = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m512i const shift_high = _mm512_add_epi16(shift_low, _mm512_set1_epi16(4));
    for (std::int64_t m = 0; m < kAmxRows; ++m) {
      auto const& wb = *reinterpret_cast<BlockQ6K const*>(w + m * row_bytes);
      for (int h = 0; h < 2; ++h) {
        __m512i const ql = _mm512_loadu_si512(wb.ql + 64 * h);  // values 128h + l, 128h + 32 + l (+64: high nibbles)
        __m512i const qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(wb.qh + 32 * h)));
        __m512i const high_low = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_low), two_bits), 4);
        __m512i const high_high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_high), two_bits), 4);
        _mm512_store_si512(out.codes[m] + 128 * h, _mm512_or_si512(_mm512_and_si512(ql, nibble), high_low));
        _mm512_store_si512(out.codes[m] + 128 * h + 64,
                           _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble), high_high));
      }
      __m128i const scales = _mm_loadu_si128(reinterpret_cast<__m128i const*>(wb.scales));
      _mm512_store_si512(out.scale[m], _mm512_cvtepi8_epi32(scales));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out.scale_pair[m]), _mm256_cvtepi8_epi16(scales));
      out.d[m] = _cvtsh_ss(wb.d.bits);
    }
  }

  /// acc + d_x d (sum - 32 sum_g s_g bsums_g), for row m and 16 tokens.
  QFLASH_TARGET_AMX QFLASH_SIMD_INLINE static __m512 finish(__m512 acc, Rows const& rows, int m, __m512i sum,
                                                            __m512i const* bsum_pairs, __m512 dx) {
    __m512i offset = _mm512_setzero_si512();
    for (int p = 0; p < kSubBlocks / 2; ++p)
      offset = _mm512_dpwssd_epi32(offset, _mm512_set1_epi32(rows.scale_pair[m][p]), bsum_pairs[p]);
    sum = _mm512_sub_epi32(sum, _mm512_slli_epi32(offset, 5));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(rows.d[m]), dx), acc);
  }
};

/// AmxBf16Tiles' twin for the k-quants Q (AmxQ4K, AmxQ6K) against q8_k activations. Per
/// 256-column block the 16-row tiles' codes are unpacked to bytes (Q::unpack); one TDPBUSD per
/// sub-block gives its exact int32 sums, scaled by the sub-block's integer scale in int32, so a
/// block's sum is the exact int32 the VNNI kernel forms in its lanes; Q::finish adds the mins or
/// offset term and the block into fp32. Results differ from the VNNI kernel's by fp32 rounding.
template <class Q>
struct AmxKQuantTiles {
  /// Tiles 0-3: C (16 x 16 int32); 4, 5: A (16 rows x kSubCols codes); 6, 7: B (kSubCols / 4 x 64).
  QFLASH_TARGET_AMX static void configure() {
    AmxTileConfig cfg;
    for (int i = 0; i < 8; ++i) {
      cfg.colsb[i] = i == 4 || i == 5 ? Q::kSubCols : 64;
      cfg.rows[i] = i >= 6 ? Q::kSubCols / 4 : 16;
    }
    _tile_loadconfig(&cfg);
  }

  template <int MR, int NT>
  QFLASH_TARGET_AMX static void block(std::byte const* w, std::int64_t row_bytes, AmxActivations const& x,
                                      std::int64_t j, float (*acc)[256]) {
    typename Q::Rows rows[MR];
    alignas(64) std::int32_t c[4][256], sums[4][256];
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 256; i += 16) _mm512_store_ps(acc[t] + i, _mm512_setzero_ps());
    for (std::int64_t b = 0; b < x.chunks / 8; ++b) {
      for (int i = 0; i < MR; ++i)
        Q::unpack(w + i * kAmxRows * row_bytes + b * static_cast<std::int64_t>(sizeof(typename Q::Block)), row_bytes,
                  rows[i]);
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < 256; i += 16) _mm512_store_si512(sums[t] + i, _mm512_setzero_si512());
      for (int g = 0; g < Q::kSubBlocks; ++g) {
        amx_zero_c<MR, NT>();
        _tile_loadd(4, rows[0].codes[0] + Q::code_offset(g), 256);
        if constexpr (MR == 2) _tile_loadd(5, rows[MR - 1].codes[0] + Q::code_offset(g), 256);
        _tile_loadd(6, x.q8k(j, b) + g * Q::kSubCols * 16, 64);
        if constexpr (NT == 2) _tile_loadd(7, x.q8k(j + 1, b) + g * Q::kSubCols * 16, 64);
        _tile_dpbusd(0, 4, 6);
        if constexpr (NT == 2) _tile_dpbusd(1, 4, 7);
        if constexpr (MR == 2) _tile_dpbusd(2, 5, 6);
        if constexpr (MR == 2 && NT == 2) _tile_dpbusd(3, 5, 7);
        amx_store_c<MR, NT>(c);
        for (int i = 0; i < MR; ++i)
          for (int k = 0; k < NT; ++k)
            for (int m = 0; m < kAmxRows; ++m) {
              std::int32_t* sum = sums[2 * i + k] + 16 * m;
              __m512i const scaled =
                  _mm512_mullo_epi32(_mm512_load_si512(c[2 * i + k] + 16 * m), _mm512_set1_epi32(rows[i].scale[m][g]));
              _mm512_store_si512(sum, _mm512_add_epi32(_mm512_load_si512(sum), scaled));
            }
      }
      for (int k = 0; k < NT; ++k) {
        std::byte const* xb = x.q8k(j + k, b);
        __m512 const dx = _mm512_loadu_ps(reinterpret_cast<float const*>(xb + kAmxQ8KScales));
        __m512i bsum_pairs[8];
        for (int p = 0; p < 8; ++p) bsum_pairs[p] = _mm512_loadu_si512(xb + kAmxQ8KSums + 64 * p);
        for (int i = 0; i < MR; ++i)
          for (int m = 0; m < kAmxRows; ++m) {
            float* a = acc[2 * i + k] + 16 * m;
            __m512i const sum = _mm512_load_si512(sums[2 * i + k] + 16 * m);
            _mm512_store_ps(a, Q::finish(_mm512_load_ps(a), rows[i], m, sum, bsum_pairs, dx));
          }
      }
    }
  }
};

/// Rows [0, rows) of matrix w (rows a multiple of 16, row_bytes apart) in the format of Tiles
/// (AmxBf16Tiles, AmxQ8Tiles) times the first n_tokens tokens packed in x: store(t, r, v) gets
/// token t's sums of rows [r, r + 16), v[0..16). Two token tiles per pass over the rows, whose
/// weights stay in cache between passes.
template <class Tiles, class Store>
QFLASH_TARGET_AMX void amx_rows(std::byte const* w, std::int64_t row_bytes, std::int64_t rows, AmxActivations const& x,
                                std::int64_t n_tokens, Store&& store) {
  Tiles::configure();
  alignas(64) float c[4][256];
  std::int64_t const tiles = (n_tokens + kAmxTokens - 1) / kAmxTokens;
  for (std::int64_t j = 0; j < tiles; j += 2) {
    int const nt = j + 1 < tiles ? 2 : 1;
    for (std::int64_t r = 0; r < rows; r += 2 * kAmxRows) {
      int const mr = r + 2 * kAmxRows <= rows ? 2 : 1;
      std::byte const* wr = w + r * row_bytes;
      if (mr == 2 && nt == 2)
        Tiles::template block<2, 2>(wr, row_bytes, x, j, c);
      else if (mr == 2)
        Tiles::template block<2, 1>(wr, row_bytes, x, j, c);
      else if (nt == 2)
        Tiles::template block<1, 2>(wr, row_bytes, x, j, c);
      else
        Tiles::template block<1, 1>(wr, row_bytes, x, j, c);
      for (int i = 0; i < mr; ++i)
        for (int k = 0; k < nt; ++k) {
          float* block = c[2 * i + k];
          amx_transpose16(block);
          for (std::int64_t n = 0; n < kAmxTokens; ++n) {
            std::int64_t const t = (j + k) * kAmxTokens + n;
            if (t < n_tokens) store(t, r + i * kAmxRows, block + n * 16);
          }
        }
    }
  }
  _tile_release();
}

QFLASH_SIMD_END
#endif  // QFLASH_HAS_X86_SIMD

}  // namespace qflash::kernels::cpu
