/// @file
/// Random models with a preset's exact shapes, built in memory in any weight scheme, so the
/// real per-layer shapes can be benchmarked (`qflash bench --synthetic`) without a download.
/// Every matrix is generated directly in the format the scheme gives its role (valid GGUF /
/// int4 / fp8 blocks with random codes and small positive scales, not floats quantized at
/// load), in parallel, so billions of parameters take seconds. The values mean nothing, but
/// every one is finite and the forward pass stays in range: use the model for memory and
/// speed, never quality. Host only.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/io/progress.hpp"
#include "qflash/model/config.hpp"
#include "qflash/model/weights.hpp"
#include "qflash/numeric/weight_format.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/weight_plan.hpp"
#include "qflash/spec/presets.hpp"

namespace qflash::runtime {

/// A model whose shapes `--synthetic` can build; n_layer and vocab are the real model's.
struct SyntheticPreset {
  std::string_view name;
  int n_layer;
  int vocab;
};

inline constexpr std::array<SyntheticPreset, 2> kSyntheticPresets{{
    {"qwen3_6_35b_a3b", 40, 248320},
    {"qwen3_30b_a3b", 48, 151936},
}};

/// Layers of a synthetic model when none are asked for: one period of Qwen3.6's pattern
/// (3 Gated DeltaNet, 1 full attention), what issue 9's measurements used.
inline constexpr int kSyntheticDefaultLayers = 4;

/// "qwen3_6_35b_a3b, qwen3_30b_a3b", for messages.
inline std::string synthetic_preset_names() {
  std::string out;
  for (auto const& p : kSyntheticPresets) out += (out.empty() ? "" : ", ") + std::string(p.name);
  return out;
}

/// The preset named `name`; throws Error listing the known ones otherwise.
inline SyntheticPreset const& synthetic_preset(std::string_view name) {
  for (auto const& p : kSyntheticPresets)
    if (p.name == name) return p;
  QFLASH_FAIL("unknown synthetic preset '", name, "' (known: ", synthetic_preset_names(), ")");
}

/// The config of a model with spec `s`'s shapes (every shape field static), `n_layer` layers
/// and `vocab` tokens, laid out as its family's real models are: qwen3_5_moe's layer i is full
/// attention when i % 4 == 3 (a model with none gets its last layer as one, so every layer
/// kind runs), with the output gate, (1 + w) norms, partial RoPE (a quarter of each head) at
/// base 1e7; qwen3_moe's layers are all full attention, plain norms, full RoPE at base 1e6.
/// What a research build instantiates its own spec with (runtime/research.hpp).
/// @throws Error for a spec with a dynamic or invalid shape, or n_layer / vocab below 1
inline model::ModelConfig spec_config(MoeSpec const& s, int n_layer, int vocab) {
  QFLASH_CHECK(s.family == ModelFamily::kQwen35Moe || s.family == ModelFamily::kQwen3Moe,
               "spec_config: the spec's family must be kQwen35Moe or kQwen3Moe");
  QFLASH_CHECK(n_layer >= 1 && vocab >= 1, "spec_config: needs at least 1 layer and 1 token, got ", n_layer,
               " layers and ", vocab, " tokens");
  for (int v : {s.d_model, s.n_head, s.n_head_kv, s.d_head, s.n_expert, s.n_expert_used, s.d_ff_expert,
                s.d_ff_shared, s.n_head_k_linear, s.n_head_v_linear, s.d_head_k_linear, s.d_head_v_linear, s.d_conv})
    QFLASH_CHECK(v != kDynamic, "spec_config: ", to_string(s), " has a dynamic shape field; every one must be set");
  model::ModelConfig c;
  c.source = to_string(s);
  c.n_layer = n_layer;
  c.vocab = vocab;
  c.d_model = s.d_model;
  c.n_head = s.n_head;
  c.n_head_kv = s.n_head_kv;
  c.d_head = s.d_head;
  c.n_expert = s.n_expert;
  c.n_expert_used = s.n_expert_used;
  c.d_ff_expert = s.d_ff_expert;
  c.d_ff_shared = s.d_ff_shared;
  c.n_head_k_linear = s.n_head_k_linear;
  c.n_head_v_linear = s.n_head_v_linear;
  c.d_head_k_linear = s.d_head_k_linear;
  c.d_head_v_linear = s.d_head_v_linear;
  c.d_conv = s.d_conv;
  c.rms_norm_eps = 1e-6f;
  c.norm_topk_prob = true;
  c.tie_word_embeddings = false;
  c.dtype = DType::kBF16;
  c.decoder_sparse_step = 1;
  c.family = s.family;
  if (s.family == ModelFamily::kQwen35Moe) {
    c.model_type = "qwen3_5_moe";
    for (int i = 0; i < n_layer; ++i)
      c.layer_types.push_back(i % 4 == 3 ? model::LayerKind::kFullAttention : model::LayerKind::kLinearAttention);
    if (c.n_layer_of(model::LayerKind::kFullAttention) == 0) c.layer_types.back() = model::LayerKind::kFullAttention;
    c.rope_theta = 1e7f;
    c.partial_rotary_factor = 0.25f;
    c.attn_output_gate = true;
    c.zero_centered_norms = true;
    c.max_position_embeddings = 262144;
  } else {
    c.model_type = "qwen3_moe";
    c.layer_types.assign(static_cast<std::size_t>(n_layer), model::LayerKind::kFullAttention);
    c.rope_theta = 1e6f;
    c.partial_rotary_factor = 1.0f;
    c.max_position_embeddings = 40960;
  }
  c.rotary_dim = static_cast<int>(static_cast<float>(c.d_head) * c.partial_rotary_factor);
  (void)c.spec(KvScheme::kBf16, WeightFormat::kAny);  // checks the shapes
  return c;
}

/// The config of preset `preset` (MODELS.md §1 and §4, spec/presets.hpp) cut to `n_layer`
/// layers and `vocab` tokens (0: 4 layers, the real vocabulary), laid out as spec_config says.
/// End-of-sequence and other special ids outside a smaller vocabulary are dropped.
/// @throws Error for an unknown preset, or n_layer / vocab outside [1, the real model's]
inline model::ModelConfig synthetic_config(std::string_view preset, int n_layer = 0, int vocab = 0) {
  SyntheticPreset const& p = synthetic_preset(preset);
  if (n_layer == 0) n_layer = kSyntheticDefaultLayers;
  if (vocab == 0) vocab = p.vocab;
  QFLASH_CHECK(n_layer >= 1 && n_layer <= p.n_layer, "synthetic ", p.name, ": ", n_layer,
               " layers is outside [1, ", p.n_layer, "] (the real model has ", p.n_layer, ")");
  QFLASH_CHECK(vocab >= 1 && vocab <= p.vocab, "synthetic ", p.name, ": vocabulary ", vocab,
               " is outside [1, ", p.vocab, "] (the real model's is ", p.vocab, ")");
  bool const qwen36 = p.name == "qwen3_6_35b_a3b";
  model::ModelConfig c = spec_config(qwen36 ? spec::qwen3_6_35b_a3b : spec::qwen3_30b_a3b, n_layer, vocab);
  c.source = "synthetic " + std::string(p.name);
  // config.json's, then generation_config's end-of-sequence ids; bos (qwen3_5_moe: also pad)
  std::vector<int> const eos = qwen36 ? std::vector<int>{248044, 248046} : std::vector<int>{151645};
  int const bos = qwen36 ? 248044 : 151643;
  if (!qwen36) c.d_ff_dense = 6144;  // config.json's intermediate_size; no layer is dense
  for (int id : eos)
    if (id < vocab) c.eos_token_ids.push_back(id);
  if (bos < vocab) c.bos_token_id = bos;
  if (qwen36 && bos < vocab) c.pad_token_id = bos;
  return c;
}

namespace detail {

/// splitmix64's output function: a bijective 64-bit mix.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// splitmix64: one independent stream per (seed, tensor, row), so the values do not depend
/// on how rows are split across threads.
class RowRng {
 public:
  RowRng(std::uint64_t seed, std::uint64_t tensor, std::uint64_t row)
      : state_(mix64(seed + mix64(tensor + mix64(row + 0x9E3779B97F4A7C15ull)))) {}
  std::uint64_t next() { return mix64(state_ += 0x9E3779B97F4A7C15ull); }
  /// Uniform in [0, 1).
  float unit() { return static_cast<float>(next() >> 40) * 0x1p-24f; }
  void bytes(std::uint8_t* out, std::size_t n) {
    for (std::size_t i = 0; i < n; i += 8) {
      std::uint64_t const r = next();
      std::memcpy(out + i, &r, std::min<std::size_t>(8, n - i));
    }
  }

