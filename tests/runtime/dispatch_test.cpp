#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "qflash/runtime/dispatch.hpp"

using namespace qflash;

TEST_CASE("select_spec prefers exact static matches, then dynamic ones") {
  constexpr std::array<MoeSpec, 3> specs{spec::generic, spec::qwen3_6_35b_a3b, spec::qwen3_30b_a3b};
  static_assert(runtime::select_spec(specs, spec::qwen3_30b_a3b) == 2);
  static_assert(runtime::select_spec(specs, spec::qwen3_6_35b_a3b) == 1);
  MoeSpec other = spec::qwen3_30b_a3b;
  other.n_expert = 64;
  CHECK(runtime::select_spec(specs, other) == 0);
  constexpr std::array<MoeSpec, 1> only{spec::qwen3_30b_a3b};
  CHECK(runtime::select_spec(only, other) == -1);
}

TEST_CASE("dispatch_spec calls the instance for the run-time spec") {
  std::vector<std::string> logs;
  set_log_sink([&](LogLevel, std::string_view m) { logs.emplace_back(m); });

  MoeSpec seen{};
  auto record = [&](auto s) {
    seen = decltype(s)::value;
    return Status::kSuccess;
  };
  CHECK(runtime::dispatch_spec(spec::qwen3_6_35b_a3b, record) == Status::kSuccess);
  CHECK(seen == spec::qwen3_6_35b_a3b);
  CHECK(logs.empty());

  MoeSpec custom = spec::qwen3_6_35b_a3b;
  custom.n_expert = 64;
  bool const generic_compiled = runtime::select_spec(instances::kSpecs, custom) >= 0;
  Status const st = runtime::dispatch_spec(custom, record);
  if (generic_compiled) {
    CHECK(st == Status::kSuccess);
    CHECK_FALSE(is_static(seen));
    REQUIRE(logs.size() == 1);
    CHECK(logs[0].find("n_expert=64") != std::string::npos);
  } else {
    CHECK(st == Status::kErrorNotSupported);
  }
  set_log_sink(detail::default_log_sink);
}
