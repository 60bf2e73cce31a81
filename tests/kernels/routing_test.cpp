// Token-wise dynamic routing: the policies of kernels/router_topk against the reference, the
// expert FFN with unused route slots, and the `--routing` text.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "qflash/kernels/expert_ffn/cpu.hpp"
#include "qflash/kernels/expert_ffn/ref.hpp"
#include "qflash/kernels/router_topk/cpu.hpp"
#include "qflash/kernels/router_topk/ref.hpp"
#include "qflash/model/routing.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "qflash/spec/presets.hpp"
#include "support/expert_case.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using Kind = RoutingPolicy::Kind;

namespace {

struct Routed {
  std::vector<std::int32_t> experts;
  std::vector<float> weights;
};

template <MoeSpec S = spec::generic>
Routed route(std::vector<float> const& logits, int n_tok, int n_expert, int slots, RoutingPolicy policy,
             bool reference, bool renormalize = true) {
  Routed r{std::vector<std::int32_t>(static_cast<std::size_t>(n_tok * slots), 99),
           std::vector<float>(static_cast<std::size_t>(n_tok * slots), 99.0f)};
  RouterTopkArgs a{};
  a.logits = logits.data();
  a.n_tokens = n_tok;
  a.n_expert = n_expert;
  a.n_expert_used = slots;
  a.experts = r.experts.data();
  a.weights = r.weights.data();
  a.renormalize = renormalize;
  a.policy = policy;
  if (reference)
    ref::router_topk(a);
  else
    REQUIRE(launch_router_topk<S>(arch::Cpu{}, a) == Status::kSuccess);
  return r;
}

/// Softmax probabilities of one token's logits, descending.
std::vector<double> sorted_probs(float const* l, int n_expert) {
  std::vector<double> p(l, l + n_expert);
  double const mx = *std::max_element(p.begin(), p.end());
  double sum = 0;
  for (double& x : p) sum += (x = std::exp(x - mx));
  for (double& x : p) x /= sum;
  std::sort(p.rbegin(), p.rend());
  return p;
}

}  // namespace

TEST_CASE("routing: top_p and threshold choose per token what their definitions say; CPU equals the reference") {
  int const n_tok = 40;
  for (auto [n_expert, slots] : std::vector<std::array<int, 2>>{{16, 4}, {16, 8}, {64, 8}, {256, 8}}) {
    // Sharper logits for some tokens, flatter for others, so counts vary.
    std::vector<float> logits;
    for (int t = 0; t < n_tok; ++t) {
      auto row = test::random_floats(static_cast<std::size_t>(n_expert), 50 + t, -1.0f, 1.0f);
      float const sharpness = 0.5f + 0.25f * static_cast<float>(t % 12);
      for (float& x : row) logits.push_back(x * sharpness);
    }
    for (RoutingPolicy const policy :
         {RoutingPolicy{Kind::kTopP, 0.5f, 0, 1}, RoutingPolicy{Kind::kTopP, 0.8f, 0, 2},
          RoutingPolicy{Kind::kTopP, 1.0f, 0, 1}, RoutingPolicy{Kind::kThreshold, 1, 0.05f, 1},
          RoutingPolicy{Kind::kThreshold, 1, 0.2f, 2}, RoutingPolicy{Kind::kThreshold, 1, 1.0f, 3}}) {
      CAPTURE(n_expert);
      CAPTURE(slots);
      CAPTURE(static_cast<int>(policy.kind));
      CAPTURE(policy.p);
      CAPTURE(policy.threshold);
      Routed const got = route(logits, n_tok, n_expert, slots, policy, false);
      Routed const want = route(logits, n_tok, n_expert, slots, policy, true);
      CHECK(got.experts == want.experts);
      auto const close = test::all_close<float, float>(got.weights, want.weights, test::Tolerance{1e-6, 1e-5});
      CHECK_MESSAGE(close.ok, close.report);
      std::set<int> counts;
      for (int t = 0; t < n_tok; ++t) {
        auto const p = sorted_probs(logits.data() + t * n_expert, n_expert);
        // The count from the definition, in fp64.
        int c = 0;
        if (policy.kind == Kind::kTopP)
          for (double mass = 0; c < slots && mass < policy.p - 1e-6;) mass += p[static_cast<std::size_t>(c++)];
        else
          while (c < slots && p[static_cast<std::size_t>(c)] >= policy.threshold) ++c;
        c = std::clamp(c, std::min(policy.k_min, slots), slots);
        int used = 0;
        while (used < slots && got.experts[static_cast<std::size_t>(t * slots + used)] != kNoExpert) ++used;
        CHECK(used == c);
        counts.insert(used);
        for (int j = used; j < slots; ++j) {
          CHECK(got.experts[static_cast<std::size_t>(t * slots + j)] == kNoExpert);
          CHECK(got.weights[static_cast<std::size_t>(t * slots + j)] == 0.0f);
        }
        float const sum = std::accumulate(got.weights.begin() + t * slots, got.weights.begin() + t * slots + used, 0.0f);
        CHECK(sum == doctest::Approx(1.0).epsilon(1e-6));
      }
      // With few experts the count varies per token (with many, 8 rarely reach p).
      if (policy.kind == Kind::kTopP && policy.p < 1 && n_expert == 16) CHECK(counts.size() > 1);
    }
  }
}

