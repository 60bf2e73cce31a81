// One table of every op the model launches (the idea of ggml's test-backend-ops): each case
// builds seeded inputs, runs the op's scalar reference, then the launcher of every compiled
// arch through both the static spec the shape belongs to (qwen3_5_moe_tiny) and the generic
// one, and compares every element. Archs without an implementation of an op, or without a
// device, are reported as skipped; the CUDA kernels' own tests (label gpu) run them on a GPU.
#include <doctest/doctest.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "qflash/generated/instances.hpp"
#include "qflash/kernels/add_rmsnorm/cpu.hpp"
#include "qflash/kernels/add_rmsnorm/ref.hpp"
#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/attention/ref.hpp"
#include "qflash/kernels/attention_decode/cpu.hpp"
#include "qflash/kernels/attention_decode/ref.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "qflash/kernels/causal_conv1d/cpu.hpp"
#include "qflash/kernels/causal_conv1d/ref.hpp"
#include "qflash/kernels/embedding/cpu.hpp"
#include "qflash/kernels/expert_ffn/cpu.hpp"
#include "qflash/kernels/expert_ffn/ref.hpp"
#include "qflash/kernels/gated_delta/cpu.hpp"
#include "qflash/kernels/gated_delta/ref.hpp"
#include "qflash/kernels/gated_rmsnorm/cpu.hpp"
#include "qflash/kernels/gated_rmsnorm/ref.hpp"
#include "qflash/kernels/gdn_decode/cpu.hpp"
#include "qflash/kernels/gdn_decode/ref.hpp"
#include "qflash/kernels/gdn_gates/cpu.hpp"
#include "qflash/kernels/gdn_gates/ref.hpp"
#include "qflash/kernels/linear/cpu.hpp"
#include "qflash/kernels/linear/ref.hpp"
#include "qflash/kernels/linear_group/cpu.hpp"
#include "qflash/kernels/linear_group/ref.hpp"
#include "qflash/kernels/qk_norm_rope/cpu.hpp"
#include "qflash/kernels/qk_norm_rope/ref.hpp"
#include "qflash/kernels/router_topk/cpu.hpp"
#include "qflash/kernels/router_topk/ref.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "qflash/spec/presets.hpp"
#include "support/attention_decode_case.hpp"
#include "support/expert_case.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using qflash::test::all_close;
using qflash::test::Tolerance;