 private:
  std::uint64_t state_;
};

/// Half-width of the uniform weight distribution: standard deviation 0.02 (transformers'
/// initializer_range), as in tools/make_random_checkpoint.py.
inline constexpr float kWeightHalfWidth = 0.02f * 1.7320508f;

/// A random scale factor in [0.5, 1): rows differ, as blocks do in a quantized checkpoint.
inline float jitter(RowRng& rng) { return 0.5f + 0.5f * rng.unit(); }

/// Values uniform in (-half_width, half_width) from 16 random bits each, in the element format
/// `f` (f32, bf16, f16), 64 at a time: plain loops over arrays, so the compiler vectorises
/// the conversions (the bf16 rounding is to_bf16's for finite values).
inline void fill_uniform_elements(WeightFormat f, std::size_t n, float half_width, std::byte* out, RowRng& rng) {
  constexpr std::size_t kChunk = 64;
  std::size_t const elem = f == WeightFormat::kF32 ? 4 : 2;
  float const scale = half_width / 32768.0f;
  for (std::size_t i = 0; i < n; i += kChunk) {
    std::uint64_t words[kChunk / 4];
    for (auto& w : words) w = rng.next();
    std::int16_t bits[kChunk];
    std::memcpy(bits, words, sizeof bits);
    float v[kChunk];
    for (std::size_t j = 0; j < kChunk; ++j) v[j] = (static_cast<float>(bits[j]) + 0.5f) * scale;
    std::size_t const m = std::min(kChunk, n - i);
    if (f == WeightFormat::kF32) {
      std::memcpy(out + 4 * i, v, m * 4);
      continue;
    }
    std::uint16_t h[kChunk];
    if (f == WeightFormat::kBf16) {
      for (std::size_t j = 0; j < kChunk; ++j) {
        std::uint32_t const u = std::bit_cast<std::uint32_t>(v[j]);
        h[j] = static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
      }
    } else {
      for (std::size_t j = 0; j < m; ++j) h[j] = to_fp16(v[j]).bits;
    }
    std::memcpy(out + elem * i, h, m * elem);
  }
}

/// Writes one random row of `cols` values in format f (fp8: the codes; scales are the grid's).
/// Dequantized, every value lies within ±kWeightHalfWidth (to fp16 rounding of the scales).
/// Block scales are drawn once per row: the code paths are the same whatever their values.
inline void fill_random_row(WeightFormat f, std::int64_t cols, std::byte* out, RowRng& rng) {
  constexpr float A = kWeightHalfWidth;
  auto const n = static_cast<std::size_t>(cols);
  auto* bytes = reinterpret_cast<std::uint8_t*>(out);
  float const j = jitter(rng);
  switch (f) {
    case WeightFormat::kF32:
    case WeightFormat::kBf16:
    case WeightFormat::kF16: fill_uniform_elements(f, n, A, out, rng); return;
    case WeightFormat::kFp8E4m3:
      // e4m3 codes with exponent field 4..8: magnitudes 0.125..3.75, never the NaN code 0x7F.
      rng.bytes(bytes, n);
      for (std::size_t i = 0; i < n; ++i) {
        unsigned const b = bytes[i];
        bytes[i] = static_cast<std::uint8_t>((b & 0x87u) | (4 + ((b >> 3 & 0xFu) * 5 >> 4)) << 3);
      }
      return;
    case WeightFormat::kQ8_0: {
      Fp16 const d = to_fp16(A / 127.0f * j);
      auto* blocks = reinterpret_cast<gguf::BlockQ8_0*>(out);
      for (std::size_t b = 0; b < n / gguf::kQ8_0BlockSize; ++b) {
        std::uint8_t codes[gguf::kQ8_0BlockSize];
        rng.bytes(codes, sizeof codes);
        blocks[b].d = d;
        for (int i = 0; i < gguf::kQ8_0BlockSize; ++i)  // -127..127, as ggml's quantizer gives
          blocks[b].qs[i] = static_cast<std::int8_t>((codes[i] * 255 >> 8) - 127);
      }
      return;
    }
    case WeightFormat::kQ4K: {
      // x = d * sc * q - dmin * m with q = 0..15, sc = m = 32..63 per sub-block and
      // dmin = 7.5 d: x = d * sc * (q - 7.5), within [-A, A].
      float const d = A / (7.5f * 63.0f) * j;
      Fp16 const d16 = to_fp16(d), dmin16 = to_fp16(7.5f * d);
      auto* blocks = reinterpret_cast<gguf::BlockQ4K*>(out);
      for (std::size_t b = 0; b < n / gguf::kQ4KBlockSize; ++b) {
        blocks[b].d = d16;
        blocks[b].dmin = dmin16;
        std::uint8_t sc[gguf::kQ4KSubBlocks];
        rng.bytes(sc, sizeof sc);
        for (auto& x : sc) x = static_cast<std::uint8_t>(32 + (x & 31));
        gguf::q4_k_pack_scale_min(sc, sc, blocks[b].scales);
        rng.bytes(blocks[b].qs, sizeof blocks[b].qs);
      }
      return;
    }
    case WeightFormat::kQ6K: {
      // x = d * scale * (q - 32), q = 0..63, scale = 4..7: within [-A, A].
      Fp16 const d = to_fp16(A / (32.0f * 7.0f) * j);
      auto* blocks = reinterpret_cast<gguf::BlockQ6K*>(out);
      for (std::size_t b = 0; b < n / gguf::kQ6KBlockSize; ++b) {
        rng.bytes(blocks[b].ql, sizeof blocks[b].ql);
        rng.bytes(blocks[b].qh, sizeof blocks[b].qh);
        std::uint64_t const r = rng.next();
        for (int s = 0; s < gguf::kQ6KSubBlocks; ++s) blocks[b].scales[s] = static_cast<std::int8_t>(4 + (r >> (2 * s) & 3));
        blocks[b].d = d;
      }
      return;
    }
    case WeightFormat::kInt4: {
      // x = scale * q + min, q = 0..15, min = -A j, scale = 2 A j / 15; a short last group's
      // unused codes stay zero, as the format requires.
      Fp16 const scale = to_fp16(2.0f * A / 15.0f * j), min = to_fp16(-A * j);
      auto* blocks = reinterpret_cast<BlockInt4G128*>(out);
      for (std::size_t g = 0; g * kInt4GroupSize < n; ++g) {
        blocks[g].scale = scale;
        blocks[g].min = min;
        std::size_t const values = std::min<std::size_t>(kInt4GroupSize, n - g * kInt4GroupSize);
        std::memset(blocks[g].qs, 0, sizeof blocks[g].qs);
        rng.bytes(blocks[g].qs, values / 2);
        if (values % 2) blocks[g].qs[values / 2] = static_cast<std::uint8_t>(rng.next() & 0xF);
      }
      return;
    }
    case WeightFormat::kAny: break;
  }
  QFLASH_FAIL("synthetic weights: no random fill for format ", to_string(f));
}

/// Makes the matrices and vectors of a synthetic model in its storage, in the scheme's
/// formats, advancing a progress bar by each group's bytes.
class SyntheticFiller {
 public:
  SyntheticFiller(WeightStorage& storage, WeightScheme scheme, std::uint64_t seed, io::Progress& progress)
      : storage_(storage), scheme_(scheme), seed_(seed), progress_(progress) {}

