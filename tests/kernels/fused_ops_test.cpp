// The ops that took the model's inline math: qk_norm_rope (strided q heads, static and
// dynamic d_head), gdn_gates, embedding in every weight format, attention's output gate and
// the router's shared-expert gate column, each against its scalar reference.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/attention/ref.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "qflash/kernels/embedding/cpu.hpp"
#include "qflash/kernels/gdn_gates/cpu.hpp"
#include "qflash/kernels/gdn_gates/ref.hpp"
#include "qflash/kernels/qk_norm_rope/cpu.hpp"
#include "qflash/kernels/qk_norm_rope/ref.hpp"
#include "qflash/kernels/router_topk/cpu.hpp"
#include "qflash/kernels/router_topk/ref.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "qflash/spec/presets.hpp"
#include "support/cpu_isas.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using qflash::test::all_close;
using qflash::test::Tolerance;

TEST_CASE("qk_norm_rope: strided heads, both weight kinds, static and generic d_head") {
  // fp32 angles at position 4095 differ from fp64 ones by up to ~2e-4 rad (as rope's test);
  // the norm is fp32 against fp64.
  constexpr Tolerance kTol{5e-4, 1e-5};
  int const n_tok = 6, n_head = 4, d_head = 32;  // qwen3_5_moe_tiny's d_head
  for (int stride_factor : {1, 2})
    for (auto kind : {NormWeight::kPlain, NormWeight::kZeroCentered})
      for (int rotary : {0, 8, 32}) {
        CAPTURE(stride_factor);
        CAPTURE(rotary);
        std::int64_t const hs = std::int64_t{d_head} * stride_factor;
        auto x = test::random_floats(static_cast<std::size_t>(n_tok * n_head * hs), 21, -3, 3);
        auto w = test::random_floats(static_cast<std::size_t>(d_head), 22, -0.5f, 1.5f);
        std::vector<std::int64_t> pos{0, 1, 7, 100, 1000, 4095};
        std::vector<float> y(static_cast<std::size_t>(n_tok * n_head * d_head)), ref_y(y), y_static(y);
        QkNormRopeArgs a{};
        a.x = x.data();
        a.head_stride = hs;
        a.weight = w.data();
        a.positions = pos.data();
        a.n_tokens = n_tok;
        a.n_head = n_head;
        a.d_head = d_head;
        a.rotary_dim = rotary;
        a.theta = 1e6f;
        a.weight_kind = kind;
        a.y = ref_y.data();
        ref::qk_norm_rope(a);
        a.y = y.data();
        REQUIRE(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
        auto r = all_close<float, float>(y, ref_y, kTol);
        CHECK_MESSAGE(r.ok, r.report);
        a.y = y_static.data();
        REQUIRE(launch_qk_norm_rope<spec::qwen3_5_moe_tiny>(arch::Cpu{}, a) == Status::kSuccess);
        CHECK(y_static == y);
        for (auto isa : test::isas_here()) {  // each body
          CAPTURE(to_string(isa));
          std::vector<float> y_isa(y.size());
          a.y = y_isa.data();
          REQUIRE(cpu::qk_norm_rope<kDynamic>(isa, a) == Status::kSuccess);
          auto ri = all_close<float, float>(y_isa, ref_y, kTol);
          CHECK_MESSAGE(ri.ok, ri.report);
        }
      }
  QkNormRopeArgs bad{};
  CHECK(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, bad) == Status::kErrorInvalidProblem);
  std::vector<float> x(64), w(16), y(64);
  std::vector<std::int64_t> pos{0};
  QkNormRopeArgs a{};
  a.x = x.data();
  a.weight = w.data();
  a.y = y.data();
  a.positions = pos.data();
  a.n_tokens = 1;
  a.n_head = 4;
  a.d_head = 16;
  CHECK(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  CHECK(launch_qk_norm_rope<spec::qwen3_5_moe_tiny>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);  // d_head 32
  a.head_stride = 32;
  a.y = x.data();  // in place needs dense heads
  CHECK(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  a.head_stride = 0;
  CHECK(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);  // in place, dense
  a.y = x.data() + 8;  // y overlapping x, not in place: its writes would race the reads
  CHECK(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
}

TEST_CASE("qk_norm_rope: queries and keys in one call are the two calls, bit for bit") {
  // The model's shape: queries read out of [query | gate] rows, GQA keys normed in place.
  int const n_tok = 5, n_head = 4, n_kv = 2, d_head = 32, rotary = 8;
  auto qg = test::random_floats(static_cast<std::size_t>(n_tok * n_head * 2 * d_head), 41, -3, 3);
  auto const k0 = test::random_floats(static_cast<std::size_t>(n_tok * n_kv * d_head), 42, -3, 3);
  auto const wq = test::random_floats(static_cast<std::size_t>(d_head), 43, -0.5f, 1.5f);
  auto const wk = test::random_floats(static_cast<std::size_t>(d_head), 44, -0.5f, 1.5f);
  std::vector<std::int64_t> const pos{3, 4, 5, 900, 2};
  auto args = [&](float* q, float* k) {
    QkNormRopeArgs a{};
    a.x = qg.data();
    a.token_stride = std::int64_t{n_head} * 2 * d_head;
    a.head_stride = 2 * d_head;
    a.weight = wq.data();
    a.y = q;
    a.positions = pos.data();
    a.n_tokens = n_tok;
    a.n_head = n_head;
    a.d_head = d_head;
    a.rotary_dim = rotary;
    a.theta = 1e6f;
    a.keys = {k, std::int64_t{n_kv} * d_head, d_head, wk.data(), k, n_kv};
    return a;
  };
  std::vector<float> q_one(static_cast<std::size_t>(n_tok * n_head * d_head)), k_one(k0), q_two(q_one), k_two(k0),
      q_ref(q_one), k_ref(k0);
  QkNormRopeArgs const both = args(q_one.data(), k_one.data());
  REQUIRE(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, both) == Status::kSuccess);
  QkNormRopeArgs q_alone = args(q_two.data(), k_two.data());
  QkNormRopeArgs const k_alone = q_alone.keys_call();
  q_alone.keys = {};
  REQUIRE(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, q_alone) == Status::kSuccess);
  REQUIRE(launch_qk_norm_rope<spec::generic>(arch::Cpu{}, k_alone) == Status::kSuccess);
  CHECK(q_one == q_two);
  CHECK(k_one == k_two);
  CHECK(k_one != k0);  // the keys were normed
  ref::qk_norm_rope(args(q_ref.data(), k_ref.data()));
  auto const rq = all_close<float, float>(q_one, q_ref, Tolerance{5e-4, 1e-5});
  CHECK_MESSAGE(rq.ok, rq.report);
  auto const rk = all_close<float, float>(k_one, k_ref, Tolerance{5e-4, 1e-5});
  CHECK_MESSAGE(rk.ok, rk.report);
  // Refused: the sets' outputs meet, one writes the other's input, or the keys' own shape is bad.
  auto refused = [&](auto edit) {
    QkNormRopeArgs a = args(q_two.data(), k_two.data());
    edit(a);
    return launch_qk_norm_rope<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem;
  };
  CHECK(refused([&](QkNormRopeArgs& a) { a.keys.y = a.y; }));
  CHECK(refused([&](QkNormRopeArgs& a) { a.y = a.keys.y; a.keys.y = q_one.data(); }));  // q written over k's input
  CHECK(refused([&](QkNormRopeArgs& a) { a.keys.n_head = 0; }));
  CHECK(refused([&](QkNormRopeArgs& a) { a.keys.head_stride = 16; }));  // narrower than d_head
  CHECK(refused([&](QkNormRopeArgs& a) { a.keys.weight = nullptr; }));
  CHECK(refused([&](QkNormRopeArgs& a) { a.keys.y = a.y + d_head; a.keys.x = a.keys.y; }));  // inside q's output
  CHECK(refused([&](QkNormRopeArgs& a) { a.keys.y = qg.data() + 3 * d_head; a.keys.x = a.keys.y; }));  // in q's input
}

TEST_CASE("gdn_gates: sigmoid and softplus decay equal the fp64 reference, every ISA path") {
  int const n_tok = 9, hv = 8;
  auto b = test::random_floats(static_cast<std::size_t>(n_tok * hv), 31, -30, 30);
  auto a_in = test::random_floats(static_cast<std::size_t>(n_tok * hv), 32, -30, 30);
  // The edges: softplus's switch at 20, exp's clamp, zero, and values near them.
  float const edges[] = {20.0f, 19.999f, 20.001f, -87.0f, -100.0f, 0.0f, -0.0f, 1e-7f, -1e-7f, 88.0f};
  for (std::size_t i = 0; i < std::size(edges); ++i) b[i] = a_in[i] = edges[i];
  auto dt = test::random_floats(static_cast<std::size_t>(hv), 33, -1, 1);
  auto neg_a = test::random_floats(static_cast<std::size_t>(hv), 34, -4, -0.01f);
  auto beta = b, g = a_in, beta_ref = b, g_ref = a_in;
  GdnGatesArgs args{};
  args.dt_bias = dt.data();
  args.neg_a = neg_a.data();
  args.n_tokens = n_tok;
  args.n_head_v = hv;
  args.beta = beta_ref.data();
  args.g = g_ref.data();
  ref::gdn_gates(args);
  args.beta = beta.data();
  args.g = g.data();
  for (arch::CpuIsa isa : test::isas_here()) {
    CAPTURE(static_cast<int>(isa));
    beta = b;
    g = a_in;
    args.beta = beta.data();
    args.g = g.data();
    REQUIRE(cpu::gdn_gates<kDynamic>(isa, args) == Status::kSuccess);
    auto r = all_close<float, float>(beta, beta_ref, Tolerance{1e-6, 1e-6});
    CHECK_MESSAGE(r.ok, r.report);
    r = all_close<float, float>(g, g_ref, Tolerance{1e-6, 1e-5});
    CHECK_MESSAGE(r.ok, r.report);
    for (float v : g) CHECK(v <= 0.0f);
  }
  beta = b;
  g = a_in;
  args.beta = beta.data();
  args.g = g.data();
  REQUIRE(launch_gdn_gates<spec::generic>(arch::Cpu{}, args) == Status::kSuccess);  // arch::cpu_isa()'s path
  CHECK(all_close<float, float>(g, g_ref, Tolerance{1e-6, 1e-5}).ok);
  // NaN in, NaN out.
  beta[0] = std::nanf("");
  g[0] = std::nanf("");
  REQUIRE(launch_gdn_gates<spec::generic>(arch::Cpu{}, args) == Status::kSuccess);
  CHECK(std::isnan(beta[0]));
  CHECK(std::isnan(g[0]));
  CHECK(launch_gdn_gates<spec::qwen3_5_moe_tiny>(arch::Cpu{}, args) == Status::kErrorInvalidProblem);  // 4 heads
}

TEST_CASE("gdn_gates: log1p on [0, 1] within 2 ulp of fp64") {
  double worst = 0;
  for (int i = 0; i <= 100000; ++i) {
    float const u = i == 0 ? 0.0f : std::ldexp(1.0f, -i % 140) * (1.0f + static_cast<float>(i % 977) / 977.0f) / 2.0f;
    if (u > 1.0f) continue;
    double const want = std::log1p(static_cast<double>(u));
    double const got = cpu::gdn_gates_detail::log1p_unit_f32(u);
    double const ulp = want == 0 ? 1e-45 : std::ldexp(1.0, std::ilogb(want) - 23);
    worst = std::max(worst, std::fabs(got - want) / ulp);
  }
  MESSAGE("log1p_unit_f32: worst error ", worst, " ulp");
  CHECK(worst <= 2.0);
}

TEST_CASE("embedding: rows decode as the format's dequantization; bad ids are refused") {
  int const vocab = 11, d = 256;
  auto table = test::random_floats(static_cast<std::size_t>(vocab * d), 41);
  std::vector<std::int32_t> tokens{3, 0, 10, 3};
  for (WeightFormat f : kAllWeightFormats) {
    CAPTURE(to_string(f));
    auto m = encode_matrix(f, table.data(), vocab, d);
    std::vector<float> y(tokens.size() * d), want(d);
    EmbeddingArgs a{};
    a.table = m.view;
    a.tokens = tokens.data();
    a.y = y.data();
    a.n_tokens = static_cast<std::int64_t>(tokens.size());
    REQUIRE(launch_embedding<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      dequantize_row(m.view, tokens[t], want.data());
      CHECK(std::vector<float>(y.begin() + static_cast<std::ptrdiff_t>(t * d), y.begin() + static_cast<std::ptrdiff_t>((t + 1) * d)) == want);
    }
    tokens[1] = vocab;
    CHECK(launch_embedding<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
    tokens[1] = 0;
  }
}

TEST_CASE("attention: the fused output gate equals the reference") {
  int const n_tok = 5, n_head = 4, n_kv = 2, d = 32;
  auto q = test::random_floats(static_cast<std::size_t>(n_tok * n_head * d), 51, -2, 2);
  auto k = test::random_floats(static_cast<std::size_t>(n_tok * n_kv * d), 52, -2, 2);
  auto v = test::random_floats(static_cast<std::size_t>(n_tok * n_kv * d), 53);
  // The gate lies in [query | gate] rows, as q_proj of qwen3_5_moe gives it.
  auto gate_rows = test::random_floats(static_cast<std::size_t>(n_tok * n_head * 2 * d), 54, -4, 4);
  std::vector<float> out(q.size()), ref_out(q.size()), out_static(q.size());
  kv::LayerCache cache(n_kv, d, kv::KvFormats{}, n_tok);
  cache.append(k.data(), v.data(), n_tok);
  AttentionArgs a{};
  a.q = q.data();
  a.kv = cache.view();
  a.n_tokens = n_tok;
  a.n_ctx = n_tok;
  a.n_head = n_head;
  a.n_head_kv = n_kv;
  a.d_head = d;
  a.scale = 0.2f;
  a.gate = gate_rows.data() + d;
  a.gate_token_stride = n_head * 2 * d;
  a.gate_head_stride = 2 * d;
  a.out = ref_out.data();
  ref::attention(a);
  a.out = out.data();
  REQUIRE(launch_attention<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  auto r = all_close<float, float>(out, ref_out, Tolerance{2e-5, 1e-5});
  CHECK_MESSAGE(r.ok, r.report);
  a.out = out_static.data();
  REQUIRE(launch_attention<spec::qwen3_5_moe_tiny>(arch::Cpu{}, a) == Status::kSuccess);
  CHECK(out_static == out);
  a.gate_token_stride = 4;  // shorter than a token's gates
  CHECK(launch_attention<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
}

TEST_CASE("router_topk with the router's GEMV: linear's logits, then their routing") {
  int const n_tok = 5, n_expert = 16, k = 4;
  std::int64_t const d = 96, rows = n_expert + 1;  // the experts', then the shared-expert gate
  auto const gate = test::random_floats(static_cast<std::size_t>(rows * d), 62, -1, 1);
  auto const x = test::random_floats(static_cast<std::size_t>(n_tok * d), 63, -1, 1);
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kBf16, WeightFormat::kQ8_0}) {
    CAPTURE(to_string(f));
    OwnedMatrix const m = encode_matrix(f, gate.data(), rows, d);
    std::size_t const slots = static_cast<std::size_t>(n_tok * k);
    // Apart: linear, then routing from its logits.
    std::vector<float> l_want(static_cast<std::size_t>(n_tok * rows)), w_want(slots), sg_want(n_tok);
    std::vector<std::int32_t> e_want(slots);
    LinearArgs l{};
    l.w = m.view, l.x = x.data(), l.y = l_want.data(), l.n_tokens = n_tok;
    REQUIRE(launch_linear<spec::generic>(arch::Cpu{}, l) == Status::kSuccess);
    RouterTopkArgs a{};
    a.logits = l_want.data(), a.logits_stride = rows, a.n_tokens = n_tok, a.n_expert = n_expert, a.n_expert_used = k;
    a.experts = e_want.data(), a.weights = w_want.data(), a.shared_weights = sg_want.data();
    REQUIRE(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
    // Together: the call's own logits and stride are not read.
    std::vector<float> l_got(l_want.size(), -1.0f), w_got(slots), sg_got(n_tok);
    std::vector<std::int32_t> e_got(slots);
    RouterGemv const gemv{m.view, x.data(), l_got.data()};
    a.gemv = &gemv;
    a.logits = nullptr, a.logits_stride = 3;
    a.experts = e_got.data(), a.weights = w_got.data(), a.shared_weights = sg_got.data();
    REQUIRE(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
    CHECK(l_got == l_want);
    CHECK(e_got == e_want);
    CHECK(w_got == w_want);
    CHECK(sg_got == sg_want);
    // A gate without the shared-expert gate's row, or no input: refused.
    RouterGemv short_gate = gemv;
    short_gate.gate.rows = n_expert;
    a.gemv = &short_gate;
    CHECK(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
    RouterGemv no_x = gemv;
    no_x.x = nullptr;
    a.gemv = &no_x;
    CHECK(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  }
}

TEST_CASE("router_topk: the shared-expert gate column is the sigmoid of its logit") {
  int const n_tok = 4, n_expert = 8, k = 2;
  auto logits = test::random_floats(static_cast<std::size_t>(n_tok * (n_expert + 1)), 61, -6, 6);
  std::vector<std::int32_t> e(static_cast<std::size_t>(n_tok * k)), e_ref(e.size());
  std::vector<float> w(e.size()), w_ref(e.size()), sg(n_tok), sg_ref(n_tok);
  RouterTopkArgs a{};
  a.logits = logits.data();
  a.logits_stride = n_expert + 1;
  a.n_tokens = n_tok;
  a.n_expert = n_expert;
  a.n_expert_used = k;
  a.experts = e_ref.data();
  a.weights = w_ref.data();
  a.shared_weights = sg_ref.data();
  ref::router_topk(a);
  a.experts = e.data();
  a.weights = w.data();
  a.shared_weights = sg.data();
  REQUIRE(launch_router_topk<spec::qwen3_5_moe_tiny>(arch::Cpu{}, a) == Status::kSuccess);
  CHECK(e == e_ref);
  auto r = all_close<float, float>(sg, sg_ref, Tolerance{1e-6, 1e-6});
  CHECK_MESSAGE(r.ok, r.report);
  r = all_close<float, float>(w, w_ref, Tolerance{1e-6, 1e-5});
  CHECK_MESSAGE(r.ok, r.report);
  a.logits_stride = n_expert;  // no room for the gate column
  CHECK(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
}
