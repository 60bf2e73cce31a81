#include <doctest/doctest.h>

#include <array>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/arch/select.hpp"

using namespace qflash::arch;

TEST_CASE("select_cuda_arch chooses only among compiled archs") {
  constexpr std::array both{ArchId::kSm80, ArchId::kSm90a};
  constexpr std::array only80{ArchId::kSm80};
  constexpr std::array only90a{ArchId::kSm90a};

  CHECK(select_cuda_arch(both, 9, 0) == ArchId::kSm90a);
  CHECK(select_cuda_arch(both, 8, 0) == ArchId::kSm80);
  CHECK(select_cuda_arch(both, 8, 9) == ArchId::kSm80);
  // sm_90a code runs on cc 9.0 only: a Blackwell (10.0) gets the sm_80 build.
  CHECK(select_cuda_arch(both, 10, 0) == ArchId::kSm80);
  CHECK(select_cuda_arch(only80, 9, 0) == ArchId::kSm80);
  CHECK_FALSE(select_cuda_arch(only90a, 8, 0).has_value());
  CHECK_FALSE(select_cuda_arch(only90a, 10, 0).has_value());
  CHECK_FALSE(select_cuda_arch(both, 7, 5).has_value());
  static_assert(select_cuda_arch(both, 9, 0) == ArchId::kSm90a);
}

TEST_CASE("CPU ISA detection and names") {
  CpuIsa const detected = detect_cpu_isa();
  CHECK(cpu_isa() <= detected);
  CpuIsa parsed{};
  for (auto isa : kAllCpuIsas) {
    REQUIRE(parse_cpu_isa(to_string(isa), parsed));
    CHECK(parsed == isa);
  }
  CHECK_FALSE(parse_cpu_isa("sse9", parsed));
  MESSAGE("detected CPU ISA: ", to_string(detected));
}
