// expert_ffn on CUDA: every compiled instance (spec x arch) this device runs, every weight
// format the spec compiles, against the CPU twin, over the spec's shapes (or several when they
// are dynamic): one token (rows by slot, down and combine in one launch) and many (tiles of several rows per expert), unused route slots, a
// shared expert of another width, gate and up in different formats, fused and separate SwiGLU,
// rows too short for the vector path; prompts on tensor cores (bf16, fp8 and the block
// formats; 16-row tiles, the shared expert merged or not); 256 experts, 8 a token; LoRA updates of two adapters and
// none, token by token (more runs than one launch takes), on both paths; and the launch CUDA
// refuses (experts not at one stride). Tolerance, relative to each token's largest output: fp32 sums in another order and
// the device's expf in SwiGLU (H200: up to ~1e-4); with block-format rows, an activation a few
// ulp off can move its 8-bit code by one step, which shifts the whole row (H200: ~1e-3).
#include "gpu/gpu_main.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "qflash/kernels/expert_ffn/cpu.hpp"
#include "qflash/kernels/expert_ffn/stacked.hpp"
#include "qflash/kernels/linear/block_codes.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "support/expert_case.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using test::all_close;
using test::Tolerance;
using test::gpu::DeviceArray;

namespace {

constexpr Tolerance kElements{1e-5, 5e-4};
constexpr Tolerance kBlocks{1e-5, 1e-2};

/// A case's experts on the device: each projection of the routed experts stacked in one
/// buffer (fp8 scale grids too), as the device upload lays them out; the shared expert's own.
class DeviceExperts {
 public:
  explicit DeviceExperts(test::ExpertCase const& c) {
    experts_.resize(c.experts.size());
    for (WeightView ExpertWeights::*p : {&ExpertWeights::gate, &ExpertWeights::up, &ExpertWeights::down}) {
      std::vector<WeightView> host;
      for (auto const& e : c.experts) host.push_back(e.*p);
      std::vector<WeightView> const dev = stack(host);
      for (std::size_t e = 0; e < dev.size(); ++e) experts_[e].*p = dev[e];
    }
    if (c.shared) shared_ = ExpertWeights{stack({c.shared->gate})[0], stack({c.shared->up})[0], stack({c.shared->down})[0]};
  }
  std::vector<ExpertWeights>& experts() { return experts_; }
  ExpertWeights const* shared() const { return shared_ ? &*shared_ : nullptr; }

 private:
  /// Copies of `host` one after another in one device buffer; their views there.
  std::vector<WeightView> stack(std::vector<WeightView> const& host) {
    std::vector<std::byte> bytes;
    std::vector<float> scales;
    std::int64_t const scale_floats = fp8_scale_blocks(host[0].rows) * fp8_scale_blocks(host[0].cols);
    for (WeightView const& w : host) {
      auto const* b = static_cast<std::byte const*>(w.data);
      bytes.insert(bytes.end(), b, b + w.bytes());
      if (w.format == WeightFormat::kFp8E4m3) scales.insert(scales.end(), w.scales, w.scales + scale_floats);
    }
    auto& db = bytes_.emplace_back(bytes);
    auto& ds = scales_.emplace_back(scales);
    std::vector<WeightView> dev(host);
    for (std::size_t e = 0; e < dev.size(); ++e) {
      dev[e].data = db.get() + static_cast<std::int64_t>(e) * host[0].bytes();
      if (dev[e].format == WeightFormat::kFp8E4m3) dev[e].scales = ds.get() + static_cast<std::int64_t>(e) * scale_floats;
    }
    return dev;
  }

  std::deque<DeviceArray<std::byte>> bytes_;
  std::deque<DeviceArray<float>> scales_;
  std::vector<ExpertWeights> experts_;
  std::optional<ExpertWeights> shared_;
};

/// An adapter's expert updates on the device, laid out as upload_lora lays them: each routed
/// projection's stacked at one rank (stack_low_rank), the shared expert's as they are.
class DeviceLora {
 public:
  explicit DeviceLora(ExpertLora const& h) {
    lists_[0] = stacked(h.gate), lists_[1] = stacked(h.up), lists_[2] = stacked(h.down);
    lora_ = {lists_[0], lists_[1], lists_[2], single(h.shared_gate), single(h.shared_up), single(h.shared_down)};
  }
  DeviceLora(DeviceLora const&) = delete;
  DeviceLora& operator=(DeviceLora const&) = delete;
  ExpertLora const* get() const { return &lora_; }

