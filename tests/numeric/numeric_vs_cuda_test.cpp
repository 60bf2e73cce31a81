// Our software conversions against CUDA's own host implementations in <cuda_fp8.h>,
// <cuda_fp16.h> and <cuda_bf16.h>: those functions are __host__ __device__ and compile with
// g++ alone, so no GPU is needed. On sm_89+ devices CUDA uses PTX `cvt` instead of this host
// code; the host code is what we can pin down here.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "numeric/float_cases.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/fp8.hpp"

using namespace qflash;
using detail::bits_of;

namespace {

std::uint32_t cuda_fp8_to_float_bits(std::uint8_t code, __nv_fp8_interpretation_t kind) {
  __half_raw const h = __nv_cvt_fp8_to_halfraw(code, kind);
  return bits_of(__half2float(__half(h)));
}

std::uint16_t cuda_half_bits(__half h) { return static_cast<__half_raw>(h).x; }
std::uint16_t cuda_bf16_bits(__nv_bfloat16 h) { return static_cast<__nv_bfloat16_raw>(h).x; }

}  // namespace

TEST_CASE("fp8 vs cuda_fp8.h: all 256 codes decode to the same fp32 bits") {
  for (std::uint32_t c = 0; c < 256; ++c) {
    CAPTURE(c);
    auto const code = static_cast<std::uint8_t>(c);
    CHECK(bits_of(to_float(Fp8E4m3{code})) == cuda_fp8_to_float_bits(code, __NV_E4M3));
    CHECK(bits_of(to_float(Fp8E5m2{code})) == cuda_fp8_to_float_bits(code, __NV_E5M2));
  }
}

TEST_CASE("fp8 vs cuda_fp8.h: 10M floats encode to the same bits, both formats and saturations") {
  // Half the inputs probe e4m3's ties and boundaries, half e5m2's; every input goes through
  // all four conversions, so each format also sees the other's (harder) inputs.
  test::FloatCases cases_e4m3(detail::kFp8E4m3Format, 0xC0DA8E4);
  test::FloatCases cases_e5m2(detail::kFp8E5m2Format, 0xC0DA8E5);
  constexpr int kN = 10'000'000;
  int n_bad = 0;
  for (int i = 0; i < kN; ++i) {
    float const x = (i & 1) != 0 ? cases_e4m3.next() : cases_e5m2.next();
    std::uint8_t const got[4] = {to_fp8_e4m3(x).bits, to_fp8_e4m3(x, Fp8Saturation::kNoSat).bits,
                                 to_fp8_e5m2(x).bits, to_fp8_e5m2(x, Fp8Saturation::kNoSat).bits};
    std::uint8_t const want[4] = {__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3),
                                  __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E4M3),
                                  __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2),
                                  __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2)};
    for (int k = 0; k < 4; ++k) {
      if (got[k] != want[k] && ++n_bad <= 8) {
        CAPTURE(bits_of(x));
        CAPTURE(k);  // 0 e4m3 sat, 1 e4m3 nosat, 2 e5m2 sat, 3 e5m2 nosat
        CHECK(static_cast<int>(got[k]) == static_cast<int>(want[k]));
      }
    }
  }
  CHECK(n_bad == 0);
}

TEST_CASE("fp16 vs cuda_fp16.h: every code decodes, and random floats encode, to the same bits") {
  for (std::uint32_t c = 0; c < 65536; ++c) {
    __half_raw raw;
    raw.x = static_cast<unsigned short>(c);
    if (bits_of(to_float(Fp16{static_cast<std::uint16_t>(c)})) !=
        bits_of(__half2float(__half(raw)))) {
      CAPTURE(c);
      CHECK(bits_of(to_float(Fp16{static_cast<std::uint16_t>(c)})) ==
            bits_of(__half2float(__half(raw))));
    }
  }
  test::FloatCases cases(detail::kFp16Format, 0xC0DAF16);
  int n_bad = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    float const x = cases.next();
    std::uint16_t const want = cuda_half_bits(__float2half_rn(x));
    if (to_fp16(x).bits != want && ++n_bad <= 5) {
      CAPTURE(bits_of(x));
      CHECK(to_fp16(x).bits == want);
    }
  }
  CHECK(n_bad == 0);
}

TEST_CASE("bf16 vs cuda_bf16.h: every code decodes, and random floats encode, to the same bits") {
  for (std::uint32_t c = 0; c < 65536; ++c) {
    __nv_bfloat16_raw raw;
    raw.x = static_cast<unsigned short>(c);
    if (bits_of(to_float(Bf16{static_cast<std::uint16_t>(c)})) !=
        bits_of(__bfloat162float(__nv_bfloat16(raw)))) {
      CAPTURE(c);
      CHECK(bits_of(to_float(Bf16{static_cast<std::uint16_t>(c)})) ==
            bits_of(__bfloat162float(__nv_bfloat16(raw))));
    }
  }
  test::FloatCases cases(detail::kBf16Format, 0xC0DABF16);
  int n_bad = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    float const x = cases.next();
    std::uint16_t const want = cuda_bf16_bits(__float2bfloat16_rn(x));
    if (to_bf16(x).bits != want && ++n_bad <= 5) {
      CAPTURE(bits_of(x));
      CHECK(to_bf16(x).bits == want);
    }
  }
  CHECK(n_bad == 0);
}
