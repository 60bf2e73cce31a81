// kv_append and attention over paged, compressed KV on CUDA: every compiled instance (spec x
// arch) this device runs, against the CPU twins.
// - kv_append writes the bytes the CPU writes (the same encoding functions, IEEE division,
//   order-free maxima), in several appends, every format and a per-head mix.
// - attention equals the CPU kernel and ref::attention (dequantize, then attend) within
//   kDot: fp32 sums in another order over values decoded with fused multiply-adds; decode
//   with contexts long enough to split the keys over CTAs, prefill, odd head widths, GQA
//   groups of 1 to 12, the output gate, blocks handed out in shuffled order and blocks of 1 to
//   64 tokens. Prefill of 64 rows or more takes the tensor-core path (attention/mma.cuh):
//   each head bucket (64, 128, 256), padded widths, partial row tiles, split keys.
// - attention_decode (many sequences' append + attention in one call) equals its CPU twin and
//   ref::attention_decode within kDot and writes the CPU's bytes: sequences of different
//   lengths in one arena, rows out of order, split keys, more sequences than one launch takes.
#include "gpu/gpu_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/attention/ref.hpp"
#include "qflash/kernels/attention_decode/cpu.hpp"
#include "qflash/kernels/attention_decode/ref.hpp"
#include "qflash/kernels/kv_append/cpu.hpp"
#include "qflash/kernels/kv_append/ref.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "support/attention_decode_case.hpp"
#include "support/attention_problem.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using test::all_close;
using test::Tolerance;
using test::gpu::DeviceArray;

namespace {

constexpr Tolerance kDot{2e-5, 1e-5};

/// A host paged cache mirrored on the device: its arena and block table copied over, the
/// head layouts left on the host (the CUDA launchers' convention).
class DeviceCache {
 public:
  explicit DeviceCache(kv::LayerCache& host) : host_(host.view()), table_(host.block_table()),
                                               arena_(static_cast<std::size_t>(arena_bytes(host_))) {
    arena_.upload(host_.base);
  }
  kv::KvView view() {
    kv::KvView v = host_;
    v.base = arena_.get();
    v.block_table = table_.get();
    return v;
  }
  static std::int64_t arena_bytes(kv::KvView const& v) {
    std::int32_t const last = v.n_blocks ? *std::max_element(v.block_table, v.block_table + v.n_blocks) : 0;
    return (last + 1) * v.block_bytes;
  }

 private:
  kv::KvView host_;
  DeviceArray<std::int32_t> table_;
  DeviceArray<std::uint8_t> arena_;
};

using Problem = test::AttentionProblem;

struct Inputs {
  std::vector<float> q, k, v, gate;
  explicit Inputs(Problem const& p, std::uint64_t seed)
      : q(test::random_floats(static_cast<std::size_t>(p.n_tokens * p.n_head * p.d), seed, -2, 2)),
        k(test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), seed + 1, -2, 2)),
        v(test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), seed + 2)),
        gate(p.gate ? test::random_floats(static_cast<std::size_t>(p.n_tokens * p.n_head * 2 * p.d), seed + 3, -3, 3)
                    : std::vector<float>{}) {}
};

/// Head layouts to try under spec S: each format S.kv allows, and a per-head mix when it
/// allows several.
template <MoeSpec S>
std::vector<std::vector<kv::KvFormats>> layouts_for(int n_kv) {
  std::vector<std::vector<kv::KvFormats>> out;
  for (auto const& [f, name] : kKvFormats)
    if (kv::allows(S.kv, f)) out.emplace_back(static_cast<std::size_t>(n_kv), kv::KvFormats{f, f});
  if (S.kv == KvScheme::kAny || S.kv == KvScheme::kMixed) {
    std::vector<kv::KvFormats> mixed;
    for (int h = 0; h < n_kv; ++h)
      mixed.push_back({kKvFormats[static_cast<std::size_t>(h + 1) % 5].first, kKvFormats[static_cast<std::size_t>(4 - h) % 5].first});
    out.push_back(mixed);
  }
  return out;
}

