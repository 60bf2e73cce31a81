#include <doctest/doctest.h>

#include "qflash/spec/presets.hpp"

using namespace qflash;

template <MoeSpec S>
constexpr int d_model_of(int runtime) {
  return dim<S.d_model>(runtime);
}

TEST_CASE("presets carry the published values") {
  constexpr auto q36 = spec::qwen3_6_35b_a3b;
  CHECK(q36.d_model == 2048);
  CHECK(q36.n_head == 16);
  CHECK(q36.n_head_kv == 2);
  CHECK(q36.d_head == 256);
  CHECK(q36.n_expert == 256);
  CHECK(q36.n_expert_used == 8);
  CHECK(q36.d_ff_expert == 512);
  CHECK(q36.d_ff_shared == 512);
  CHECK(q36.n_head_k_linear == 16);
  CHECK(q36.n_head_v_linear == 32);
  CHECK(q36.d_head_k_linear == 128);
  CHECK(q36.d_head_v_linear == 128);
  CHECK(q36.d_conv == 4);
  constexpr auto q3 = spec::qwen3_30b_a3b;
  CHECK(q3.n_head == 32);
  CHECK(q3.n_head_kv == 4);
  CHECK(q3.d_head == 128);
  CHECK(q3.n_expert == 128);
  CHECK(q3.d_ff_expert == 768);
  CHECK(q3.d_ff_shared == 0);
}

TEST_CASE("validation explains what is wrong") {
  MoeSpec s = spec::qwen3_6_35b_a3b;
  CHECK(why_invalid(s).empty());
  s.n_head_kv = 3;
  CHECK(why_invalid(s) == "n_head must be a multiple of n_head_kv (grouped-query attention)");
  s = spec::qwen3_6_35b_a3b;
  s.n_expert_used = 300;
  CHECK(why_invalid(s) == "n_expert_used must not exceed n_expert");
  s = spec::qwen3_30b_a3b;
  s.d_ff_shared = 512;
  CHECK(why_invalid(s) == "qwen3_moe has no shared expert (d_ff_shared must be 0)");
  s = spec::qwen3_6_35b_a3b;
  s.d_head = 255;
  CHECK_FALSE(valid(s));
  static_assert(!valid(MoeSpec{.d_model = 0}));
}

TEST_CASE("dynamic fields and matching") {
  static_assert(d_model_of<spec::qwen3_6_35b_a3b>(7) == 2048);
  static_assert(d_model_of<spec::generic>(7) == 7);
  CHECK(matches(spec::generic, spec::qwen3_6_35b_a3b));
  CHECK(matches(spec::qwen3_6_35b_a3b, spec::qwen3_6_35b_a3b));
  CHECK_FALSE(matches(spec::qwen3_6_35b_a3b, spec::qwen3_30b_a3b));
  MoeSpec partial = spec::generic;
  partial.d_model = 2048;
  CHECK(matches(partial, spec::qwen3_30b_a3b));
  CHECK_FALSE(is_static(partial));
  // kv=any is a static choice (every scheme, per head at run time); a fixed scheme runs only itself.
  MoeSpec int6_only = spec::qwen3_6_35b_a3b;
  int6_only.kv = KvScheme::kInt6;
  CHECK(is_static(int6_only));
  MoeSpec rt = spec::qwen3_6_35b_a3b;
  rt.kv = KvScheme::kBf16;
  CHECK(matches(spec::qwen3_6_35b_a3b, rt));
  CHECK_FALSE(matches(int6_only, rt));
}

TEST_CASE("to_string names every field") {
  CHECK(to_string(spec::qwen3_30b_a3b) ==
        "{family=qwen3_moe d_model=2048 n_head=32 n_head_kv=4 d_head=128 n_expert=128 "
        "n_expert_used=8 d_ff_expert=768 d_ff_shared=0 n_head_k_linear=0 n_head_v_linear=0 "
        "d_head_k_linear=0 d_head_v_linear=0 d_conv=0 kv=any weights=any}");
  CHECK(to_string(spec::generic).find("d_model=?") != std::string::npos);
}
