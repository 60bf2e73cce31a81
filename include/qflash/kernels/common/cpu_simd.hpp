/// @file
/// x86 SIMD helpers for CPU kernels: load fp32 or bf16 into fp32 lanes, store fp32 lanes as
/// fp32 or bf16 (round to nearest even, NaN kept), masked/partial tails, horizontal sums.
///
/// Nothing here needs global `-mavx2`/`-mavx512f`: each helper carries a function target
/// attribute, and a kernel that calls them carries the same attribute (QFLASH_TARGET_AVX2 /
/// QFLASH_TARGET_AVX512), so one binary holds every level and picks one at run time
/// (arch::cpu_isa()). GCC inlines a target function only into callers with the same or a
/// wider target, and lambdas do not inherit their enclosing function's target: keep
/// intrinsics in named functions that carry the attribute.
///
/// The bf16 conversions are integer arithmetic rather than AVX512_BF16 `vcvtneps2bf16`,
/// which treats subnormal inputs as zero: this way every ISA path rounds exactly like
/// `float_to_bf16` (bf16_bits.hpp), and a bf16 result is the same bits on every path.
#pragma once

#include <cstdint>
#include <cstring>

#include "qflash/kernels/common/bf16_bits.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QFLASH_HAS_X86_SIMD 1
// GCC 12 reports -Wmaybe-uninitialized and -Wuninitialized inside its own AVX-512 headers once
// intrinsics are inlined at -O2+ (the `__Y = __Y` idiom of _mm512_undefined_*, GCC PR105593,
// fixed in 12.3).
// GCC checks the pragma state both at the header's lines and along the inlining chain: silence
// it around the include (when this is the first to include it) and, with QFLASH_SIMD_BEGIN /
// QFLASH_SIMD_END, around code that calls intrinsics (when something included it before).
#if defined(__clang__)
#include <immintrin.h>
#define QFLASH_SIMD_BEGIN
#define QFLASH_SIMD_END
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define QFLASH_SIMD_BEGIN                                                                          \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define QFLASH_SIMD_END _Pragma("GCC diagnostic pop")
#endif
#else
#define QFLASH_HAS_X86_SIMD 0
#endif

namespace qflash::kernels::simd {
/// Asks for [p, p + bytes) to be brought into the L1 cache, a line at a time: for data the
/// hardware prefetchers do not follow, or not early enough.
inline void prefetch_bytes(void const* p, std::int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  for (std::int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<char const*>(p) + i, 0, 3);
#else
  (void)p;
  (void)bytes;
#endif
}
}  // namespace qflash::kernels::simd

#if QFLASH_HAS_X86_SIMD

/// AVX2 + FMA + F16C (arch::CpuIsa::kAvx2).
#define QFLASH_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
/// AVX2 plus AVX-VNNI (256-bit vpdpbusd; arch::avx_vnni()).
#define QFLASH_TARGET_AVX_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
/// AVX-512 F/BW/VL/DQ on top of AVX2 (arch::CpuIsa::kAvx512).
#define QFLASH_TARGET_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
/// AVX-512 plus VNNI (arch::CpuIsa::kAvx512Vnni).
#define QFLASH_TARGET_AVX512_VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define QFLASH_SIMD_INLINE inline __attribute__((always_inline))

QFLASH_SIMD_BEGIN
namespace qflash::kernels::simd {

// ---- AVX-512: 16 fp32 lanes ---------------------------------------------------------------

/// Lane mask with the low `n` bits set, n in [0, 16].
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __mmask16 avx512_tail_mask(int n) {
  return static_cast<__mmask16>((1u << n) - 1u);
}

QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_load(float const* p) {
  return _mm512_loadu_ps(p);
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_load(bf16_bits const* p) {
  __m256i const h = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/// Masked-off lanes read as 0 and are not touched in memory.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_load(float const* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_load(bf16_bits const* p, __mmask16 m) {
  __m256i const h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/// fp32 lanes rounded to bf16 (nearest even, NaN quieted: see float_to_bf16), the bf16 bits
/// in the upper half of each 32-bit lane; the lower half is garbage.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_round_bf16_hi(__m512 v) {
  __m512i const u = _mm512_castps_si512(v);
  __m512i const lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i const rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 const nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x00400000));
}
/// The fp32 value of avx512_round_bf16_hi's bits (the lower half cleared).
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_bf16_hi_value(__m512i bits) {
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

/// 16 fp32 -> 16 bf16 bit patterns, round to nearest even, NaN quieted (see float_to_bf16).
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m256i avx512_to_bf16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(avx512_round_bf16_hi(v), 16));
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void avx512_store(float* p, __m512 v) {
  _mm512_storeu_ps(p, v);
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void avx512_store(bf16_bits* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), avx512_to_bf16(v));
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void avx512_store(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void avx512_store(bf16_bits* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, avx512_to_bf16(v));
}

