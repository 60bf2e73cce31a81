/// @file
/// Target tags. Kernels overload their launchers on these tags; each carries the
/// capabilities that tile policies and feature checks read.
#pragma once

#include <string_view>
#include <type_traits>

namespace qflash::arch {

enum class ArchId : int { kCpu, kSm80, kSm90a };

struct Cpu {
  static constexpr ArchId id = ArchId::kCpu;
  static constexpr std::string_view name = "cpu";
  static constexpr bool is_cuda = false;
};

/// Ampere: cp.async, mma.sync (bf16/fp16), 164 KiB shared memory per SM on A100.
struct Sm80 {
  static constexpr ArchId id = ArchId::kSm80;
  static constexpr std::string_view name = "sm80";
  static constexpr bool is_cuda = true;
  static constexpr int compute_capability = 80;
  static constexpr int max_smem_bytes_per_block = 163 * 1024;
  static constexpr bool has_cp_async = true;
  static constexpr bool has_wgmma = false;
  static constexpr bool has_tma = false;
  static constexpr bool has_fp8_mma = false;
};

/// Hopper with arch-specific features (`sm_90a`): wgmma, TMA, FP8 tensor cores. Runs only on cc 9.0.
struct Sm90a {
  static constexpr ArchId id = ArchId::kSm90a;
  static constexpr std::string_view name = "sm90a";
  static constexpr bool is_cuda = true;
  static constexpr int compute_capability = 90;
  static constexpr int max_smem_bytes_per_block = 227 * 1024;
  static constexpr bool has_cp_async = true;
  static constexpr bool has_wgmma = true;
  static constexpr bool has_tma = true;
  static constexpr bool has_fp8_mma = true;
};

constexpr std::string_view to_string(ArchId id) {
  switch (id) {
    case ArchId::kCpu: return Cpu::name;
    case ArchId::kSm80: return Sm80::name;
    case ArchId::kSm90a: return Sm90a::name;
  }
  return "unknown";
}

/// True when Arch is one of the tags an op implements: a launcher's catch-all overload is
/// constrained on `!implemented_by<Arch, ...>`, so an arch without an implementation stops the
/// build at its static_assert instead of "no matching function".
template <class Arch, class... Implemented>
concept implemented_by = (std::is_same_v<Arch, Implemented> || ...);

}  // namespace qflash::arch