  /// `count` random [rows, cols] matrices for `role`, in one allocation.
  std::vector<WeightView> matrices(WeightRole role, std::int64_t rows, std::int64_t cols, std::int64_t count) {
    WeightFormat const f = format_for(scheme_, role, cols, WeightFormat::kBf16);
    std::int64_t const rb = row_bytes(f, cols), total_rows = rows * count;
    auto& block = storage_.owned.emplace_back(
        std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(total_rows * rb)));
    std::byte* const base = block.get();
    std::uint64_t const tensor = next_tensor_++;
    // Threads take rows in small batches from a shared counter, so one that shares its core
    // with another process does less of the work instead of holding the others up.
    std::int64_t const batch = std::max<std::int64_t>(1, (std::int64_t{256} << 10) / rb);
    std::atomic<std::int64_t> next_row{0};
    parallel_for(0, max_threads(), total_rows * cols / max_threads(), [&](std::int64_t) {
      for (std::int64_t r0; (r0 = next_row.fetch_add(batch)) < total_rows;)
        for (std::int64_t r = r0; r < std::min(r0 + batch, total_rows); ++r) {
          RowRng rng(seed_, tensor, static_cast<std::uint64_t>(r));
          fill_random_row(f, cols, base + r * rb, rng);
        }
    });
    std::int64_t const grid = fp8_scale_blocks(rows) * fp8_scale_blocks(cols);
    float* scales = nullptr;
    if (f == WeightFormat::kFp8E4m3) {
      // Codes reach 3.75: scales bring each 128x128 tile to about ±kWeightHalfWidth.
      auto& s = storage_.scales.emplace_back(static_cast<std::size_t>(grid * count));
      RowRng rng(seed_, tensor, ~std::uint64_t{0});
      for (float& x : s) x = kWeightHalfWidth / 3.75f * jitter(rng);
      scales = s.data();
    }
    std::vector<WeightView> out;
    for (std::int64_t i = 0; i < count; ++i) {
      WeightView v{f, base + i * rows * rb, rows, cols};
      if (scales) v.scales = scales + i * grid;
      out.push_back(v);
    }
    progress_.advance(static_cast<std::uint64_t>(count * matrix_bytes(f, rows, cols)), static_cast<int>(count));
    return out;
  }
  WeightView matrix(WeightRole role, std::int64_t rows, std::int64_t cols) { return matrices(role, rows, cols, 1)[0]; }

