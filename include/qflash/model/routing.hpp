/// @file
/// Token-wise routing of a model's MoE layers: the policy (kernels/router_topk) and the route
/// slots per token, written and read as `--routing` text:
///   top_k            the model's top-k (the default)
///   top_k=4          a fixed k
///   top_p=0.9[,k_min=2][,k_max=8]        per token, the fewest experts whose probability
///                                        reaches 0.9, clamped to [k_min, k_max]
///   threshold=0.1[,k_min=1][,k_max=8]    per token, the experts with probability >= 0.1
/// k_max defaults to the model's top-k; k_min to 1.
#pragma once

#include <charconv>
#include <string>
#include <string_view>

#include "qflash/core/error.hpp"
#include "qflash/kernels/router_topk/op.hpp"

/// The routing policies as types, for code that picks one by hand (docs/research.md lists
/// them with the fusion variants); each converts to the model::Routing its text parses to.
namespace qflash::routing {
struct TopK {  ///< "top_k[=k]"
  int k = 0;   ///< 0: the model's top-k
};
struct TopP {  ///< "top_p=p[,k_min=..][,k_max=..]"
  float p = 0.9f;
  int k_min = 1;
  int k_max = 0;  ///< 0: the model's top-k
};
struct Threshold {  ///< "threshold=t[,k_min=..][,k_max=..]"
  float threshold = 0.1f;
  int k_min = 1;
  int k_max = 0;  ///< 0: the model's top-k
};
}  // namespace qflash::routing

namespace qflash::model {

struct Routing {
  kernels::RoutingPolicy policy;
  int k_max = 0;  ///< route slots per token (0: the model's top-k)

  Routing() = default;
  Routing(routing::TopK t) : k_max(t.k) {}  // NOLINT(google-explicit-constructor): a policy is a Routing
  Routing(routing::TopP t) : k_max(t.k_max) {  // NOLINT(google-explicit-constructor)
    policy.kind = kernels::RoutingPolicy::Kind::kTopP;
    policy.p = t.p;
    policy.k_min = t.k_min;
  }
  Routing(routing::Threshold t) : k_max(t.k_max) {  // NOLINT(google-explicit-constructor)
    policy.kind = kernels::RoutingPolicy::Kind::kThreshold;
    policy.threshold = t.threshold;
    policy.k_min = t.k_min;
  }

  /// Route slots per token for a model whose top-k is `model_k`.
  [[nodiscard]] int slots(int model_k) const { return k_max > 0 ? k_max : model_k; }
  friend bool operator==(Routing const&, Routing const&) = default;
};

namespace detail {
inline double routing_number(std::string_view text, std::string_view key, std::string_view value) {
  double v = 0;
  auto const [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  QFLASH_CHECK(ec == std::errc{} && end == value.data() + value.size(), "routing '", text, "': ", key,
               " needs a number, got '", value, "'");
  return v;
}
inline int routing_count(std::string_view text, std::string_view key, std::string_view value) {
  double const v = routing_number(text, key, value);
  QFLASH_CHECK(v >= 1 && v <= 1 << 16 && v == static_cast<int>(v), "routing '", text, "': ", key,
               " needs a whole number >= 1, got '", value, "'");
  return static_cast<int>(v);
}
}  // namespace detail

/// Parses `--routing` text (see the file comment); errors name the text and the bad part.
inline Routing parse_routing(std::string_view text) {
  using Kind = kernels::RoutingPolicy::Kind;
  Routing r;
  bool first = true, k_min_set = false;
  std::string_view rest = text;
  QFLASH_CHECK(!text.empty(), "routing: empty; expected top_k, top_k=K, top_p=P[,k_min=A][,k_max=B] or "
                              "threshold=T[,k_min=A][,k_max=B]");
  while (!rest.empty()) {
    std::size_t const comma = rest.find(',');
    std::string_view const part = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    std::size_t const eq = part.find('=');
    std::string_view const key = part.substr(0, eq);
    std::string_view const value = eq == std::string_view::npos ? std::string_view{} : part.substr(eq + 1);
    bool const has_value = eq != std::string_view::npos;
    if (first) {
      first = false;
      if (key == "top_k") {
        if (has_value) r.k_max = detail::routing_count(text, key, value);
        continue;
      }
      if (key == "top_p") {
        QFLASH_CHECK(has_value, "routing '", text, "': top_p needs a value, e.g. top_p=0.9");
        r.policy.kind = Kind::kTopP;
        r.policy.p = static_cast<float>(detail::routing_number(text, key, value));
        QFLASH_CHECK(r.policy.p > 0 && r.policy.p <= 1, "routing '", text, "': top_p must be in (0, 1]");
        continue;
      }
      if (key == "threshold") {
        QFLASH_CHECK(has_value, "routing '", text, "': threshold needs a value, e.g. threshold=0.1");
        r.policy.kind = Kind::kThreshold;
        r.policy.threshold = static_cast<float>(detail::routing_number(text, key, value));
        QFLASH_CHECK(r.policy.threshold >= 0 && r.policy.threshold <= 1, "routing '", text,
                     "': threshold must be in [0, 1]");
        continue;
      }
      QFLASH_FAIL("routing '", text, "': unknown policy '", key, "'; expected top_k, top_p or threshold");
    }
    QFLASH_CHECK(r.policy.kind != Kind::kTopK, "routing '", text, "': top_k takes no other setting, got '", part,
                 "'");
    QFLASH_CHECK(has_value, "routing '", text, "': '", key, "' needs a value");
    if (key == "k_min") {
      r.policy.k_min = detail::routing_count(text, key, value);
      k_min_set = true;
    } else if (key == "k_max") {
      r.k_max = detail::routing_count(text, key, value);
    } else {
      QFLASH_FAIL("routing '", text, "': unknown setting '", key, "'; expected k_min or k_max");
    }
  }
  QFLASH_CHECK(!k_min_set || r.k_max == 0 || r.policy.k_min <= r.k_max, "routing '", text,
               "': k_min must not exceed k_max");
  return r;
}

/// The text parse_routing reads back.
inline std::string to_string(Routing const& r) {
  using Kind = kernels::RoutingPolicy::Kind;
  auto num = [](double v) {
    std::string s = std::to_string(v);
    while (s.size() > 1 && s.back() == '0') s.pop_back();
    if (s.back() == '.') s.pop_back();
    return s;
  };
  std::string s;
  if (r.policy.kind == Kind::kTopK) return r.k_max ? "top_k=" + std::to_string(r.k_max) : "top_k";
  s = r.policy.kind == Kind::kTopP ? "top_p=" + num(r.policy.p) : "threshold=" + num(r.policy.threshold);
  if (r.policy.k_min != 1) s += ",k_min=" + std::to_string(r.policy.k_min);
  if (r.k_max) s += ",k_max=" + std::to_string(r.k_max);
  return s;
}

/// Checks `r` against a model of `n_expert` experts; errors say what to change.
inline void check_routing(Routing const& r, int n_expert, int model_k) {
  QFLASH_CHECK(kernels::valid(r.policy) && r.k_max >= 0, "routing '", to_string(r),
               "': top_p must be in (0, 1], threshold in [0, 1], k_min >= 1 and k_max >= 0");
  int const slots = r.slots(model_k);
  QFLASH_CHECK(slots <= n_expert, "routing '", to_string(r), "': ", slots, " experts per token, the model has ",
               n_expert);
  QFLASH_CHECK(r.policy.k_min <= slots, "routing '", to_string(r), "': k_min ", r.policy.k_min,
               " is above the ", slots, " route slots per token (set k_max)");
}

}  // namespace qflash::model