template <MoeSpec S, class Tag>
void check_attention(Problem const& p, std::vector<kv::KvFormats> const& heads, bool shuffled_blocks,
                     int block_tokens = kv::kBlockTokens) {
  CAPTURE(p.d);
  CAPTURE(p.n_ctx);
  CAPTURE(p.n_tokens);
  CAPTURE(p.n_head);
  CAPTURE(p.n_kv);
  CAPTURE(p.gate);
  CAPTURE(to_string(heads[0].k));
  CAPTURE(to_string(heads[0].v));
  CAPTURE(shuffled_blocks);
  CAPTURE(block_tokens);
  Inputs const in(p, static_cast<std::uint64_t>(p.d * 7 + p.n_ctx));
  kv::LayerCache cache(heads, p.d, p.n_ctx, block_tokens);
  if (shuffled_blocks) {  // a pool whose free list was shuffled hands its blocks out in that order
    std::vector<std::int32_t> all;
    cache.pool().allocate(cache.pool().capacity(), all);
    std::shuffle(all.begin(), all.end(), std::mt19937(11));
    cache.pool().release(all);
  }
  cache.append(in.k.data(), in.v.data(), p.n_ctx);
  float const* gate = p.gate ? in.gate.data() : nullptr;

  std::vector<float> want(in.q.size()), cpu(in.q.size());
  ref::attention(test::attention_args(p, cache.view(), in.q.data(), want.data(), gate));
  REQUIRE(launch_attention<S>(arch::Cpu{}, test::attention_args(p, cache.view(), in.q.data(), cpu.data(), gate)) ==
          Status::kSuccess);

  DeviceCache dev(cache);
  DeviceArray<float> q(in.q), out(in.q.size()), g(in.gate);
  cudaStream_t stream = nullptr;
  QFLASH_TEST_CUDA(cudaStreamCreate(&stream));
  Status const st = launch_attention<S>(
      Tag{}, test::attention_args(p, dev.view(), q.get(), out.get(), p.gate ? g.get() : nullptr), stream);
  cudaError_t const sync = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  REQUIRE(st == Status::kSuccess);
  REQUIRE_MESSAGE(sync == cudaSuccess, "kernel failed: ", cudaGetErrorString(sync));
  std::vector<float> const got = out.download();
  auto const vs_cpu = all_close<float, float>(got, cpu, kDot);
  CHECK_MESSAGE(vs_cpu.ok, "GPU vs CPU twin: ", vs_cpu.report);
  auto const vs_ref = all_close<float, float>(got, want, kDot);
  CHECK_MESSAGE(vs_ref.ok, "GPU vs ref: ", vs_ref.report);
}

/// Appends n positions in the given runs on the GPU and on the CPU; the stored bytes match.
template <MoeSpec S, class Tag>
void check_append(int n_kv, int d, std::vector<std::int64_t> const& runs, std::vector<kv::KvFormats> const& heads) {
  CAPTURE(d);
  CAPTURE(to_string(heads[0].k));
  CAPTURE(to_string(heads[0].v));
  std::int64_t n = 0;
  for (auto r : runs) n += r;
  auto const k = test::random_floats(static_cast<std::size_t>(n * n_kv * d), 21, -3, 3);
  auto const v = test::random_floats(static_cast<std::size_t>(n * n_kv * d), 22, -3, 3);
  kv::LayerCache cpu(heads, d, n);
  std::vector<std::int32_t> table;
  cpu.pool().allocate(cpu.pool().blocks_for(n), table);
  kv::KvView const cv = cpu.pool().view(0, table);
  std::memset(cv.base, 0, static_cast<std::size_t>(DeviceCache::arena_bytes(cv)));

  DeviceArray<std::uint8_t> arena(static_cast<std::size_t>(DeviceCache::arena_bytes(cv)));
  DeviceArray<std::int32_t> dtable(table);
  DeviceArray<float> dk(k), dv(v);
  kv::KvView gv = cv;
  gv.base = arena.get();
  gv.block_table = dtable.get();
  std::int64_t start = 0;
  for (std::int64_t len : runs) {
    std::int64_t const off = start * n_kv * d;
    REQUIRE(launch_kv_append<S>(arch::Cpu{}, KvAppendArgs{cv, k.data() + off, v.data() + off, len, start}) ==
            Status::kSuccess);
    REQUIRE(launch_kv_append<S>(Tag{}, KvAppendArgs{gv, dk.get() + off, dv.get() + off, len, start}, nullptr) ==
            Status::kSuccess);
    start += len;
  }
  QFLASH_TEST_CUDA(cudaDeviceSynchronize());
  std::vector<std::uint8_t> const got = arena.download();
  int mismatched = 0;
  for (std::int64_t s = 0; s < n; ++s)
    for (int h = 0; h < n_kv; ++h) {
      auto at = [&](std::uint8_t const* p) { return got.data() + (p - cv.base); };
      mismatched += std::memcmp(cv.key(s, h), at(cv.key(s, h)), static_cast<std::size_t>(cv.heads[h].k_bytes)) != 0;
      mismatched += std::memcmp(cv.value(s, h), at(cv.value(s, h)), static_cast<std::size_t>(cv.heads[h].v_bytes)) != 0;
    }
  CHECK_MESSAGE(mismatched == 0, mismatched, " stored vectors differ from the CPU's bytes");
  // Past the block table's end: refused before any launch.
  CHECK(launch_kv_append<S>(Tag{}, KvAppendArgs{gv, dk.get(), dv.get(), 2, gv.capacity() - 1}, nullptr) ==
        Status::kErrorInvalidProblem);
}