/// Stores `v` as T and returns the stored values widened back to fp32 (identity for fp32).
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_store_rounded(float* p, __m512 v) {
  _mm512_storeu_ps(p, v);
  return v;
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_store_rounded(bf16_bits* p, __m512 v) {
  __m256i const h = avx512_to_bf16(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  return avx512_from_bf16(h);
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_store_rounded(float* p, __m512 v,
                                                                   __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
  return v;
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_store_rounded(bf16_bits* p, __m512 v,
                                                                   __mmask16 m) {
  __m256i const h = avx512_to_bf16(v);
  _mm256_mask_storeu_epi16(p, m, h);
  return avx512_from_bf16(h);
}

// ---- AVX-512, 32 bf16 at a time as even/odd fp32 halves ------------------------------------
// A bf16 sits in the upper half of an fp32, so 32 bf16 in one 512-bit register widen with one
// shift (even elements) and one mask (odd elements), and narrow back with one shift and one
// word blend: half the work of converting 16 at a time through vpmovzxwd / vpmovdw. Element
// order within a pair is interleaved; elementwise math and sums do not care.

/// 64 bytes: 32 from `lo`, then 32 from `hi`.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_join(void const* lo, void const* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(static_cast<__m256i const*>(lo))),
                            _mm256_loadu_si256(static_cast<__m256i const*>(hi)), 1);
}
/// 32 bytes from `p`, then 32 zero bytes.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_low(void const* p) {
  return _mm512_zextsi256_si512(_mm256_loadu_si256(static_cast<__m256i const*>(p)));
}
/// int32 lanes 0-7 hold `lo`, lanes 8-15 `hi`.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_halves_epi32(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi32(lo), _mm256_set1_epi32(hi), 1);
}
/// int16 lanes 0-15 hold `lo`, lanes 16-31 `hi`.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_halves_epi16(short lo, short hi) {
  return _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1);
}

/// Elements 2i (even) and 2i+1 (odd), i in [0, 16), of 32 consecutive elements, as fp32.
struct Avx512Pair {
  __m512 even;
  __m512 odd;
};

QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Avx512Pair avx512_widen_pair(__m512i v) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Avx512Pair avx512_load_pair(bf16_bits const* p) {
  return avx512_widen_pair(_mm512_loadu_si512(p));
}
/// Masked-off elements read as 0 and are not touched in memory.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Avx512Pair avx512_load_pair(bf16_bits const* p, __mmask32 m) {
  return avx512_widen_pair(_mm512_maskz_loadu_epi16(m, p));
}
/// fp32 sources are de-interleaved with two permutes.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Avx512Pair avx512_split_pair(__m512 lo, __m512 hi) {
  __m512i const even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  __m512i const odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return {_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi)};
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Avx512Pair avx512_load_pair(float const* p) {
  return avx512_split_pair(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16));
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Avx512Pair avx512_load_pair(float const* p, __mmask32 m) {
  return avx512_split_pair(_mm512_maskz_loadu_ps(static_cast<__mmask16>(m), p),
                           _mm512_maskz_loadu_ps(static_cast<__mmask16>(m >> 16), p + 16));
}

/// Stores 32 bf16 from avx512_round_bf16_hi bits of the even and odd elements.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_join_pair(__m512i even_hi, __m512i odd_hi) {
  return _mm512_mask_blend_epi16(static_cast<__mmask32>(0xaaaaaaaau), _mm512_srli_epi32(even_hi, 16), odd_hi);
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void avx512_store_pair(bf16_bits* p, __m512i even_hi,
                                                              __m512i odd_hi) {
  _mm512_storeu_si512(p, avx512_join_pair(even_hi, odd_hi));
}
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void avx512_store_pair(bf16_bits* p, __m512i even_hi,
                                                              __m512i odd_hi, __mmask32 m) {
  _mm512_mask_storeu_epi16(p, m, avx512_join_pair(even_hi, odd_hi));
}