namespace {

constexpr MoeSpec kTiny = spec::qwen3_5_moe_tiny;

std::vector<float> rnd(std::int64_t n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  return test::random_floats(static_cast<std::size_t>(n), seed, lo, hi);
}

/// The outcome of one (op, spec, arch) run against the reference.
struct Outcome {
  Status status = Status::kSuccess;
  test::CloseResult close;
};

Outcome compare(Status s, std::vector<float> const& got, std::vector<float> const& want, Tolerance tol) {
  Outcome o;
  o.status = s;
  if (s == Status::kSuccess) o.close = all_close<float, float>(got, want, tol);
  return o;
}

// Each runner: inputs from the seed, the reference into `want`, the launcher of <S, Arch>.
template <MoeSpec S, class Arch>
Outcome add_rmsnorm_case() {
  std::int64_t const rows = 5;
  int const d = kTiny.d_model;
  auto x = rnd(rows * d, 1), res = rnd(rows * d, 2), w = rnd(d, 3, -0.5f, 0.5f);
  auto res_ref = res;
  std::vector<float> y(x.size()), want(x.size());
  ref::add_rmsnorm(x.data(), res_ref.data(), w.data(), want.data(), rows, d, 1e-6f, NormWeight::kZeroCentered);
  AddRmsNormArgs a{};
  a.x = x.data();
  a.residual = res.data();
  a.weight = w.data();
  a.y = y.data();
  a.n_rows = rows;
  a.n_cols = d;
  a.weight_kind = NormWeight::kZeroCentered;
  auto o = compare(launch_add_rmsnorm<S>(Arch{}, a), y, want, test::tol::f32);
  if (o.close.ok) o.close = all_close<float, float>(res, res_ref, test::tol::f32);
  return o;
}

template <MoeSpec S, class Arch>
Outcome linear_case(WeightFormat f) {
  std::int64_t const T = 3, n_in = 256, n_out = kTiny.n_expert + 1;
  auto x = rnd(T * n_in, 4), wf = rnd(n_out * n_in, 5);
  auto w = encode_matrix(f, wf.data(), n_out, n_in);
  std::vector<float> y(static_cast<std::size_t>(T * n_out)), want(y.size());
  LinearArgs a{};
  a.w = w.view;
  a.x = x.data();
  a.n_tokens = T;
  a.y = want.data();
  ref::linear(a);
  a.y = y.data();
  return compare(launch_linear<S>(Arch{}, a), y, want, Tolerance{2e-5, 1e-5});
}

template <MoeSpec S, class Arch>
Outcome linear_group_case(WeightFormat f) {
  // Three parts: two into one output at its stride (the second accumulating), one alone.
  std::int64_t const T = 3, n_in = 256, rows[] = {kTiny.n_expert + 1, 7, 5};
  auto x = rnd(T * n_in, 41);
  std::vector<OwnedMatrix> w;
  for (int i = 0; i < 3; ++i) {
    auto wf = rnd(rows[i] * n_in, 42 + static_cast<std::uint64_t>(i));
    w.push_back(encode_matrix(f, wf.data(), rows[i], n_in));
  }
  std::int64_t const wide = rows[0] + rows[1];  // a row: part 0's outputs, then part 1's
  auto y = rnd(T * wide + T * rows[2], 45), want = y;
  LinearGroupArgs a{};
  a.n_parts = 3;
  for (int i = 0; i < 3; ++i) {
    a.parts[i].w = w[static_cast<std::size_t>(i)].view;
    a.parts[i].x = x.data();
    a.parts[i].n_tokens = T;
  }
  a.parts[0].y_stride = a.parts[1].y_stride = wide;
  a.parts[1].accumulate = true;
  auto point = [&](std::vector<float>& out) {
    a.parts[0].y = out.data();
    a.parts[1].y = out.data() + rows[0];
    a.parts[2].y = out.data() + T * wide;
  };
  point(want);
  ref::linear_group(a);
  point(y);
  return compare(launch_linear_group<S>(Arch{}, a), y, want, Tolerance{2e-5, 1e-5});
}

template <MoeSpec S, class Arch>
Outcome expert_ffn_case() {
  int const d = kTiny.d_model, ff = kTiny.d_ff_expert, E = kTiny.n_expert, K = kTiny.n_expert_used;
  std::int64_t const T = 6;
  test::ExpertCase c;
  c.add_experts(E, WeightFormat::kBf16, WeightFormat::kBf16, d, ff, 10);
  c.set_tokens(T, d, K, 6);
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < K; ++j) {
      c.routes.push_back(static_cast<std::int32_t>((t * 3 + j * 5) % E));
      c.route_weights.push_back(j == 0 ? 0.6f : 0.4f / (K - 1));
    }
  std::vector<float> y(static_cast<std::size_t>(T * d), 0.25f), want(y);
  ExpertFfnArgs a = c.args(want.data());
  ref::expert_ffn(a);
  a.out = y.data();
  return compare(launch_expert_ffn<S>(Arch{}, a), y, want, Tolerance{5e-5, 1e-5});
}