TEST_CASE("routing: top_p=1 and threshold=0 are the model's top-k, bit for bit; a static top-k admits other slots") {
  int const n_tok = 9, n_expert = 16, k = 4;
  auto const logits = test::random_floats(static_cast<std::size_t>(n_tok * n_expert), 5, -3, 3);
  Routed const top_k = route(logits, n_tok, n_expert, k, {}, false);
  CHECK(std::find(top_k.experts.begin(), top_k.experts.end(), kNoExpert) == top_k.experts.end());
  for (RoutingPolicy const policy : {RoutingPolicy{Kind::kTopP, 1.0f, 0, 1}, RoutingPolicy{Kind::kThreshold, 1, 0.0f, 1}}) {
    Routed const r = route(logits, n_tok, n_expert, k, policy, false);
    CHECK(r.experts == top_k.experts);
    CHECK(r.weights == top_k.weights);
  }
  // Without renormalisation the chosen experts keep their probabilities.
  Routed const raw = route(logits, n_tok, n_expert, k, RoutingPolicy{Kind::kTopP, 0.5f, 0, 1}, false, false);
  Routed const raw_ref = route(logits, n_tok, n_expert, k, RoutingPolicy{Kind::kTopP, 0.5f, 0, 1}, true, false);
  CHECK(raw.experts == raw_ref.experts);
  auto const close = test::all_close<float, float>(raw.weights, raw_ref.weights, test::Tolerance{1e-6, 1e-5});
  CHECK_MESSAGE(close.ok, close.report);

  // qwen3_5_moe_tiny compiles its top-k statically; the run's routing may use other slot counts
  // (--routing top_k=1), and equals the dynamic spec's.
  constexpr MoeSpec S = spec::qwen3_5_moe_tiny;
  static_assert(S.n_expert_used != kDynamic);
  auto const l = test::random_floats(static_cast<std::size_t>(S.n_expert), 77, -2, 2);
  std::vector<std::int32_t> e(static_cast<std::size_t>(S.n_expert));
  std::vector<float> w(e.size());
  RouterTopkArgs a{};
  a.logits = l.data();
  a.experts = e.data();
  a.weights = w.data();
  a.n_tokens = 1;
  a.n_expert = S.n_expert;
  for (int slots : {1, S.n_expert_used, S.n_expert_used + 1}) {
    a.n_expert_used = slots;
    for (RoutingPolicy const policy : {RoutingPolicy{}, RoutingPolicy{Kind::kTopP, 0.9f, 0, 1}}) {
      a.policy = policy;
      REQUIRE(launch_router_topk<S>(arch::Cpu{}, a) == Status::kSuccess);
      std::vector<std::int32_t> const e_static(e.begin(), e.begin() + slots);
      REQUIRE(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
      CHECK(std::vector<std::int32_t>(e.begin(), e.begin() + slots) == e_static);
    }
  }
  a.n_expert = S.n_expert + 1;  // the compiled expert count is enforced
  CHECK(launch_router_topk<S>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  a.n_expert = S.n_expert;
  // Bad policies are refused.
  a.policy = RoutingPolicy{Kind::kTopP, 0.0f, 0, 1};
  CHECK(launch_router_topk<S>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  a.policy = RoutingPolicy{Kind::kThreshold, 1, 1.5f, 1};
  CHECK(launch_router_topk<S>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  a.policy = RoutingPolicy{Kind::kTopP, 0.5f, 0, 0};
  CHECK(launch_router_topk<S>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
}

TEST_CASE("routing: the expert FFN skips unused slots and equals the reference in every weight format") {
  int const n_expert = 6, slots = 4, n_tok = 13;
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kBf16, WeightFormat::kQ8_0, WeightFormat::kQ4K}) {
    CAPTURE(to_string(f));
    bool const k_blocks = f == WeightFormat::kQ4K;
    int const d_model = k_blocks ? 256 : 64, d_ff = k_blocks ? 256 : 32;
    test::ExpertCase c;
    c.add_experts(n_expert, f, f, d_model, d_ff, 300);
    c.set_tokens(n_tok, d_model, slots, 9);
    // Token t uses 1 + t % 4 experts; token 5 none of expert 0..5 beyond its first; expert 5 no token.
    for (int t = 0; t < n_tok; ++t)
      for (int j = 0; j < slots; ++j) {
        bool const used = j <= t % slots;
        c.routes.push_back(used ? (t + 2 * j) % (n_expert - 1) : kNoExpert);
        c.route_weights.push_back(used ? 0.1f + 0.2f * static_cast<float>(j) : 0.0f);
      }
    std::vector<float> out(static_cast<std::size_t>(n_tok * d_model), 0.5f), ref_out(out);
    ExpertFfnArgs a = c.args(ref_out.data());
    ref::expert_ffn(a);
    for (bool fused : {true, false}) {  // both SwiGLU fusion variants skip the unused slots
      CAPTURE(fused);
      std::fill(out.begin(), out.end(), 0.5f);
      a.out = out.data();
      a.fused_swiglu = fused;
      REQUIRE(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
      auto const r = test::all_close<float, float>(out, ref_out, test::Tolerance{5e-5, 1e-5});
      CHECK_MESSAGE(r.ok, r.report);
    }
    // An id below kNoExpert is still an error.
    c.routes[1] = -2;
    CHECK(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  }
}

TEST_CASE("routing: --routing text round-trips; bad text names what is wrong") {
  using model::parse_routing;
  for (char const* text : {"top_k", "top_k=2", "top_p=0.9", "top_p=0.75,k_min=2", "top_p=0.5,k_min=2,k_max=8",
                           "threshold=0.1", "threshold=0.05,k_max=6"})
    CHECK(model::to_string(parse_routing(text)) == text);
  auto const r = parse_routing("top_p=0.9,k_min=2,k_max=8");
  CHECK(r.policy.kind == Kind::kTopP);
  CHECK(r.policy.p == 0.9f);
  CHECK(r.policy.k_min == 2);
  CHECK(r.k_max == 8);
  CHECK(r.slots(4) == 8);
  CHECK(parse_routing("top_k").slots(4) == 4);
  auto fails_with = [](char const* text, char const* what) {
    CAPTURE(text);
    try {
      (void)parse_routing(text);
      FAIL("accepted");
    } catch (Error const& e) {
      CHECK_MESSAGE(std::string(e.what()).find(what) != std::string::npos, e.what());
    }
  };
  fails_with("", "empty");
  fails_with("top_q=1", "unknown policy 'top_q'");
  fails_with("top_p", "top_p needs a value");
  fails_with("top_p=1.5", "(0, 1]");
  fails_with("top_p=abc", "needs a number");
  fails_with("top_p=0.9,k_min=0", "whole number >= 1");
  fails_with("top_p=0.9,k_min=1.5", "whole number >= 1");
  fails_with("top_p=0.9,k_mid=2", "unknown setting 'k_mid'");
  fails_with("top_p=0.9,k_min=4,k_max=2", "k_min must not exceed k_max");
  fails_with("top_k=2,k_min=1", "top_k takes no other setting");
  fails_with("threshold=-0.1", "[0, 1]");
  CHECK_THROWS_WITH_AS(model::check_routing(parse_routing("top_k=17"), 16, 4), doctest::Contains("the model has 16"),
                       Error);
  CHECK_THROWS_WITH_AS(model::check_routing(parse_routing("top_p=0.9,k_min=6"), 16, 4),
                       doctest::Contains("k_min 6 is above the 4 route slots"), Error);
  CHECK_NOTHROW(model::check_routing(parse_routing("top_p=0.9,k_min=6,k_max=8"), 16, 4));

  // The policies as types are the Routing their text parses to; out-of-range values are refused.
  CHECK(model::Routing(routing::TopK{}) == parse_routing("top_k"));
  CHECK(model::Routing(routing::TopK{.k = 2}) == parse_routing("top_k=2"));
  CHECK(model::Routing(routing::TopP{.p = 0.75f, .k_min = 2}) == parse_routing("top_p=0.75,k_min=2"));
  CHECK(model::Routing(routing::Threshold{.threshold = 0.05f, .k_max = 6}) == parse_routing("threshold=0.05,k_max=6"));
  CHECK_THROWS_WITH_AS(model::check_routing(routing::TopP{.p = 1.5f}, 16, 4), doctest::Contains("top_p must be in (0, 1]"),
                       Error);
  CHECK_THROWS_WITH_AS(model::check_routing(routing::Threshold{.threshold = 0.1f, .k_min = 0}, 16, 4),
                       doctest::Contains("k_min >= 1"), Error);
}

TEST_CASE("routing: per-token policies and k_max equal routing each token alone") {
  int const n_tok = 12, n_expert = 16, slots = 6;
  auto const logits = test::random_floats(static_cast<std::size_t>(n_tok * n_expert), 21, -3, 3);
  std::vector<RoutingPolicy> policies;
  for (int t = 0; t < n_tok; ++t) {
    RoutingPolicy p;
    if (t % 3 == 1) p = RoutingPolicy{Kind::kTopP, 0.6f, 0, 1};
    if (t % 3 == 2) p = RoutingPolicy{Kind::kThreshold, 1, 0.08f, 2};
    p.k_max = t % 4 == 0 ? 0 : 2 + t % 4;  // 0: every slot
    policies.push_back(p);
  }
  Routed got{std::vector<std::int32_t>(static_cast<std::size_t>(n_tok * slots)),
             std::vector<float>(static_cast<std::size_t>(n_tok * slots))};
  RouterTopkArgs a{};
  a.logits = logits.data();
  a.n_tokens = n_tok;
  a.n_expert = n_expert;
  a.n_expert_used = slots;
  a.experts = got.experts.data();
  a.weights = got.weights.data();
  a.token_policies = policies.data();
  REQUIRE(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  for (int t = 0; t < n_tok; ++t) {
    CAPTURE(t);
    std::vector<float> const row(logits.begin() + t * n_expert, logits.begin() + (t + 1) * n_expert);
    Routed const alone = route(row, 1, n_expert, slots, policies[static_cast<std::size_t>(t)], true);
    for (int j = 0; j < slots; ++j) {
      CHECK(got.experts[static_cast<std::size_t>(t * slots + j)] == alone.experts[static_cast<std::size_t>(j)]);
      CHECK(got.weights[static_cast<std::size_t>(t * slots + j)] ==
            doctest::Approx(alone.weights[static_cast<std::size_t>(j)]).epsilon(1e-6));
    }
    int used = 0;
    while (used < slots && got.experts[static_cast<std::size_t>(t * slots + used)] != kNoExpert) ++used;
    int const k_max = policies[static_cast<std::size_t>(t)].k_max;
    CHECK(used <= (k_max ? k_max : slots));
    if (policies[static_cast<std::size_t>(t)].kind == Kind::kTopK) CHECK(used == (k_max ? k_max : slots));
  }
  policies[3].p = 0;  // an invalid policy anywhere is refused
  policies[3].kind = Kind::kTopP;
  CHECK(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
}
