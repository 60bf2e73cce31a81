/// @file
/// AMX tiles for bf16 weights (AMX-BF16) and q8_0 weights (AMX-INT8), arch::CpuIsa::kAmx, used
/// when a projection has at least kAmxMinTokens tokens (prefill, batched decode) and whole
/// 32-column chunks. Weights are read in place: an A tile is 16 weight rows at the matrix's
/// row stride; activations are packed once per call, per tile of 16 tokens; a pass holds
/// 2 A, 2 B and 4 C tiles (32 rows x 32 tokens).
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
/// One token stays on the row kernels: a token's sums in a batch of kAmxMinTokens or more
/// equal its one-token sums within fp32 rounding, not bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/common/cpu_simd.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::cpu {

using gguf::BlockQ8_0;

/// bf16 terms per fp32 activation.
inline constexpr int kAmxParts = 3;
/// Fewest tokens a projection runs on tiles with (fewer: the float tiles; a tile pads to 16).
inline constexpr std::int64_t kAmxMinTokens = 8;
/// Tokens, weight rows and columns of one tile.
inline constexpr std::int64_t kAmxTokens = 16, kAmxRows = 16, kAmxCols = 32;

/// True when rows of `cols` columns in format f times `n_tokens` tokens run on AMX tiles at `isa`.
inline bool amx_applies(arch::CpuIsa isa, WeightFormat f, std::int64_t cols, std::int64_t n_tokens) {
  return isa >= arch::CpuIsa::kAmx && (f == WeightFormat::kBf16 || f == WeightFormat::kQ8_0) &&
         cols % kAmxCols == 0 && n_tokens >= kAmxMinTokens;
}

/// Bytes of one q8_0 block of a token tile: 8 x 64 codes, then 16 fp32 scales.
inline constexpr std::int64_t kAmxQ8BlockBytes = 512 + 64;

/// Bytes the packed activations of n_tokens x cols take for weights in format f (tokens padded
/// to whole tiles).
inline std::int64_t amx_packed_bytes(WeightFormat f, std::int64_t n_tokens, std::int64_t cols) {
  std::int64_t const tiles = (n_tokens + kAmxTokens - 1) / kAmxTokens;
  if (f == WeightFormat::kQ8_0) return tiles * cols / kAmxCols * kAmxQ8BlockBytes;
  return tiles * kAmxTokens * cols * kAmxParts * 2;
}

/// Activations packed for the tiles of weights in `format`, per token tile j of 16 tokens:
/// bf16: part p, column chunk c is the 16 x 16 pairs at bf16(j, p) + c * 512;
/// q8_0: block c is 8 x 64 codes (4 per token) at q8(j, c), and its 16 scales after them.
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
};

#if QFLASH_HAS_X86_SIMD
#define QFLASH_TARGET_AMX                                                                                     \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile," \
                        "amx-bf16,amx-int8")))

QFLASH_SIMD_BEGIN

/// Token tile j (rows of x at x_of(t), t in [16 j, min(16 j + 16, n_tokens)); the rest zero)
/// of n_tokens x cols activations into `out` (AmxActivations' layout, this tile only).
template <class XOf>
QFLASH_TARGET_AMX void amx_pack_bf16_tile(XOf x_of, std::int64_t n_tokens, std::int64_t cols, std::int64_t j,
                                          bf16_bits* out) {
  std::int64_t const chunks = cols / kAmxCols;
  auto* words = reinterpret_cast<std::int32_t*>(out + j * kAmxParts * chunks * 512);
  __m512i const pair_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(16));
  // High halves of two registers' 32-bit lanes, in order: 32 bf16.
  __m512i const high_halves = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                               27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  std::int64_t const n_here = std::min(kAmxTokens, n_tokens - j * kAmxTokens);
  if (n_here < kAmxTokens) std::memset(words, 0, static_cast<std::size_t>(kAmxParts * chunks * 1024));
  for (std::int64_t n = 0; n < n_here; ++n) {
    float const* x = x_of(j * kAmxTokens + n);
    for (std::int64_t c = 0; c < chunks; ++c) {
      __m512 rest[2] = {_mm512_loadu_ps(x + c * kAmxCols), _mm512_loadu_ps(x + c * kAmxCols + 16)};
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
        __m512i const pairs = _mm512_permutex2var_epi16(bits[0], high_halves, bits[1]);
        std::int32_t* dst = words + ((part * chunks + c) * 256) + n;
        _mm512_i32scatter_epi32(dst, pair_rows, pairs, 4);
      }
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
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MR == 2) _tile_zero(2);
    if constexpr (MR == 2 && NT == 2) _tile_zero(3);
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
    _tile_stored(0, c[0], 64);
    if constexpr (NT == 2) _tile_stored(1, c[1], 64);
    if constexpr (MR == 2) _tile_stored(2, c[2], 64);
    if constexpr (MR == 2 && NT == 2) _tile_stored(3, c[3], 64);
  }
};

/// The 16 x 16 fp32 block `c` [row][token] transposed in place to [token][row].
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

/// Token tile j of q8_0 activation rows (x_of(t): nb = cols / 32 blocks) into `out`
/// (AmxActivations' q8_0 layout, this tile only; tokens past n_tokens zero).
template <class XOf>
QFLASH_TARGET_AMX void amx_pack_q8_tile(XOf x_of, std::int64_t n_tokens, std::int64_t nb, std::int64_t j,
                                        std::byte* out) {
  std::byte* tile = out + j * nb * kAmxQ8BlockBytes;
  std::int64_t const n_here = std::min(kAmxTokens, n_tokens - j * kAmxTokens);
  if (n_here < kAmxTokens) std::memset(tile, 0, static_cast<std::size_t>(nb * kAmxQ8BlockBytes));
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
      _tile_zero(0);
      if constexpr (NT == 2) _tile_zero(1);
      if constexpr (MR == 2) _tile_zero(2);
      if constexpr (MR == 2 && NT == 2) _tile_zero(3);
      _tile_loadd(4, wb + 2, row_bytes);
      if constexpr (MR == 2) _tile_loadd(5, wb + kAmxRows * row_bytes + 2, row_bytes);
      _tile_loadd(6, x.q8(j, b), 64);
      if constexpr (NT == 2) _tile_loadd(7, x.q8(j + 1, b), 64);
      _tile_dpbssd(0, 4, 6);
      if constexpr (NT == 2) _tile_dpbssd(1, 4, 7);
      if constexpr (MR == 2) _tile_dpbssd(2, 5, 6);
      if constexpr (MR == 2 && NT == 2) _tile_dpbssd(3, 5, 7);
      _tile_stored(0, c[0], 64);
      if constexpr (NT == 2) _tile_stored(1, c[1], 64);
      if constexpr (MR == 2) _tile_stored(2, c[2], 64);
      if constexpr (MR == 2 && NT == 2) _tile_stored(3, c[3], 64);
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