template <MoeSpec S, class Arch>
Outcome router_topk_case() {
  int const E = kTiny.n_expert, K = kTiny.n_expert_used;
  std::int64_t const T = 7;
  auto logits = rnd(T * (E + 1), 7, -4, 4);
  std::vector<std::int32_t> ex(static_cast<std::size_t>(T * K)), ex_ref(ex.size());
  std::vector<float> w(ex.size()), w_ref(ex.size()), sg(static_cast<std::size_t>(T)), sg_ref(sg.size());
  RouterTopkArgs a{};
  a.logits = logits.data();
  a.logits_stride = E + 1;
  a.n_tokens = T;
  a.n_expert = E;
  a.n_expert_used = K;
  a.experts = ex_ref.data();
  a.weights = w_ref.data();
  a.shared_weights = sg_ref.data();
  ref::router_topk(a);
  a.experts = ex.data();
  a.weights = w.data();
  a.shared_weights = sg.data();
  auto o = compare(launch_router_topk<S>(Arch{}, a), w, w_ref, Tolerance{1e-6, 1e-5});
  if (o.status == Status::kSuccess && o.close.ok) {
    o.close = all_close<float, float>(sg, sg_ref, Tolerance{1e-6, 1e-6});
    if (ex != ex_ref) o.close = {false, 1, "expert choices differ"};
  }
  return o;
}

template <MoeSpec S, class Arch>
Outcome attention_case() {
  int const H = kTiny.n_head, KV = kTiny.n_head_kv, D = kTiny.d_head;
  std::int64_t const T = 4, ctx = 9;
  auto q = rnd(T * H * D, 8, -2, 2), k = rnd(ctx * KV * D, 9, -2, 2), v = rnd(ctx * KV * D, 10);
  auto gate = rnd(T * H * 2 * D, 11, -3, 3);
  std::vector<float> y(q.size()), want(q.size());
  kv::LayerCache cache(KV, D, kv::KvFormats{}, ctx);
  cache.append(k.data(), v.data(), ctx);
  AttentionArgs a{};
  a.q = q.data();
  a.kv = cache.view();
  a.n_tokens = T;
  a.n_ctx = ctx;
  a.n_head = H;
  a.n_head_kv = KV;
  a.d_head = D;
  a.scale = 0.18f;
  a.gate = gate.data() + D;
  a.gate_token_stride = H * 2 * D;
  a.gate_head_stride = 2 * D;
  a.out = want.data();
  ref::attention(a);
  a.out = y.data();
  return compare(launch_attention<S>(Arch{}, a), y, want, Tolerance{2e-5, 1e-5});
}

template <MoeSpec S, class Arch>
Outcome attention_decode_case() {
  // Three sequences (a first token, one inside a block, one past it) in one pool, built alike
  // for the reference and the launcher (both append the new tokens); row 1 is no sequence's.
  test::DecodeCase const c{kTiny.n_head, kTiny.n_head_kv, kTiny.d_head, true, {0, 7, 20}, {2, 0, 3}, 4};
  std::vector<kv::KvFormats> const heads(static_cast<std::size_t>(c.n_kv));
  test::DecodeStep ref_step(c, heads), step(c, heads);
  std::vector<float> want, y;
  ref::attention_decode(ref_step.args(c, want));
  Status const st = launch_attention_decode<S>(Arch{}, step.args(c, y));
  Outcome o = compare(st, c.decoding_rows(y), c.decoding_rows(want), Tolerance{2e-5, 1e-5});
  if (o.status == Status::kSuccess && o.close.ok && c.written_outside(y) != 0) {
    o.close.ok = false;
    o.close.report = "values outside the decoding rows were written";
  }
  return o;
}

template <MoeSpec S, class Arch>
Outcome qk_norm_rope_case() {
  int const H = kTiny.n_head, D = kTiny.d_head;
  std::int64_t const T = 5;
  auto x = rnd(T * H * 2 * D, 12, -3, 3), w = rnd(D, 13, -0.5f, 0.5f);
  std::vector<std::int64_t> pos{0, 3, 17, 250, 1000};
  std::vector<float> y(static_cast<std::size_t>(T * H * D)), want(y.size());
  QkNormRopeArgs a{};
  a.x = x.data();
  a.head_stride = 2 * D;
  a.weight = w.data();
  a.positions = pos.data();
  a.n_tokens = T;
  a.n_head = H;
  a.d_head = D;
  a.rotary_dim = 8;
  a.theta = 1e7f;
  a.weight_kind = NormWeight::kZeroCentered;
  a.y = want.data();
  ref::qk_norm_rope(a);
  a.y = y.data();
  return compare(launch_qk_norm_rope<S>(Arch{}, a), y, want, Tolerance{5e-4, 1e-5});
}