 private:
  std::vector<LowRank> stacked(std::span<LowRank const> host) {
    StackedLowRank const st = stack_low_rank(host);
    if (st.rank == 0) return {};
    float* const a = arrays_.emplace_back(st.a).get();
    float* const b = arrays_.emplace_back(st.b).get();
    std::vector<LowRank> dev;
    for (std::size_t e = 0; e < host.size(); ++e) {
      LowRank u = st.at(e);
      u.a.data = a + static_cast<std::int64_t>(e) * st.rank * st.n_in;
      u.b.data = b + static_cast<std::int64_t>(e) * st.n_out * st.rank;
      dev.push_back(u);
    }
    return dev;
  }
  LowRank single(LowRank const& host) {
    if (host.empty()) return {};
    auto upload = [&](WeightView v) {
      auto const* f = static_cast<float const*>(v.data);
      v.data = arrays_.emplace_back(std::vector<float>(f, f + v.rows * v.cols)).get();
      return v;
    };
    return {upload(host.a), upload(host.b)};
  }

  std::deque<DeviceArray<float>> arrays_;
  std::array<std::vector<LowRank>, 3> lists_;
  ExpertLora lora_;
};

struct Case {
  WeightFormat gate, up, down;  // the routed experts'
  std::int64_t d_model, d_ff, tokens;
  int n_expert = 6, k = 4;
  std::optional<WeightFormat> shared = std::nullopt;  // the shared expert's format, if any
  std::int64_t d_ff_shared = 0;
  bool fused = true;
  bool lora = false;  // tokens take adapter 1, adapter 2 and none in turn
  bool accumulate = true;  // false: out starts as NaN, which must not be read
  int unused = 0;          // slots every token leaves unused, the last ones
};

bool fits(WeightFormat f, std::int64_t d_model, std::int64_t d_ff) { return row_fits(f, d_model) && row_fits(f, d_ff); }

/// Case c, its matrices drawn from `cache`.
template <MoeSpec S, class Tag>
void check_case(Case const& c, test::MatrixCache& cache) {
  CAPTURE(to_string(c.gate));
  CAPTURE(to_string(c.up));
  CAPTURE(to_string(c.down));
  CAPTURE(c.d_model);
  CAPTURE(c.d_ff);
  CAPTURE(c.tokens);
  CAPTURE(c.shared.has_value());
  CAPTURE(c.fused);
  CAPTURE(c.lora);
  CAPTURE(c.accumulate);
  CAPTURE(c.unused);
  test::ExpertCase h;
  h.cache = &cache;
  for (int e = 0; e < c.n_expert; ++e) {
    std::uint64_t const seed = 100 + 3 * static_cast<std::uint64_t>(e);
    h.experts.push_back({h.matrix(c.gate, c.d_ff, c.d_model, seed), h.matrix(c.up, c.d_ff, c.d_model, seed + 1),
                         h.matrix(c.down, c.d_model, c.d_ff, seed + 2)});
  }
  if (c.shared) h.shared = h.expert(*c.shared, *c.shared, c.d_model, c.d_ff_shared, 90);
  h.set_tokens(c.tokens, c.d_model, c.k, 7);
  for (std::int64_t t = 0; t < c.tokens; ++t) {
    for (int j = 0; j < c.k; ++j) {
      // Token 2 and every fifth use one slot fewer (dynamic routing), as does a lone token
      // beside a shared expert or of gate and up apart; the rest spread over the experts.
      bool const unused = j >= c.k - c.unused ||
                          (j == c.k - 1 && (t == 2 || t % 5 == 4 || (c.tokens == 1 && (c.shared || c.gate != c.up))));
      h.routes.push_back(unused ? kNoExpert : static_cast<std::int32_t>((t * 3 + j * 7) % c.n_expert));
      h.route_weights.push_back(unused ? 0.0f : 0.4f - 0.05f * static_cast<float>(j));
    }
    h.shared_weights.push_back(0.5f + 0.01f * static_cast<float>(t % 7));
  }
  auto const out0 = c.accumulate ? test::random_floats(static_cast<std::size_t>(c.tokens * c.d_model), 9, -1, 1)
                                 : std::vector<float>(static_cast<std::size_t>(c.tokens * c.d_model),
                                                      std::numeric_limits<float>::quiet_NaN());
  std::vector<float> cpu = out0;
  ExpertFfnArgs a = h.args(cpu.data());
  a.fused_swiglu = c.fused;
  a.accumulate = c.accumulate;
  // LoRA: adapter 1 (rank 4) updates every routed projection and the shared expert's down;
  // adapter 2 the routed up projections only, at ranks 2 and 1 (expert 1: none).
  std::vector<LowRank> g1, u1, d1, u2;
  ExpertLora l1, l2;
  std::vector<ExpertLora const*> token_lora;
  if (c.lora) {
    auto low_rank = [&](std::int64_t r, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
      return LowRank{h.matrix(WeightFormat::kF32, r, cols, seed), h.matrix(WeightFormat::kF32, rows, r, seed + 1)};
    };
    for (int e = 0; e < c.n_expert; ++e) {
      std::uint64_t const seed = 500 + 10 * static_cast<std::uint64_t>(e);
      g1.push_back(low_rank(4, c.d_ff, c.d_model, seed));
      u1.push_back(low_rank(4, c.d_ff, c.d_model, seed + 2));
      d1.push_back(low_rank(4, c.d_model, c.d_ff, seed + 4));
      u2.push_back(e == 1 ? LowRank{} : low_rank(e % 2 ? 1 : 2, c.d_ff, c.d_model, seed + 6));
    }
    l1 = {g1, u1, d1, {}, {}, c.shared ? low_rank(4, c.d_model, c.d_ff_shared, 590) : LowRank{}};
    l2 = {{}, u2, {}, {}, {}, {}};
    for (std::int64_t t = 0; t < c.tokens; ++t) token_lora.push_back(t % 3 == 0 ? &l1 : t % 3 == 1 ? &l2 : nullptr);
    a.token_lora = token_lora.data();
  }
  REQUIRE(launch_expert_ffn<S>(arch::Cpu{}, a) == Status::kSuccess);

  DeviceExperts dev(h);
  DeviceArray<float> x(h.x), weights(h.route_weights), shared_weights(h.shared_weights), out(out0);
  DeviceArray<std::int32_t> routes(h.routes);
  a.experts = dev.experts();
  a.shared = dev.shared();
  a.x = x.get(), a.routes = routes.get(), a.route_weights = weights.get(), a.out = out.get();
  a.shared_weights = c.shared ? shared_weights.get() : nullptr;
  DeviceLora const dev_l1(l1), dev_l2(l2);
  std::vector<ExpertLora const*> dev_token_lora;
  for (ExpertLora const* l : token_lora) dev_token_lora.push_back(l == &l1 ? dev_l1.get() : l ? dev_l2.get() : nullptr);
  a.token_lora = c.lora ? dev_token_lora.data() : nullptr;
  REQUIRE(launch_expert_ffn<S>(Tag{}, a, nullptr) == Status::kSuccess);
  QFLASH_TEST_CUDA(cudaDeviceSynchronize());
  bool const blocks = block_values(c.down) > 1 || (c.shared && block_values(*c.shared) > 1);
  auto const r = test::rows_close<float, float>(out.download(), cpu, static_cast<std::size_t>(c.d_model),
                                               blocks ? kBlocks : kElements);
  CHECK_MESSAGE(r.ok, "GPU vs CPU twin: ", r.report);

  // Experts not at one stride: refused before anything runs.
  if (c.n_expert > 2 && c.tokens == 1) {
    std::swap(dev.experts()[1].up, dev.experts()[2].up);
    CHECK(launch_expert_ffn<S>(Tag{}, a, nullptr) == Status::kErrorNotSupported);
    std::swap(dev.experts()[1].up, dev.experts()[2].up);
  }
}

template <class Tag, std::size_t I>
void check_instance() {
  constexpr MoeSpec S = instances::kSpecs[I];
  CAPTURE(instances::kSpecNames[I]);
  CAPTURE(Tag::name);
  std::int64_t const d_model = S.d_model != kDynamic ? S.d_model : 256;
  std::int64_t const d_ff = S.d_ff_expert != kDynamic ? S.d_ff_expert : 256;
  std::int64_t const d_ff_shared = S.d_ff_shared > 0 ? S.d_ff_shared : 512;
  // The emulator takes the model-sized specs (2048 wide) in bf16 alone: every format there would
  // take it a quarter of an hour; the smaller specs run every format through the same kernels.
  bool const every_format = !test::gpu::kEmulated || d_model < 1024;
  test::MatrixCache cache;  // the cases draw the same experts again and again
  auto const check = [&](Case const& c) { check_case<S, Tag>(c, cache); };
  for (WeightFormat f : kAllWeightFormats) {
    if ((S.weights != WeightFormat::kAny && S.weights != f) || !fits(f, d_model, d_ff)) continue;
    if (!every_format && f != WeightFormat::kBf16 && S.weights == WeightFormat::kAny) continue;
    for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{3}, std::int64_t{37}})
      check({.gate = f, .up = f, .down = f, .d_model = d_model, .d_ff = d_ff, .tokens = tokens});
    // One token by slot without a shared expert, written and added to: a slot unused, then all.
    for (int unused : {1, 4})
      for (bool accumulate : {false, true})
        check({.gate = f, .up = f, .down = f, .d_model = d_model, .d_ff = d_ff, .tokens = 1,
               .accumulate = accumulate, .unused = unused});
    if (fits(f, d_model, d_ff_shared)) {
      Case c{.gate = f, .up = f, .down = f, .d_model = d_model, .d_ff = d_ff, .tokens = 1, .shared = f,
             .d_ff_shared = d_ff_shared};
      check(c);
      // One token, the shared expert merged: rows by slot, down and combine in one launch; at
      // the most slots that takes (15 and the shared expert) and one past it (grouped again).
      for (int k : {4, 15, 16}) {
        Case one = c;
        one.d_ff_shared = d_ff, one.n_expert = 20, one.k = k;
        check(one);
      }
      // Written rather than added to (as the model's MoE block calls it): by slot and grouped.
      for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{3}}) {
        Case w = c;
        w.d_ff_shared = d_ff, w.tokens = tokens, w.accumulate = false;
        check(w);
      }
      c.tokens = 19, c.fused = false;
      check(c);
      // LoRA on CUDA cores: a decode step (3 tokens) and 19 tokens in 13 runs.
      for (std::int64_t tokens : {std::int64_t{3}, std::int64_t{19}}) {
        Case l = c;
        l.tokens = tokens, l.fused = true, l.lora = true;
        check(l);
      }
      if (f == WeightFormat::kBf16 || f == WeightFormat::kFp8E4m3 || linear_cuda::reads_codes(f)) {
        // Tensor cores: the shared expert in its own launches, then merged; each with LoRA too.
        c.tokens = 40, c.fused = true;
        for (std::int64_t d_ff_shared_case : {d_ff_shared, d_ff})
          for (bool lora : {false, true}) {
            c.d_ff_shared = d_ff_shared_case, c.lora = lora;
            check(c);
          }
      }
    }
  }
  if constexpr (S.weights == WeightFormat::kAny) {
    // Gate, up and down each in its own format, the shared expert in yet another.
    if (fits(WeightFormat::kQ8_0, d_model, d_ff))
      check({.gate = WeightFormat::kBf16, .up = WeightFormat::kQ8_0, .down = WeightFormat::kFp8E4m3,
             .d_model = d_model, .d_ff = d_ff, .tokens = 9, .shared = WeightFormat::kF16,
             .d_ff_shared = d_ff_shared});
    // One token by slot, gate, up and down each in its own format, gate and up apart.
    if (fits(WeightFormat::kQ4K, d_model, d_ff))
      check({.gate = WeightFormat::kQ8_0, .up = WeightFormat::kBf16, .down = WeightFormat::kQ4K,
             .d_model = d_model, .d_ff = d_ff, .tokens = 1});
    // A prompt of block formats as GGUF files mix them: down in q6_k, the shared expert in q8_0.
    if (fits(WeightFormat::kQ4K, d_model, d_ff) && fits(WeightFormat::kQ8_0, d_model, d_ff_shared))
      check({.gate = WeightFormat::kQ4K, .up = WeightFormat::kQ4K, .down = WeightFormat::kQ6K,
             .d_model = d_model, .d_ff = d_ff, .tokens = 40, .shared = WeightFormat::kQ8_0,
             .d_ff_shared = d_ff_shared});
    if (S.d_model == kDynamic && S.d_ff_expert == kDynamic) {  // rows too short or odd for the vector path
      check({.gate = WeightFormat::kBf16, .up = WeightFormat::kBf16, .down = WeightFormat::kF32,
             .d_model = 200, .d_ff = 100, .tokens = 6, .n_expert = 5, .k = 2,
             .shared = WeightFormat::kFp8E4m3, .d_ff_shared = 60});
      // Qwen3.6's routing width, 256 experts and 8 a token, with a shared expert: one token
      // (rows by slot), prompts grouped by expert on the device: 40 tokens on the GEMV, 160 on
      // the tensor cores (5 rows an expert on average: every tile short of its 16 rows).
      for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{40}, std::int64_t{160}})
        check({.gate = WeightFormat::kBf16, .up = WeightFormat::kBf16, .down = WeightFormat::kBf16,
               .d_model = 64, .d_ff = 32, .tokens = tokens, .n_expert = 256, .k = 8,
               .shared = WeightFormat::kBf16, .d_ff_shared = 32});
      // int4 rows that end mid-group, on the tensor cores (40 tokens) and the GEMV (3).
      for (std::int64_t tokens : {std::int64_t{40}, std::int64_t{3}})
        check({.gate = WeightFormat::kInt4, .up = WeightFormat::kInt4, .down = WeightFormat::kInt4,
               .d_model = 200, .d_ff = 100, .tokens = tokens, .n_expert = 5, .k = 2,
               .shared = WeightFormat::kInt4, .d_ff_shared = 60});
    }
  }
}

template <class Tag>
void check_arch() {
  test::gpu::check_each_instance<Tag>([]<std::size_t I>() { check_instance<Tag, I>(); });
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("expert_ffn sm80 instances match the CPU in every weight format") { check_arch<arch::Sm80>(); }
  TEST_CASE("expert_ffn sm90a instances match the CPU in every weight format") { check_arch<arch::Sm90a>(); }
}
