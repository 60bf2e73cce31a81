/// @file
/// Choosing a compiled CUDA arch for a device: the highest compiled arch the device can run.
/// `sm_90a` code runs only on compute capability 9.0 exactly; `sm_80` code runs on any
/// cc >= 8.0 (through its PTX when newer). Nothing is chosen that was not compiled.
#pragma once

#include <optional>
#include <span>

#include "qflash/arch/arch.hpp"

namespace qflash::arch {

constexpr bool can_run(ArchId compiled, int cc_major, int cc_minor) {
  switch (compiled) {
    case ArchId::kCpu: return false;
    case ArchId::kSm80: return cc_major >= 8;
    case ArchId::kSm90a: return cc_major == 9 && cc_minor == 0;
  }
  return false;
}

/// Preference order among CUDA archs, best first.
constexpr int rank(ArchId id) {
  switch (id) {
    case ArchId::kSm90a: return 2;
    case ArchId::kSm80: return 1;
    case ArchId::kCpu: return 0;
  }
  return 0;
}

/// The best arch among `compiled` for a device of compute capability major.minor, or
/// nullopt when none can run there (the caller reports Status::kErrorArchMismatch).
constexpr std::optional<ArchId> select_cuda_arch(std::span<ArchId const> compiled, int cc_major,
                                                 int cc_minor) {
  std::optional<ArchId> best;
  for (ArchId a : compiled)
    if (can_run(a, cc_major, cc_minor) && (!best || rank(a) > rank(*best))) best = a;
  return best;
}

}  // namespace qflash::arch