template <MoeSpec S, class Arch>
Outcome causal_conv1d_case() {
  int const C = 2 * kTiny.n_head_k_linear * kTiny.d_head_k_linear + kTiny.n_head_v_linear * kTiny.d_head_v_linear;
  int const K = kTiny.d_conv;
  std::int64_t const T = 6;
  auto x = rnd(T * C, 14), w = rnd(C * K, 15), state = rnd(C * (K - 1), 16);
  auto state_ref = state;
  std::vector<float> y(x.size()), want(x.size());
  CausalConv1dArgs a{};
  a.x = x.data();
  a.weight = w.data();
  a.n_tokens = T;
  a.n_channels = C;
  a.d_conv = K;
  a.state = state_ref.data();
  a.y = want.data();
  ref::causal_conv1d(a);
  a.state = state.data();
  a.y = y.data();
  auto o = compare(launch_causal_conv1d<S>(Arch{}, a), y, want, Tolerance{1e-5, 1e-5});
  if (o.status == Status::kSuccess && o.close.ok) o.close = all_close<float, float>(state, state_ref, Tolerance{0, 0});
  return o;
}

template <MoeSpec S, class Arch>
Outcome gated_delta_case(DeltaRuleForm form) {
  int const hk = kTiny.n_head_k_linear, hv = kTiny.n_head_v_linear, dk = kTiny.d_head_k_linear, dv = kTiny.d_head_v_linear;
  std::int64_t const T = 21;
  auto q = rnd(T * hk * dk, 17), k = rnd(T * hk * dk, 18), v = rnd(T * hv * dv, 19);
  auto g = rnd(T * hv, 20, -0.5f, 0.0f), beta = rnd(T * hv, 21, 0.0f, 1.0f), state = rnd(hv * dk * dv, 22);
  auto state_ref = state;
  std::vector<float> y(v.size()), want(v.size());
  GatedDeltaArgs a{};
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.g = g.data();
  a.beta = beta.data();
  a.n_tokens = T;
  a.n_head_k = hk;
  a.n_head_v = hv;
  a.d_k = dk;
  a.d_v = dv;
  a.form = form;
  a.chunk_size = 8;
  a.state = state_ref.data();
  a.out = want.data();
  ref::gated_delta(a);
  a.state = state.data();
  a.out = y.data();
  auto o = compare(launch_gated_delta<S>(Arch{}, a), y, want, Tolerance{5e-6, 5e-5});
  if (o.status == Status::kSuccess && o.close.ok) o.close = all_close<float, float>(state, state_ref, Tolerance{5e-6, 5e-5});
  return o;
}

template <MoeSpec S, class Arch>
Outcome gated_rmsnorm_case() {
  int const dv = kTiny.d_head_v_linear;
  std::int64_t const rows = 12;
  auto x = rnd(rows * dv, 23), z = rnd(rows * dv, 24, -3, 3), w = rnd(dv, 25, 0.5f, 1.5f);
  std::vector<float> y(x.size()), want(x.size());
  GatedRmsNormArgs a{};
  a.x = x.data();
  a.z = z.data();
  a.weight = w.data();
  a.n_rows = rows;
  a.n_cols = dv;
  a.y = want.data();
  ref::gated_rmsnorm(a);
  a.y = y.data();
  return compare(launch_gated_rmsnorm<S>(Arch{}, a), y, want, Tolerance{1e-5, 1e-5});
}

