/// @file
/// Run-time spec -> compiled instance. Walks the generated instance list (QFLASH_SPECS):
/// the first fully static spec that equals the run-time one wins; otherwise the first
/// partially dynamic one that matches (e.g. `generic`), with one log line naming the spec to
/// build for full speed; otherwise Status::kErrorNotSupported. Host-only (Boost.Hana).
#pragma once

#include <atomic>
#include <cstddef>
#include <string>
#include <utility>

#include <boost/hana/for_each.hpp>
#include <boost/hana/range.hpp>

#include "qflash/core/log.hpp"
#include "qflash/generated/instances.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::runtime {

/// A compile-time spec carried as a type, so that a generic lambda can use it as a
/// template argument: `[](auto s) { return launch_x<decltype(s)::value>(...); }`.
template <MoeSpec S>
struct SpecConstant {
  static constexpr MoeSpec value = S;
};

/// Index into `Specs` of the instance `rt` runs on, or -1. Exact static matches first.
template <std::size_t N>
constexpr int select_spec(std::array<MoeSpec, N> const& specs, MoeSpec const& rt) {
  for (std::size_t i = 0; i < N; ++i)
    if (is_static(specs[i]) && matches(specs[i], rt)) return static_cast<int>(i);
  for (std::size_t i = 0; i < N; ++i)
    if (!is_static(specs[i]) && matches(specs[i], rt)) return static_cast<int>(i);
  return -1;
}

/// Names of the compiled specs, for error messages.
inline std::string compiled_spec_names() {
  std::string out;
  for (auto name : instances::kSpecNames) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

/// Calls `fn(SpecConstant<S>{})` for the compiled spec S selected for the run-time spec `rt`
/// and returns its Status. `fn` is instantiated for every compiled spec.
template <class Fn>
Status dispatch_spec(MoeSpec const& rt, Fn&& fn) {
  constexpr auto& specs = instances::kSpecs;
  int const chosen = select_spec(specs, rt);
  if (chosen < 0) {
    QFLASH_LOG_WARN("no compiled spec runs ", to_string(rt), "; compiled: ", compiled_spec_names());
    return Status::kErrorNotSupported;
  }
  if (!is_static(specs[static_cast<std::size_t>(chosen)])) {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true))
      QFLASH_LOG_INFO("running the ", instances::kSpecNames[static_cast<std::size_t>(chosen)],
                      " instance for ", to_string(rt),
                      "; add this spec to QFLASH_SPECS for a specialised build");
  }
  Status result = Status::kErrorInternal;
  boost::hana::for_each(
      boost::hana::make_range(boost::hana::size_c<0>, boost::hana::size_c<specs.size()>),
      [&](auto i) {
        if (static_cast<int>(decltype(i)::value) == chosen)
          result = fn(SpecConstant<specs[decltype(i)::value]>{});
      });
  return result;
}

}  // namespace qflash::runtime
