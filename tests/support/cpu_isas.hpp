// The CPU levels a kernel test runs: those of `levels` this CPU has (arch::detect_cpu_isa()).
#pragma once

#include <initializer_list>
#include <vector>

#include "qflash/arch/cpu_features.hpp"

namespace qflash::test {

/// By default the levels with SIMD bodies of their own in most ops: scalar, AVX2, AVX-512.
inline std::vector<arch::CpuIsa> isas_here(std::initializer_list<arch::CpuIsa> levels = {
                                               arch::CpuIsa::kScalar, arch::CpuIsa::kAvx2, arch::CpuIsa::kAvx512}) {
  std::vector<arch::CpuIsa> out;
  for (auto isa : levels)
    if (arch::detect_cpu_isa() >= isa) out.push_back(isa);
  return out;
}

}  // namespace qflash::test