template <MoeSpec S, class Arch>
Outcome gdn_gates_case() {
  int const hv = kTiny.n_head_v_linear;
  std::int64_t const T = 9;
  auto b = rnd(T * hv, 26, -25, 25), g = rnd(T * hv, 27, -25, 25), dt = rnd(hv, 28), neg_a = rnd(hv, 29, -3, -0.1f);
  auto b_ref = b, g_ref = g;
  GdnGatesArgs a{};
  a.dt_bias = dt.data();
  a.neg_a = neg_a.data();
  a.n_tokens = T;
  a.n_head_v = hv;
  a.beta = b_ref.data();
  a.g = g_ref.data();
  ref::gdn_gates(a);
  a.beta = b.data();
  a.g = g.data();
  auto o = compare(launch_gdn_gates<S>(Arch{}, a), b, b_ref, Tolerance{1e-6, 1e-6});
  if (o.status == Status::kSuccess && o.close.ok) o.close = all_close<float, float>(g, g_ref, Tolerance{1e-6, 1e-5});
  return o;
}

template <MoeSpec S, class Arch>
Outcome gdn_decode_case() {
  int const hk = kTiny.n_head_k_linear, hv = kTiny.n_head_v_linear, dk = kTiny.d_head_k_linear;
  int const dv = kTiny.d_head_v_linear, k = kTiny.d_conv;
  std::int64_t const cd = 2 * hk * dk + hv * dv, T = 5;
  std::vector<std::int64_t> rows{3, 0, 4};
  auto x = rnd(T * cd, 31), w = rnd(cd * k, 32), g = rnd(T * hv, 33, -0.5f, 0.0f), beta = rnd(T * hv, 34, 0.0f, 1.0f);
  std::vector<std::vector<float>> conv(rows.size()), state(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    conv[i] = rnd(cd * (k - 1), 35 + i);
    state[i] = rnd(std::int64_t{hv} * dk * dv, 40 + i, -0.3f, 0.3f);
  }
  auto conv_ref = conv, state_ref = state;
  std::vector<float> y(static_cast<std::size_t>(T * cd)), out(static_cast<std::size_t>(T * hv * dv));
  auto y_ref = y, out_ref = out;
  auto run = [&](std::vector<std::vector<float>>& cs, std::vector<std::vector<float>>& ss, float* conv_out,
                 float* o, auto&& launch) {
    std::vector<float*> cp, sp;
    for (auto& c : cs) cp.push_back(c.data());
    for (auto& s : ss) sp.push_back(s.data());
    GdnDecodeArgs a{};
    a.x = x.data();
    a.g = g.data();
    a.beta = beta.data();
    a.conv_out = conv_out;
    a.out = o;
    a.rows = rows.data();
    a.conv_state = cp.data();
    a.state = sp.data();
    a.conv_weight = w.data();
    a.n_seqs = static_cast<int>(rows.size());
    a.n_head_k = hk;
    a.n_head_v = hv;
    a.d_k = dk;
    a.d_v = dv;
    a.d_conv = k;
    return launch(a);
  };
  run(conv_ref, state_ref, y_ref.data(), out_ref.data(), [](GdnDecodeArgs const& a) {
    ref::gdn_decode(a);
    return Status::kSuccess;
  });
  Status const st = run(conv, state, y.data(), out.data(),
                        [](GdnDecodeArgs const& a) { return launch_gdn_decode<S>(Arch{}, a); });
  auto o = compare(st, out, out_ref, Tolerance{5e-6, 5e-5});
  for (std::size_t i = 0; i < rows.size() && o.status == Status::kSuccess && o.close.ok; ++i)
    o.close = all_close<float, float>(state[i], state_ref[i], Tolerance{5e-6, 5e-5});
  if (o.status == Status::kSuccess && o.close.ok) o.close = all_close<float, float>(y, y_ref, Tolerance{1e-6, 1e-5});
  return o;
}

template <MoeSpec S, class Arch>
Outcome embedding_case(WeightFormat f) {
  int const vocab = 19, d = kTiny.d_model;
  auto table = rnd(vocab * d, 30);
  auto m = encode_matrix(f, table.data(), vocab, d);
  std::vector<std::int32_t> tokens{0, 18, 7, 7};
  std::vector<float> y(tokens.size() * d), want(y.size());
  for (std::size_t t = 0; t < tokens.size(); ++t) dequantize_row(m.view, tokens[t], want.data() + t * d);
  EmbeddingArgs a{};
  a.table = m.view;
  a.tokens = tokens.data();
  a.y = y.data();
  a.n_tokens = static_cast<std::int64_t>(tokens.size());
  return compare(launch_embedding<S>(Arch{}, a), y, want, Tolerance{0, 0});
}

