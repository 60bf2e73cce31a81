/// @file
/// CPU instruction-set levels, detected at run time. CPU kernels compile every level with
/// function target attributes and pick one per call, so one binary serves every x86-64 host.
#pragma once

#include <cstdlib>
#include <string_view>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace qflash::arch {

/// Ordered: a level implies every lower one.
enum class CpuIsa : int {
  kScalar = 0,
  kAvx2 = 1,        ///< AVX2 + FMA + F16C
  kAvx512 = 2,      ///< AVX-512 F, BW, VL, DQ
  kAvx512Vnni = 3,  ///< plus AVX512_VNNI (vpdpbusd / vpdpwssd integer dot products)
  kAvx512Bf16 = 4,  ///< plus AVX512_BF16
  kAmx = 5,         ///< plus AMX-TILE, AMX-BF16 and AMX-INT8, with the OS's leave to use tile data
};

constexpr std::string_view to_string(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Vnni: return "avx512_vnni";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
    case CpuIsa::kAmx: return "amx";
  }
  return "unknown";
}

/// True when the processor has AMX-TILE, AMX-BF16 and AMX-INT8, the OS saves tile state (XCR0
/// bits 17 and 18) and, on Linux, grants this process tile data (arch_prctl
/// ARCH_REQ_XCOMP_PERM, once for every thread). Anything missing: false, and AMX never runs.
inline bool amx_usable() {
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  bool const amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u, amx_int8 = (d >> 25) & 1u;
  bool const osxsave = __get_cpuid(1, &a, &b, &c, &d) && ((c >> 27) & 1u);
  if (!amx_bf16 || !amx_tile || !amx_int8 || !osxsave) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

/// The best level this processor supports.
inline CpuIsa detect_cpu_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // F16C came with every AVX2 processor; clang cannot query it by name.
  bool const avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  bool const avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  bool const avx512_vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  bool const avx512_bf16 = avx512_vnni && __builtin_cpu_supports("avx512bf16");
  static bool const amx = avx512_bf16 && amx_usable();
  if (amx) return CpuIsa::kAmx;
  if (avx512_bf16) return CpuIsa::kAvx512Bf16;
  if (avx512_vnni) return CpuIsa::kAvx512Vnni;
  if (avx512) return CpuIsa::kAvx512;
  if (avx2) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kScalar;
}

/// True when the processor has AVX-VNNI (256-bit vpdpbusd without AVX-512: Alder Lake and
/// later Intel cores, Zen 5) and QFLASH_AVX_VNNI is not "0". It is not a level: AVX-512 VNNI
/// processors before Sapphire Rapids lack it. The AVX2 integer kernels use it.
inline bool avx_vnni() {
  static bool const usable = [] {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (char const* env = std::getenv("QFLASH_AVX_VNNI"); env && std::string_view(env) == "0") return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    return detect_cpu_isa() >= CpuIsa::kAvx2 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1u);
#else
    return false;
#endif
  }();
  return usable;
}

/// Every level, lowest first.
inline constexpr CpuIsa kAllCpuIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Vnni,
                                         CpuIsa::kAvx512Bf16, CpuIsa::kAmx};

/// Parses "scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"; returns false on anything else.
inline bool parse_cpu_isa(std::string_view s, CpuIsa& out) {
  for (auto isa : kAllCpuIsas) {
    if (s == to_string(isa)) {
      out = isa;
      return true;
    }
  }
  return false;
}

/// The level kernels use: the detected one, capped by the environment variable
/// QFLASH_CPU_ISA when it names a lower level (for tests and comparisons).
inline CpuIsa cpu_isa() {
  static CpuIsa const isa = [] {
    CpuIsa detected = detect_cpu_isa();
    CpuIsa cap;
    if (char const* env = std::getenv("QFLASH_CPU_ISA"); env && parse_cpu_isa(env, cap) && cap < detected)
      return cap;
    return detected;
  }();
  return isa;
}

}  // namespace qflash::arch