/// One attention_decode step on the device against the CPU twin and the reference, from the
/// same pool contents: the written rows within kDot, the arena after the appends byte for byte.
template <MoeSpec S, class Tag>
void check_attention_decode(test::DecodeCase const& c, std::vector<kv::KvFormats> const& heads) {
  CAPTURE(c.n_head);
  CAPTURE(c.n_kv);
  CAPTURE(c.d);
  CAPTURE(c.n_past.size());
  CAPTURE(to_string(heads[0].k));
  CAPTURE(to_string(heads[0].v));
  test::DecodeStep ref_step(c, heads), cpu_step(c, heads), gpu_step(c, heads);
  std::vector<float> want, cpu;
  ref::attention_decode(ref_step.args(c, want));
  REQUIRE(launch_attention_decode<S>(arch::Cpu{}, cpu_step.args(c, cpu)) == Status::kSuccess);

  std::vector<float> host_out;
  AttentionDecodeArgs a = gpu_step.args(c, host_out);
  std::vector<std::uint8_t> const arena = gpu_step.arena();
  DeviceArray<std::uint8_t> darena(arena);
  std::vector<std::int32_t> all_tables;  // every sequence's table, one after another on the device
  for (auto const& t : gpu_step.tables) all_tables.insert(all_tables.end(), t.begin(), t.end());
  DeviceArray<std::int32_t> dtables(all_tables);
  std::vector<std::int32_t const*> tables;
  std::size_t offset = 0;
  for (auto const& t : gpu_step.tables) {
    tables.push_back(dtables.get() + offset);
    offset += t.size();
  }
  DeviceArray<float> q(gpu_step.q), k(gpu_step.k), v(gpu_step.v), gate(gpu_step.gate), out(host_out);
  a.q = q.get();
  a.k = k.get();
  a.v = v.get();
  a.out = out.get();
  if (a.gate) a.gate = gate.get() + c.d;
  a.kv.base = darena.get();
  a.block_tables = tables.data();
  REQUIRE(launch_attention_decode<S>(Tag{}, a, nullptr) == Status::kSuccess);
  QFLASH_TEST_CUDA(cudaDeviceSynchronize());
  std::vector<float> const got = out.download();
  CHECK_MESSAGE(c.written_outside(got) == 0, c.written_outside(got), " values outside the decoding rows were written");
  std::vector<float> const got_rows = c.decoding_rows(got), cpu_rows = c.decoding_rows(cpu),
                           want_rows = c.decoding_rows(want);
  auto const vs_cpu = all_close<float, float>(got_rows, cpu_rows, kDot);
  CHECK_MESSAGE(vs_cpu.ok, "GPU vs CPU twin: ", vs_cpu.report);
  auto const vs_ref = all_close<float, float>(got_rows, want_rows, kDot);
  CHECK_MESSAGE(vs_ref.ok, "GPU vs ref: ", vs_ref.report);
  CHECK_MESSAGE(darena.download() == cpu_step.arena(), "the appended vectors differ from the CPU's bytes");
}