/// One row of the table: an op (and its variant) with a runner per (spec, arch).
struct OpCase {
  std::string name;
  std::function<Outcome()> cpu_static, cpu_generic;
};

std::vector<OpCase> table() {
  std::vector<OpCase> t;
  auto add = [&](std::string name, auto run_static, auto run_generic) {
    t.push_back({std::move(name), run_static, run_generic});
  };
  using arch::Cpu;
  add("add_rmsnorm", add_rmsnorm_case<kTiny, Cpu>, add_rmsnorm_case<spec::generic, Cpu>);
  for (WeightFormat f : kAllWeightFormats) {
    add("linear/" + std::string(to_string(f)), [f] { return linear_case<kTiny, Cpu>(f); },
        [f] { return linear_case<spec::generic, Cpu>(f); });
    add("linear_group/" + std::string(to_string(f)), [f] { return linear_group_case<kTiny, Cpu>(f); },
        [f] { return linear_group_case<spec::generic, Cpu>(f); });
    if (row_fits(f, kTiny.d_model))
      add("embedding/" + std::string(to_string(f)), [f] { return embedding_case<kTiny, Cpu>(f); },
          [f] { return embedding_case<spec::generic, Cpu>(f); });
  }
  add("expert_ffn", expert_ffn_case<kTiny, Cpu>, expert_ffn_case<spec::generic, Cpu>);
  add("router_topk", router_topk_case<kTiny, Cpu>, router_topk_case<spec::generic, Cpu>);
  add("attention", attention_case<kTiny, Cpu>, attention_case<spec::generic, Cpu>);
  add("attention_decode", attention_decode_case<kTiny, Cpu>, attention_decode_case<spec::generic, Cpu>);
  add("qk_norm_rope", qk_norm_rope_case<kTiny, Cpu>, qk_norm_rope_case<spec::generic, Cpu>);
  add("causal_conv1d", causal_conv1d_case<kTiny, Cpu>, causal_conv1d_case<spec::generic, Cpu>);
  for (auto form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked})
    add("gated_delta/" + std::string(to_string(form)), [form] { return gated_delta_case<kTiny, Cpu>(form); },
        [form] { return gated_delta_case<spec::generic, Cpu>(form); });
  add("gated_rmsnorm", gated_rmsnorm_case<kTiny, Cpu>, gated_rmsnorm_case<spec::generic, Cpu>);
  add("gdn_gates", gdn_gates_case<kTiny, Cpu>, gdn_gates_case<spec::generic, Cpu>);
  add("gdn_decode", gdn_decode_case<kTiny, Cpu>, gdn_decode_case<spec::generic, Cpu>);
  return t;
}

}  // namespace

TEST_CASE("op harness: every op x {static, generic} spec x every compiled arch equals its reference") {
  int passed = 0, skipped = 0;
  for (auto const& c : table()) {
    for (auto arch_id : instances::kArchs) {
      std::string const arch_name(arch::to_string(arch_id));
      if (arch_id != arch::ArchId::kCpu) {
        // CUDA launchers need device memory and a device: their gpu-labelled tests run them.
        ++skipped;
        continue;
      }
      for (bool is_static : {true, false}) {
        CAPTURE(c.name);
        CAPTURE(arch_name);
        CAPTURE(is_static);
        Outcome const o = is_static ? c.cpu_static() : c.cpu_generic();
        REQUIRE(o.status == Status::kSuccess);
        CHECK_MESSAGE(o.close.ok, o.close.report);
        ++passed;
      }
    }
  }
  MESSAGE("op harness: ", passed, " (op, spec, arch) runs against their references, ", skipped,
          " CUDA (op, arch) pairs left to the gpu-labelled tests");
  CHECK(passed >= 2 * 20);
}
