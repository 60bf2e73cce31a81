// kernels/attention_decode: several sequences' one-token steps in one call, against the fp64
// references of the ops it fuses and, bit for bit, against kv_append + attention per sequence,
// on every ISA this CPU has; sequences of different lengths in one pool (first position, block
// ends, several softmax steps), GQA groups of 1, 8 and 12, the output gate, rows out of order;
// and its argument checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/attention_decode/cpu.hpp"
#include "qflash/kernels/attention_decode/ref.hpp"
#include "qflash/kernels/kv_append/cpu.hpp"
#include "qflash/kv/block_pool.hpp"
#include "qflash/spec/presets.hpp"
#include "support/attention_decode_case.hpp"
#include "support/cpu_isas.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using test::all_close;
using test::Tolerance;
using test::DecodeCase;
using test::DecodeStep;
using test::kDecodeBlockTokens;

namespace {

// fp32 sums over the same decoded values as the fp64 reference: accumulated rounding only.
constexpr Tolerance kDot{2e-5, 1e-5};


std::vector<std::vector<kv::KvFormats>> layouts_for(int n_kv) {
  std::vector<std::vector<kv::KvFormats>> out;
  std::vector<kv::KvFormats> mixed;  // each head its own K and V formats
  for (int h = 0; h < n_kv; ++h)
    mixed.push_back({kKvFormats[static_cast<std::size_t>(h + 1) % 5].first, kKvFormats[static_cast<std::size_t>(4 - h) % 5].first});
  out.push_back(mixed);
  for (KvFormat f : {KvFormat::kF32, KvFormat::kInt6}) out.emplace_back(static_cast<std::size_t>(n_kv), kv::KvFormats{f, f});
  return out;
}

constexpr MoeSpec kInt6Only = [] {
  MoeSpec s = spec::generic;
  s.kv = KvScheme::kInt6;
  return s;
}();

}  // namespace

TEST_CASE("attention_decode: equals the fp64 references and, bit for bit, kv_append + attention per sequence") {
  std::vector<DecodeCase> cases{
      // Qwen3.6's groups of 8 with the gate: a first token, a block's last slot, a block's first,
      // a context over several softmax steps.
      {16, 2, 64, true, {0, 15, 16, 300}, {3, 0, 5, 1}, 6},
      {12, 1, 16, false, {5, 33}, {1, 0}, 2},  // a group of 12: two passes of 8
      {4, 4, 24, true, {3, 17, 1}, {0, 1, 2}, 3},  // groups of 1
      {2, 1, 20, false, {20}, {0}, 1},             // d % 8 != 0: the scalar path on every ISA
  };
  DecodeCase many{4, 2, 32, true, {}, {}, 70};  // more sequences than a CUDA launch takes
  for (int i = 0; i < 70; ++i) {
    many.n_past.push_back(3 * i);
    many.rows.push_back(69 - i);
  }
  cases.push_back(many);
  for (DecodeCase const& c : cases) {
    CAPTURE(c.n_head);
    CAPTURE(c.d);
    CAPTURE(c.n_past.size());
    for (auto const& heads : layouts_for(c.n_kv)) {
      CAPTURE(to_string(heads[0].k));
      CAPTURE(to_string(heads[0].v));
      DecodeStep ref_step(c, heads);
      std::vector<float> ref_out;
      ref::attention_decode(ref_step.args(c, ref_out));
      REQUIRE(c.written_outside(ref_out) == 0);
      std::vector<float> const want = c.decoding_rows(ref_out);
      for (auto isa : test::isas_here()) {
        CAPTURE(to_string(isa));
        DecodeStep fused(c, heads), separate(c, heads);
        std::vector<float> fused_out, separate_out;
        AttentionDecodeArgs const a = fused.args(c, fused_out);
        REQUIRE(cpu::attention_decode<kDynamic>(isa, a) == Status::kSuccess);
        AttentionDecodeArgs const b = separate.args(c, separate_out);
        for (int i = 0; i < b.n_seqs; ++i) {
          REQUIRE(launch_kv_append<spec::generic>(arch::Cpu{}, b.append_args(i)) == Status::kSuccess);
          REQUIRE(cpu::attention<kDynamic>(isa, b.attention_args(i)) == Status::kSuccess);
        }
        REQUIRE(c.written_outside(fused_out) == 0);
        REQUIRE(c.written_outside(separate_out) == 0);
        std::vector<float> const got = c.decoding_rows(fused_out);
        CHECK(std::memcmp(got.data(), c.decoding_rows(separate_out).data(), got.size() * sizeof(float)) == 0);
        CHECK(fused.arena() == separate.arena());
        CHECK(fused.arena() == ref_step.arena());
        auto r = all_close<float, float>(got, want, kDot);
        CHECK_MESSAGE(r.ok, r.report);
      }
    }
  }
}

TEST_CASE("attention_decode: the launcher, and what it refuses") {
  DecodeCase const c{4, 2, 32, true, {7, 40}, {1, 0}, 2};
  std::vector<kv::KvFormats> const heads(2, kv::KvFormats{KvFormat::kBf16, KvFormat::kBf16});
  DecodeStep step(c, heads);
  std::vector<float> out;
  REQUIRE(launch_attention_decode<spec::generic>(arch::Cpu{}, step.args(c, out)) == Status::kSuccess);
  CHECK(std::none_of(out.begin(), out.end(), [](float x) { return std::isnan(x); }));

  AttentionDecodeArgs none{};
  CHECK(launch_attention_decode<spec::generic>(arch::Cpu{}, none) == Status::kSuccess);  // no sequences

  auto refused = [&](auto&& change) {
    DecodeStep s(c, heads);
    std::vector<float> o;
    AttentionDecodeArgs a = s.args(c, o);
    std::vector<std::int64_t> n_ctx = s.n_ctx, rows = c.rows;
    a.n_ctx = n_ctx.data();
    a.rows = rows.data();
    change(a, n_ctx, rows);
    return launch_attention_decode<spec::generic>(arch::Cpu{}, a);
  };
  using Args = AttentionDecodeArgs&;
  using Vec = std::vector<std::int64_t>&;
  CHECK(refused([](Args a, Vec, Vec) { a.rows = nullptr; }) == Status::kErrorInvalidProblem);
  CHECK(refused([](Args a, Vec, Vec) { a.block_tables = nullptr; }) == Status::kErrorInvalidProblem);
  CHECK(refused([](Args, Vec n, Vec) { n[1] = 0; }) == Status::kErrorInvalidProblem);  // no new token
  CHECK(refused([&](Args, Vec n, Vec) { n[0] = step.n_blocks[0] * kDecodeBlockTokens + 1; }) ==
        Status::kErrorInvalidProblem);  // past its block table
  CHECK(refused([](Args, Vec, Vec r) { r[0] = -1; }) == Status::kErrorInvalidProblem);
  CHECK(refused([](Args a, Vec, Vec) { a.n_head = 3; }) == Status::kErrorInvalidProblem);  // not a multiple of n_kv
  CHECK(refused([](Args a, Vec, Vec) { a.n_seqs = -1; }) == Status::kErrorInvalidProblem);

  // A spec compiled for int6 KV refuses bf16 heads.
  DecodeStep s(c, heads);
  std::vector<float> o;
  CHECK(launch_attention_decode<kInt6Only>(arch::Cpu{}, s.args(c, o)) == Status::kErrorNotSupported);
}