template <class Tag, std::size_t I>
void check_instance() {
  constexpr MoeSpec S = instances::kSpecs[I];
  CAPTURE(instances::kSpecNames[I]);
  CAPTURE(Tag::name);
  std::vector<Problem> problems;
  if constexpr (S.d_head != kDynamic && S.n_head != kDynamic && S.n_head_kv != kDynamic) {
    // The spec's own heads: decode (split over the keys at 1500), prefill (the tensor-core
    // path at 70 tokens; 24 after 600 cached, split over the keys, there too when a group of
    // query heads is 3 or more), and the gate.
    problems = {{S.n_head, S.n_head_kv, S.d_head, 1500, 1, true},
                {S.n_head, S.n_head_kv, S.d_head, 70, 70, false},
                {S.n_head, S.n_head_kv, S.d_head, 624, 24, true},
                {S.n_head, S.n_head_kv, S.d_head, 40, 3, true}};
  } else {
    // Decode and prefill, GQA groups of 1, 2, 4 and 12, odd widths (short last chunks),
    // contexts that end inside a block, split decode, the widest head; and the tensor-core
    // path: heads of 256 (split keys), 128, padded 40 and 20, a group of 1, partial tiles,
    // the gate without a key split, widths 75, 130 and 198 (odd, 2 and 6 past a multiple of
    // 8), 8 KV heads, a group of 64 decoding one token.
    problems = {{4, 2, 64, 37, 1},     {4, 2, 32, 300, 300}, {12, 1, 16, 20, 5, true}, {3, 3, 24, 17, 17},
                {2, 1, 20, 33, 3},     {4, 2, 256, 530, 2},  {16, 2, 256, 2000, 1, true}, {8, 2, 128, 700, 9},
                {4, 1, 512, 600, 1},   {2, 2, 40, 1030, 1},  {16, 2, 256, 300, 40, true}, {32, 4, 128, 200, 100},
                {8, 1, 40, 1030, 8, true}, {2, 2, 20, 70, 70}, {4, 1, 512, 80, 80}, {16, 2, 256, 70, 70, true},
                {4, 2, 75, 90, 40},    {6, 2, 130, 150, 30, true}, {4, 1, 198, 120, 16}, {32, 8, 64, 100, 40},
                {64, 1, 64, 500, 1}};
  }
  for (Problem const& p : problems)
    for (auto const& heads : layouts_for<S>(p.n_kv)) check_attention<S, Tag>(p, heads, false);
  // Blocks handed out in shuffled order, and blocks of 1, 7 and 64 tokens: decode (the first
  // problem) and prefill on the tensor cores (the second).
  for (Problem const& p : {problems[0], problems[1]}) {
    std::vector<kv::KvFormats> const mixed = layouts_for<S>(p.n_kv).back();  // a copy: the list is a temporary
    check_attention<S, Tag>(p, mixed, true);
    for (int block_tokens : {1, 7, 64}) check_attention<S, Tag>(p, mixed, false, block_tokens);
  }

  int const n_kv = S.n_head_kv != kDynamic ? S.n_head_kv : 2;
  for (int d : S.d_head != kDynamic ? std::vector<int>{S.d_head} : std::vector<int>{40, 64, 130, 256})
    for (auto const& heads : layouts_for<S>(n_kv)) check_append<S, Tag>(n_kv, d, {1, 16, 28, 3}, heads);

  // attention_decode: a first token, block ends, a context long enough to split the keys.
  int const nh = S.n_head != kDynamic ? S.n_head : 16, dh = S.d_head != kDynamic ? S.d_head : 64;
  std::vector<test::DecodeCase> decodes{{nh, n_kv, dh, true, {0, 15, 16, 1500}, {3, 0, 5, 1}, 6}};
  if constexpr (S.n_head == kDynamic && S.d_head == kDynamic && S.n_head_kv == kDynamic) {
    decodes.push_back({12, 1, 16, false, {5, 33}, {1, 0}, 2});  // a group of 12: the append apart
    decodes.push_back({32, 2, 64, true, {0, 15, 1500}, {2, 0, 1}, 3});  // a group of 16, split keys
    decodes.push_back({4, 2, 300, true, {0, 200}, {1, 0}, 2});  // 10 dims a lane
    decodes.push_back({2, 2, 40, true, {3, 700, 1}, {0, 1, 2}, 3});  // groups of 1, an odd width
    test::DecodeCase many{4, 2, 128, true, {}, {}, 70};  // two launches of sequences
    for (int i = 0; i < 70; ++i) {
      many.n_past.push_back(7 * i);
      many.rows.push_back(69 - i);
    }
    decodes.push_back(many);
  }
  for (auto const& c : decodes)
    for (auto const& heads : layouts_for<S>(c.n_kv)) check_attention_decode<S, Tag>(c, heads);
}

template <class Tag>
void check_arch() {
  test::gpu::check_each_instance<Tag>([]<std::size_t I>() { check_instance<Tag, I>(); });
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("kv_append and paged attention sm80 instances match the CPU") { check_arch<arch::Sm80>(); }
  TEST_CASE("kv_append and paged attention sm90a instances match the CPU") { check_arch<arch::Sm90a>(); }
}