// ---- AVX2: 8 fp32 lanes -------------------------------------------------------------------

QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_load(float const* p) {
  return _mm256_loadu_ps(p);
}
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_load(bf16_bits const* p) {
  __m128i const h = _mm_loadu_si128(reinterpret_cast<__m128i const*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/// 8 fp32 -> 8 bf16 bit patterns, round to nearest even, NaN quieted.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m128i avx2_to_bf16(__m256 v) {
  __m256i const u = _mm256_castps_si256(v);
  __m256i const lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i const rounded =
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  __m256i const quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  __m256i const nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  __m256i const bits = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
  // Values are <= 0xffff, so the unsigned saturating pack is exact.
  return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_from_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void avx2_store(float* p, __m256 v) {
  _mm256_storeu_ps(p, v);
}
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void avx2_store(bf16_bits* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), avx2_to_bf16(v));
}
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_store_rounded(float* p, __m256 v) {
  _mm256_storeu_ps(p, v);
  return v;
}
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_store_rounded(bf16_bits* p, __m256 v) {
  __m128i const h = avx2_to_bf16(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  return avx2_from_bf16(h);
}

/// AVX2 has no 16-bit masked moves: tails of n < 8 elements go through a zeroed buffer.
template <class T>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_load_partial(T const* p, int n) {
  T buf[8] = {};
  std::memcpy(buf, p, static_cast<std::size_t>(n) * sizeof(T));
  return avx2_load(buf);
}
template <class T>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void avx2_store_partial(T* p, __m256 v, int n) {
  T buf[8];
  avx2_store(buf, v);
  std::memcpy(p, buf, static_cast<std::size_t>(n) * sizeof(T));
}
template <class T>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_store_rounded_partial(T* p, __m256 v, int n) {
  T buf[8];
  __m256 const r = avx2_store_rounded(buf, v);
  std::memcpy(p, buf, static_cast<std::size_t>(n) * sizeof(T));
  return r;
}

/// Sum of the 8 lanes in a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7)).
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE float avx2_reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// Lane j: avx2_reduce_add(v[j]), bit for bit (the same pairs added in the same order), for
/// 8 vectors at once in 7 adds.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_reduce_add8(__m256 const* v) {
  // [j | j + 4]: lanes k + (k + 4) of v[j] in the low half, of v[j + 4] in the high half.
  __m256 h[4];
  for (int j = 0; j < 4; ++j)
    h[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20), _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
  // [j, j + 1 | j + 4, j + 5]: their (0 + 2) and (1 + 3) pairs.
  __m256 const q01 = _mm256_add_ps(_mm256_shuffle_ps(h[0], h[1], 0x44), _mm256_shuffle_ps(h[0], h[1], 0xee));
  __m256 const q23 = _mm256_add_ps(_mm256_shuffle_ps(h[2], h[3], 0x44), _mm256_shuffle_ps(h[2], h[3], 0xee));
  // [0, 1, 2, 3 | 4, 5, 6, 7]: (0 + 2) + (1 + 3).
  return _mm256_add_ps(_mm256_shuffle_ps(q01, q23, 0x88), _mm256_shuffle_ps(q01, q23, 0xdd));
}

/// 8 e4m3 bytes as fp32 times `scale`, equal to to_float(Fp8E4m3) * scale: a byte's exponent
/// and mantissa bits become an fp16's (exponent bias 15 for 7, so the value / 256; e4m3's
/// subnormals are fp16 subnormals, which F16C converts exactly), and the one e4m3 NaN
/// pattern an fp16 NaN; `scale256` is 256 * scale, an exact power-of-two product.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_fp8x8(std::uint8_t const* p, __m256 scale256) {
  __m128i const b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
  __m128i const mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7c00)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), scale256);
}


/// 16 e4m3 bytes as fp32 times `scale`, as avx2_fp8x8 (`scale256` = 256 * scale).
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_fp8x16(std::uint8_t const* p, __m512 scale256) {
  __m256i const b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  __m256i const mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
  __m256i const h =
      _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  __mmask16 const nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_mask_blend_epi16(nan, h, _mm256_or_si256(h, _mm256_set1_epi16(0x7c00)))),
                       scale256);
}

}  // namespace qflash::kernels::simd
QFLASH_SIMD_END

#else
#define QFLASH_SIMD_BEGIN
#define QFLASH_SIMD_END
#endif  // QFLASH_HAS_X86_SIMD