  /// n values uniform in [center - half_width, center + half_width], rounded to bf16 (what a
  /// bf16 checkpoint holds) unless `keep_f32` (Qwen3.6 keeps A_log in f32); kept in the storage.
  model::FloatView vector(std::int64_t n, float center, float half_width, bool keep_f32 = false) {
    return storage_.keep(values(n, center, half_width, keep_f32));
  }
  /// vector()'s values, not kept.
  std::vector<float> values(std::int64_t n, float center, float half_width, bool keep_f32 = false) {
    RowRng rng(seed_, next_tensor_++, 0);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) {
      x = center + half_width * (2.0f * rng.unit() - 1.0f);
      if (!keep_f32) x = round_to_bf16(x);
    }
    return v;
  }

 private:
  WeightStorage& storage_;
  WeightScheme scheme_;
  std::uint64_t seed_;
  io::Progress& progress_;
  std::uint64_t next_tensor_ = 0;
};

}  // namespace detail

/// A random model of config `c` (from synthetic_config, or any qwen3_5_moe / qwen3_moe
/// config) with every weight the forward pass needs, bound as bind_weights would bind a bf16
/// checkpoint of it under `scheme` (kAuto: bf16). Norm weights are centred on their identity
/// ((1 + w) norms on 0, plain ones on 1) with ±0.1 noise; conv weights ±0.5; dt_bias and A_log
/// ±1, as tools/make_random_checkpoint.py chooses. Same seed, same weights, on any thread count.
/// @param progress  draw a progress bar on stderr
inline LoadedModel synthetic_model(model::ModelConfig const& c, WeightScheme scheme, std::uint64_t seed,
                                   bool progress) {
  LoadedModel m;
  m.config = c;
  m.scheme = scheme;
  m.storage = std::make_shared<WeightStorage>();
  WeightPlan const plan = plan_weights(c, scheme, WeightFormat::kBf16);
  std::int64_t total = 0;
  for (auto const& [f, b] : plan.bytes) total += b;
  io::Progress bar("generating " + c.source + " (" + std::string(to_string(scheme)) + ")",
                   static_cast<std::uint64_t>(total), progress);
  detail::SyntheticFiller fill(*m.storage, scheme, seed, bar);

  std::int64_t const d = c.d_model;
  float const norm_center = c.zero_centered_norms ? 0.0f : 1.0f;
  constexpr float kNormNoise = 0.1f;
  model::ModelWeights& w = m.weights;
  w.embed = fill.matrix(WeightRole::kEmbedding, c.vocab, d);
  w.lm_head = c.tie_word_embeddings ? w.embed : fill.matrix(WeightRole::kLmHead, c.vocab, d);
  w.final_norm = fill.vector(d, norm_center, kNormNoise);
  for (int l = 0; l < c.n_layer; ++l) {
    model::LayerWeights& lw = w.layers.emplace_back();
    lw.kind = c.layer_types[static_cast<std::size_t>(l)];
    lw.input_norm = fill.vector(d, norm_center, kNormNoise);
    lw.post_norm = fill.vector(d, norm_center, kNormNoise);
    if (lw.kind == model::LayerKind::kFullAttention) {
      std::int64_t const q = std::int64_t{c.n_head} * c.d_head, kv = std::int64_t{c.n_head_kv} * c.d_head;
      lw.attention.q = fill.matrix(WeightRole::kAttentionQkv, q * (c.attn_output_gate ? 2 : 1), d);
      lw.attention.k = fill.matrix(WeightRole::kAttentionQkv, kv, d);
      lw.attention.v = fill.matrix(WeightRole::kAttentionV, kv, d);
      lw.attention.o = fill.matrix(WeightRole::kAttentionOut, d, q);
      lw.attention.q_norm = fill.vector(c.d_head, norm_center, kNormNoise);
      lw.attention.k_norm = fill.vector(c.d_head, norm_center, kNormNoise);
    } else {
      std::int64_t const value = c.linear_value_dim(), conv = c.linear_conv_dim();
      lw.linear.qkv = fill.matrix(WeightRole::kDeltaNetIn, conv, d);
      lw.linear.z = fill.matrix(WeightRole::kDeltaNetIn, value, d);
      lw.linear.b = fill.matrix(WeightRole::kDeltaNetIn, c.n_head_v_linear, d);
      lw.linear.a = fill.matrix(WeightRole::kDeltaNetIn, c.n_head_v_linear, d);
      lw.linear.out = fill.matrix(WeightRole::kDeltaNetOut, d, value);
      lw.linear.conv = fill.vector(conv * c.d_conv, 0.0f, 0.5f);
      lw.linear.dt_bias = fill.vector(c.n_head_v_linear, 0.0f, 1.0f);
      std::vector<float> neg_a = fill.values(c.n_head_v_linear, 0.0f, 1.0f, /*keep_f32=*/true);  // A_log
      for (float& x : neg_a) x = -std::exp(x);
      lw.linear.neg_a = m.storage->keep(std::move(neg_a));
      lw.linear.norm = fill.vector(c.d_head_v_linear, 1.0f, kNormNoise);  // a plain weight
    }
    // The router with the shared-expert gate as its last row, as bind_weights stacks them.
    bool const shared = c.d_ff_shared > 0;
    lw.moe.router = fill.matrix(WeightRole::kRouter, c.n_expert + (shared ? 1 : 0), d);
    std::int64_t const ff = c.d_ff_expert;
    auto gate = fill.matrices(WeightRole::kExpert, ff, d, c.n_expert);
    auto up = fill.matrices(WeightRole::kExpert, ff, d, c.n_expert);
    auto down = fill.matrices(WeightRole::kExpert, d, ff, c.n_expert);
    for (int e = 0; e < c.n_expert; ++e)
      lw.moe.experts.push_back({gate[static_cast<std::size_t>(e)], up[static_cast<std::size_t>(e)],
                                down[static_cast<std::size_t>(e)]});
    if (shared)
      lw.moe.shared = model::ExpertWeights{fill.matrix(WeightRole::kSharedExpert, c.d_ff_shared, d),
                                           fill.matrix(WeightRole::kSharedExpert, c.d_ff_shared, d),
                                           fill.matrix(WeightRole::kSharedExpert, d, c.d_ff_shared)};
  }
  bar.finish();
  return m;
}

}  // namespace qflash::runtime
