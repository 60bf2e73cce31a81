/// @file
/// The one way to load a model: config.json parsed once, the run-time spec derived once,
/// SHA256SUMS verified, and every weight of a Hugging Face checkpoint bound in the format the
/// weight scheme gives it (runtime/weight_plan.hpp). Matrices already stored in their format
/// are views into the mapped files (no copy); the others are converted or quantized at load
/// into owned memory, with a progress bar. Name mapping covers both families, both tensor
/// prefixes (`model.`, `model.language_model.`), both expert layouts (stacked
/// `experts.gate_up_proj` / `experts.down_proj`, and per-expert), and Qwen's FP8 checkpoints
/// (`weight_scale_inv` beside each e4m3 weight); and llama.cpp GGUF files of the same two
/// families (`qwen35moe`, `qwen3moe`), whose F32/F16/BF16/Q8_0/Q4_K/Q6_K tensors are used in
/// place. Host only.
#pragma once

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <span>
#include <string_view>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <memory>
#include <set>
#include <string>
#include <unistd.h>
#include <vector>

#include "qflash/arch/arch.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/core/mapped_file.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/io/checkpoint.hpp"
#include "qflash/io/checksums.hpp"
#include "qflash/io/gguf.hpp"
#include "qflash/io/gguf_config.hpp"
#include "qflash/io/hf_config.hpp"
#include "qflash/io/progress.hpp"
#include "qflash/model/model.hpp"
#include "qflash/numeric/finite.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "qflash/runtime/weight_plan.hpp"

namespace qflash::runtime {

struct LoadOptions {
  WeightScheme weights = WeightScheme::kAuto;  ///< kAuto: as stored (f32, bf16, f16, fp8)
  bool progress = ::isatty(2) != 0;             ///< load progress bar on stderr
  bool verify_checksums = true;                 ///< check SHA256SUMS when the directory has one
  model::ModelOptions model;
  /// The model's config when the caller has parsed it already (to check flags against it).
  std::optional<model::ModelConfig> config;
};

/// What the weights' views point into: the mapped checkpoint and the buffers made at load.
struct WeightStorage {
  std::unique_ptr<io::Checkpoint> checkpoint;
  std::unique_ptr<io::GgufFile> gguf;
  std::deque<std::unique_ptr<std::byte[]>> owned;
  std::deque<std::vector<float>> scales;   // fp8 scale grids converted to fp32
  std::deque<std::vector<float>> vectors;  // the small fp32 vectors (norms, conv, gates)

  std::byte* allocate(std::int64_t bytes) {
    return owned.emplace_back(std::make_unique<std::byte[]>(static_cast<std::size_t>(bytes))).get();
  }
  /// Keeps `v` for the weights' lifetime; a view of it.
  model::FloatView keep(std::vector<float> v) { return vectors.emplace_back(std::move(v)); }
};

/// A loaded model before it is given a compiled spec: config, bound weights, their storage.
struct LoadedModel {
  model::ModelConfig config;
  model::ModelWeights weights;
  std::shared_ptr<WeightStorage> storage;
  WeightScheme scheme = WeightScheme::kAuto;

  /// The run-time spec that selects the compiled instance.
  [[nodiscard]] MoeSpec spec() const { return config.spec(KvScheme::kBf16, model::uniform_format(weights)); }

  /// Resident bytes of the matrices per format (fp8 scales counted once per tensor).
  [[nodiscard]] std::map<WeightFormat, std::int64_t> bytes_per_format() const {
    std::map<WeightFormat, std::int64_t> out;
    weights.for_each_matrix([&](std::string const&, WeightView const& v) { out[v.format] += v.bytes(); });
    return out;
  }
};

namespace detail {

inline WeightFormat stored_format(io::TensorRecord const& t) {
  switch (t.dtype) {
    case DType::kF32: return WeightFormat::kF32;
    case DType::kBF16: return WeightFormat::kBf16;
    case DType::kF16: return WeightFormat::kF16;
    case DType::kFp8E4m3: return WeightFormat::kFp8E4m3;
    default:
      QFLASH_CHECK(false, *t.file, ": tensor '", t.name, "' has dtype ", to_string(t.dtype),
                   " (expected F32, BF16, F16 or F8_E4M3 for a weight matrix)");
  }
  return WeightFormat::kAny;
}

/// Throws Error naming the tensor when a vector parameter holds a NaN or Inf.
inline void check_finite(std::span<float const> x, std::string const& file, std::string_view name) {
  std::size_t const i = first_non_finite(x);
  QFLASH_CHECK(i == x.size(), file, ": tensor '", name, "' holds a non-finite value (", x[i], ") at index ", i);
}

/// Binds source matrices in the formats a weight scheme gives them: a view in place when the
/// source already has that format (and is aligned), else a converted copy in the storage.
class Converter {
 public:
  Converter(WeightScheme scheme, WeightStorage& storage) : scheme_(scheme), storage_(storage) {}

  [[nodiscard]] WeightScheme scheme() const { return scheme_; }

  /// `src` (rows of stored tensor `name`, in a file mapping) in the format the scheme gives
  /// `role`. A view in place has its pages read in now; a converted tensor's stored pages are
  /// released: resident memory holds one copy.
  /// Converting reads every value, so a NaN or Inf found on the way is an Error naming `name`.
  WeightView bind(WeightView const& src, WeightRole role, std::string_view name) {
    WeightFormat const want = format_for(scheme_, role, src.cols, src.format);
    if (want != runtime::detail::wanted_format(scheme_, role, src.format)) ++fallbacks_[want];
    if (want == src.format && aligned(src)) {
      populate_mapped_pages({static_cast<std::byte const*>(src.data), static_cast<std::size_t>(src.bytes())});
      return src;
    }
    WeightView const out = convert(src, want);
    if (first_bad_row_ >= 0)
      QFLASH_FAIL("tensor '", name, "': row ", first_bad_row_, " holds a non-finite value (NaN or Inf)");
    release_mapped_pages({static_cast<std::byte const*>(src.data), static_cast<std::size_t>(src.bytes())});
    return out;
  }

  /// Rows of `a` then rows of `b` as one matrix (same width), in a's format when they share
  /// it, else f32: the router and the shared-expert gate as one GEMV.
  WeightView stack(WeightView const& a, WeightView const& b) {
    WeightFormat const f = a.format == b.format && a.format != WeightFormat::kFp8E4m3 ? a.format : WeightFormat::kF32;
    WeightView out{f, nullptr, a.rows + b.rows, a.cols};
    std::byte* dst = storage_.allocate(out.bytes());
    out.data = dst;
    copy_rows(a, f, dst);
    copy_rows(b, f, dst + a.rows * out.row_bytes());
    return out;
  }

  /// Matrices bound in another format than the scheme names (row widths it cannot hold).
  [[nodiscard]] std::map<WeightFormat, int> const& fallbacks() const { return fallbacks_; }

 private:
  static bool aligned(WeightView const& v) {
    auto const a = reinterpret_cast<std::uintptr_t>(v.data);
    return v.format == WeightFormat::kF32 ? a % 4 == 0 : a % 2 == 0;
  }

  /// Every row of `src` decoded and re-encoded in `f`, into dst (rows * row_bytes(f)); the
  /// first row holding a NaN or Inf goes to first_bad_row_.
  void copy_rows(WeightView const& src, WeightFormat f, std::byte* dst) {
    std::int64_t const rb = row_bytes(f, src.cols);
    std::atomic<std::int64_t> bad{std::numeric_limits<std::int64_t>::max()};
    parallel_for(0, src.rows, src.cols * 8, [&](std::int64_t r) {
      thread_local std::vector<float> row;
      row.resize(static_cast<std::size_t>(src.cols));
      dequantize_row(src, r, row.data());
      if (!all_finite(row)) {
        std::int64_t seen = bad.load();
        while (r < seen && !bad.compare_exchange_weak(seen, r)) {
        }
      }
      encode_row(f, row.data(), src.cols, dst + r * rb);
    });
    first_bad_row_ = bad.load() == std::numeric_limits<std::int64_t>::max() ? -1 : bad.load();
  }

  /// `src` converted to format `want` in owned memory.
  WeightView convert(WeightView const& src, WeightFormat want) {
    WeightView out{want, nullptr, src.rows, src.cols};
    std::byte* dst = storage_.allocate(out.bytes());
    out.data = dst;
    if (want != WeightFormat::kFp8E4m3) {
      copy_rows(src, want, dst);
      return out;
    }
    // fp8: the matrix gets its own 128x128 scale grid.
    std::vector<float> dense(static_cast<std::size_t>(src.rows * src.cols));
    parallel_for(0, src.rows, src.cols * 8,
                 [&](std::int64_t r) { dequantize_row(src, r, dense.data() + r * src.cols); });
    first_bad_row_ = -1;
    for (std::int64_t r = 0; r < src.rows && first_bad_row_ < 0; ++r)
      if (!all_finite(std::span<float const>(dense.data() + r * src.cols, static_cast<std::size_t>(src.cols))))
        first_bad_row_ = r;
    auto& grid = storage_.scales.emplace_back(static_cast<std::size_t>(fp8_scale_blocks(src.rows) * fp8_scale_blocks(src.cols)));
    quantize_fp8_block(dense.data(), src.rows, src.cols, reinterpret_cast<std::uint8_t*>(dst), grid.data());
    out.scales = grid.data();
    return out;
  }

  WeightScheme scheme_;
  WeightStorage& storage_;
  std::map<WeightFormat, int> fallbacks_;
  std::int64_t first_bad_row_ = -1;  // of the last conversion
};

/// One log line per format that matrices fell back to.
inline void log_fallbacks(std::map<WeightFormat, int> const& fallbacks) {
  for (auto const& [f, n] : fallbacks)
    QFLASH_LOG_INFO(n, " matrices bound as ", to_string(f),
                    " instead: their row width does not fit the scheme's block format");
}

/// Binds checkpoint tensors as WeightViews in the scheme's formats.
class Binder {
 public:
  Binder(io::Checkpoint const& ckpt, WeightScheme scheme, WeightStorage& storage, io::Progress* progress)
      : ckpt_(ckpt), conv_(scheme, storage), storage_(storage), progress_(progress) {
    prefix_ = ckpt.find("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  }

  [[nodiscard]] std::string const& prefix() const { return prefix_; }
  [[nodiscard]] bool has(std::string const& name) const { return ckpt_.find(name) != nullptr; }

  /// Rows [rows_begin, rows_begin + rows) of tensor `name` (numel checked against `expected`),
  /// as a [rows, cols] matrix in the format the scheme gives `role`.
  WeightView matrix(std::string const& name, WeightRole role, Shape const& expected,
                    std::int64_t rows_begin, std::int64_t rows, std::int64_t cols) {
    WeightView src = source(name, expected, cols);
    if (src.format == WeightFormat::kFp8E4m3 && expected.rank == 3) {
      // A stacked fp8 tensor has one scale grid per expert: view the expert alone.
      std::int64_t const per = expected.dims[1], e = rows_begin / per;
      src = src.slice_rows(e * per, per);
      src.scales += e * fp8_scale_blocks(per) * fp8_scale_blocks(cols);
      src.scale_row0 = 0;
      rows_begin -= e * per;
    }
    return conv_.bind(src.slice_rows(rows_begin, rows), role, name);
  }
  WeightView matrix(std::string const& name, WeightRole role, std::int64_t rows, std::int64_t cols) {
    return matrix(name, role, Shape{rows, cols}, 0, rows, cols);
  }

  /// A whole tensor as fp32, shape checked. In the bf16 scheme its values are rounded to bf16
  /// too (what casting the whole model to bf16 gives), unless `keep_precision`: Qwen3.6
  /// checkpoints keep A_log in f32.
  model::FloatView vector(std::string const& name, Shape const& expected, bool keep_precision = false) {
    return storage_.keep(values(name, expected, keep_precision));
  }
  /// vector()'s values, not kept.
  std::vector<float> values(std::string const& name, Shape const& expected, bool keep_precision = false) {
    io::TensorRecord const& t = get(name, expected);
    std::vector<float> out(static_cast<std::size_t>(t.shape.numel()));
    io::read_f32(t, out);
    check_finite(out, *t.file, name);
    if (conv_.scheme() == WeightScheme::kBf16 && !keep_precision)
      for (float& x : out) x = round_to_bf16(x);
    return out;
  }

  WeightView stack(WeightView const& a, WeightView const& b) { return conv_.stack(a, b); }
  /// Keeps `v` with the weights; a view of it.
  model::FloatView keep(std::vector<float> v) { return storage_.keep(std::move(v)); }

  /// Names of checkpoint tensors no binding asked for.
  [[nodiscard]] std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (auto const& n : ckpt_.names())
      if (!used_.count(n)) out.push_back(n);
    return out;
  }

  [[nodiscard]] std::map<WeightFormat, int> const& fallbacks() const { return conv_.fallbacks(); }

 private:
  io::TensorRecord const& get(std::string const& name, Shape const& expected) {
    io::TensorRecord const& t = ckpt_.get(name, expected);
    if (used_.insert(name).second && progress_) progress_->advance(t.data.size());
    return t;
  }

  /// The whole stored tensor as a view [numel / cols, cols], with its fp8 scales.
  WeightView source(std::string const& name, Shape const& expected, std::int64_t cols) {
    io::TensorRecord const& t = get(name, expected);
    WeightView v{stored_format(t), t.data.data(), t.shape.numel() / cols, cols};
    if (v.format == WeightFormat::kFp8E4m3) v.scales = fp8_scales(t, cols);
    return v;
  }

  /// The fp32 scale grid of an fp8 tensor: [ceil(R / 128), ceil(C / 128)] for a matrix, and
  /// one such grid per expert, [E, ...], for a stacked [E, R, C] tensor. Read once per tensor.
  float const* fp8_scales(io::TensorRecord const& t, std::int64_t cols) {
    std::string const scale_name = t.name + "_scale_inv";
    if (auto it = scales_.find(scale_name); it != scales_.end()) return it->second;
    QFLASH_CHECK(ckpt_.find(scale_name), *t.file, ": fp8 tensor '", t.name, "' has no '", scale_name,
                 "' (128x128 block scales)");
    Shape const grid = t.shape.rank == 3
                           ? Shape{t.shape.dims[0], fp8_scale_blocks(t.shape.dims[1]), fp8_scale_blocks(cols)}
                           : Shape{fp8_scale_blocks(t.shape.numel() / cols), fp8_scale_blocks(cols)};
    io::TensorRecord const& sr = get(scale_name, grid);
    auto& f32 = storage_.scales.emplace_back(static_cast<std::size_t>(grid.numel()));
    io::read_f32(sr, f32);
    return scales_[scale_name] = f32.data();
  }

  io::Checkpoint const& ckpt_;
  Converter conv_;
  WeightStorage& storage_;
  io::Progress* progress_;
  std::string prefix_;
  std::set<std::string> used_;
  std::map<std::string, float const*> scales_;  // fp8 scale grids already read, by name
};

/// Binds every weight the forward pass needs; throws Error naming the file and tensor on a
/// missing tensor or a wrong shape. Vision and MTP tensors are skipped with one log line.
inline model::ModelWeights bind_weights(model::ModelConfig const& c, Binder& wb) {
  using model::ExpertWeights;
  std::int64_t const d = c.d_model;
  std::string const& P = wb.prefix();
  model::ModelWeights m;
  m.embed = wb.matrix(P + "embed_tokens.weight", WeightRole::kEmbedding, c.vocab, d);
  m.final_norm = wb.vector(P + "norm.weight", Shape{d});
  if (c.tie_word_embeddings && !wb.has("lm_head.weight"))
    m.lm_head = m.embed;
  else
    m.lm_head = wb.matrix("lm_head.weight", WeightRole::kLmHead, c.vocab, d);

  std::int64_t const n_expert = c.n_expert, d_ff = c.d_ff_expert;
  for (int l = 0; l < c.n_layer; ++l) {
    std::string const L = P + "layers." + std::to_string(l) + ".";
    model::LayerWeights& w = m.layers.emplace_back();
    w.kind = c.layer_types[static_cast<std::size_t>(l)];
    w.input_norm = wb.vector(L + "input_layernorm.weight", Shape{d});
    w.post_norm = wb.vector(L + "post_attention_layernorm.weight", Shape{d});
    if (w.kind == model::LayerKind::kFullAttention) {
      std::string const A = L + "self_attn.";
      std::int64_t const q_rows = std::int64_t{c.n_head} * c.d_head * (c.attn_output_gate ? 2 : 1);
      std::int64_t const kv_rows = std::int64_t{c.n_head_kv} * c.d_head;
      w.attention.q = wb.matrix(A + "q_proj.weight", WeightRole::kAttentionQkv, q_rows, d);
      w.attention.k = wb.matrix(A + "k_proj.weight", WeightRole::kAttentionQkv, kv_rows, d);
      w.attention.v = wb.matrix(A + "v_proj.weight", WeightRole::kAttentionV, kv_rows, d);
      w.attention.o = wb.matrix(A + "o_proj.weight", WeightRole::kAttentionOut, d, std::int64_t{c.n_head} * c.d_head);
      w.attention.q_norm = wb.vector(A + "q_norm.weight", Shape{c.d_head});
      w.attention.k_norm = wb.vector(A + "k_norm.weight", Shape{c.d_head});
    } else {
      std::string const A = L + "linear_attn.";
      std::int64_t const value_dim = c.linear_value_dim(), conv_dim = c.linear_conv_dim();
      w.linear.qkv = wb.matrix(A + "in_proj_qkv.weight", WeightRole::kDeltaNetIn, conv_dim, d);
      w.linear.z = wb.matrix(A + "in_proj_z.weight", WeightRole::kDeltaNetIn, value_dim, d);
      w.linear.b = wb.matrix(A + "in_proj_b.weight", WeightRole::kDeltaNetIn, c.n_head_v_linear, d);
      w.linear.a = wb.matrix(A + "in_proj_a.weight", WeightRole::kDeltaNetIn, c.n_head_v_linear, d);
      w.linear.out = wb.matrix(A + "out_proj.weight", WeightRole::kDeltaNetOut, d, value_dim);
      w.linear.conv = wb.vector(A + "conv1d.weight", Shape{conv_dim, 1, c.d_conv});
      w.linear.dt_bias = wb.vector(A + "dt_bias", Shape{c.n_head_v_linear});
      std::vector<float> neg_a = wb.values(A + "A_log", Shape{c.n_head_v_linear}, /*keep_precision=*/true);
      for (float& x : neg_a) x = -std::exp(x);
      w.linear.neg_a = wb.keep(std::move(neg_a));
      w.linear.norm = wb.vector(A + "norm.weight", Shape{c.d_head_v_linear});
    }
    std::string const M = L + "mlp.";
    WeightView const router = wb.matrix(M + "gate.weight", WeightRole::kRouter, n_expert, d);
    if (wb.has(M + "experts.gate_up_proj")) {
      Shape const gu{n_expert, 2 * d_ff, d}, dn{n_expert, d, d_ff};
      for (std::int64_t e = 0; e < n_expert; ++e)
        w.moe.experts.push_back(
            {wb.matrix(M + "experts.gate_up_proj", WeightRole::kExpert, gu, e * 2 * d_ff, d_ff, d),
             wb.matrix(M + "experts.gate_up_proj", WeightRole::kExpert, gu, e * 2 * d_ff + d_ff, d_ff, d),
             wb.matrix(M + "experts.down_proj", WeightRole::kExpert, dn, e * d, d, d_ff)});
    } else {
      for (std::int64_t e = 0; e < n_expert; ++e) {
        std::string const E = M + "experts." + std::to_string(e) + ".";
        w.moe.experts.push_back({wb.matrix(E + "gate_proj.weight", WeightRole::kExpert, d_ff, d),
                                 wb.matrix(E + "up_proj.weight", WeightRole::kExpert, d_ff, d),
                                 wb.matrix(E + "down_proj.weight", WeightRole::kExpert, d, d_ff)});
      }
    }
    if (c.d_ff_shared > 0) {
      std::string const S = M + "shared_expert.";
      w.moe.shared = ExpertWeights{wb.matrix(S + "gate_proj.weight", WeightRole::kSharedExpert, c.d_ff_shared, d),
                                   wb.matrix(S + "up_proj.weight", WeightRole::kSharedExpert, c.d_ff_shared, d),
                                   wb.matrix(S + "down_proj.weight", WeightRole::kSharedExpert, d, c.d_ff_shared)};
      w.moe.router = wb.stack(router, wb.matrix(M + "shared_expert_gate.weight", WeightRole::kRouter, 1, d));
    } else {
      w.moe.router = router;
    }
  }

  std::size_t skipped = 0;
  std::vector<std::string> unknown;
  for (auto const& n : wb.unused()) {
    if (n.starts_with("mtp.") || n.starts_with("model.visual.") || n.starts_with("visual."))
      ++skipped;
    else
      unknown.push_back(n);
  }
  if (skipped) QFLASH_LOG_INFO("skipped ", skipped, " vision/MTP tensors (not used by the text model)");
  if (!unknown.empty())
    QFLASH_LOG_WARN(unknown.size(), " checkpoint tensors are not used, e.g. '", unknown.front(), "'");
  log_fallbacks(wb.fallbacks());
  return m;
}


/// The formats a GGUF tensor may hold for qflash to use it.
inline WeightFormat gguf_format(io::GgufTensor const& t) {
  switch (t.type) {
    case io::GgmlType::kF32: return WeightFormat::kF32;
    case io::GgmlType::kF16: return WeightFormat::kF16;
    case io::GgmlType::kBF16: return WeightFormat::kBf16;
    case io::GgmlType::kQ8_0: return WeightFormat::kQ8_0;
    case io::GgmlType::kQ4_K: return WeightFormat::kQ4K;
    case io::GgmlType::kQ6_K: return WeightFormat::kQ6K;
    default:
      QFLASH_CHECK(false, *t.file, ": tensor '", t.name, "' has type ", io::to_string(t.type),
                   " (supported: F32, F16, BF16, Q8_0, Q4_K, Q6_K)");
  }
  return WeightFormat::kAny;
}

/// Binds the tensors of a llama.cpp GGUF file (ggml order: ne[0] is the input width).
class GgufBinder {
 public:
  GgufBinder(io::GgufFile const& f, WeightScheme scheme, WeightStorage& storage, io::Progress* progress)
      : f_(f), conv_(scheme, storage), storage_(storage), progress_(progress) {}

  [[nodiscard]] bool has(std::string const& name) const { return f_.find_tensor(name) != nullptr; }

  /// A matrix [rows, cols] stored as ne {cols, rows}.
  WeightView matrix(std::string const& name, WeightRole role, std::int64_t rows, std::int64_t cols) {
    io::GgufTensor const& t = get(name, {cols, rows, 1, 1});
    return conv_.bind(view(t), role, name);
  }

  /// Expert e's [rows, cols] of a stacked tensor ne {cols, rows, n_expert}.
  WeightView expert(std::string const& name, WeightRole role, std::int64_t e, std::int64_t n_expert,
                    std::int64_t rows, std::int64_t cols) {
    io::GgufTensor const& t = get(name, {cols, rows, n_expert, 1});
    return conv_.bind(view(t).slice_rows(e * rows, rows), role, name);
  }

  /// A vector of n values as fp32 (any leading ne; ggml stores [n] or {n, 1}), kept with the weights.
  model::FloatView vector(std::string const& name, std::int64_t n) {
    io::GgufTensor const& t = get(name, {n, 1, 1, 1});
    std::vector<float> out(static_cast<std::size_t>(n));
    dequantize_row(view(t), 0, out.data());
    check_finite(out, f_.path(), name);
    return storage_.keep(std::move(out));
  }
  /// A [rows, cols] table (e.g. the conv kernel, ne {d_conv, channels}) as fp32, row-major, kept.
  model::FloatView table(std::string const& name, std::int64_t rows, std::int64_t cols) {
    io::GgufTensor const& t = get(name, {cols, rows, 1, 1});
    WeightView const v = view(t);
    std::vector<float> out(static_cast<std::size_t>(rows * cols));
    for (std::int64_t r = 0; r < rows; ++r) dequantize_row(v, r, out.data() + r * cols);
    check_finite(out, f_.path(), name);
    return storage_.keep(std::move(out));
  }

  WeightView stack(WeightView const& a, WeightView const& b) { return conv_.stack(a, b); }
  [[nodiscard]] std::map<WeightFormat, int> const& fallbacks() const { return conv_.fallbacks(); }
  [[nodiscard]] std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (auto const& t : f_.tensors())
      if (!used_.count(t.name)) out.push_back(t.name);
    return out;
  }

 private:
  /// The tensor, its ne checked against `want` (trailing 1s may be absent).
  io::GgufTensor const& get(std::string const& name, std::array<std::int64_t, 4> const& want) {
    io::GgufTensor const& t = f_.tensor(name);
    QFLASH_CHECK(t.ne == want, *t.file, ": tensor '", name, "' has shape ", io::format_ne(t), " (expected {",
                 want[0], ", ", want[1], want[2] > 1 ? ", " + std::to_string(want[2]) : std::string(), "})");
    if (used_.insert(name).second && progress_) progress_->advance(t.bytes());
    return t;
  }

  static WeightView view(io::GgufTensor const& t) {
    return WeightView{gguf_format(t), t.data.data(), t.rows(), t.ne[0]};
  }

  io::GgufFile const& f_;
  Converter conv_;
  WeightStorage& storage_;
  io::Progress* progress_;
  std::set<std::string> used_;
};

/// Binds every weight of a qwen35moe / qwen3moe GGUF file (names as llama.cpp's converter
/// writes them, MODELS.md §5); the config says how the converter changed them.
inline model::ModelWeights bind_gguf_weights(model::ModelConfig const& c, GgufBinder& wb) {
  using model::ExpertWeights;
  std::int64_t const d = c.d_model;
  model::ModelWeights m;
  m.embed = wb.matrix("token_embd.weight", WeightRole::kEmbedding, c.vocab, d);
  m.final_norm = wb.vector("output_norm.weight", d);
  m.lm_head = c.tie_word_embeddings ? m.embed : wb.matrix("output.weight", WeightRole::kLmHead, c.vocab, d);
  std::int64_t const n_expert = c.n_expert, d_ff = c.d_ff_expert;
  for (int l = 0; l < c.n_layer; ++l) {
    std::string const B = "blk." + std::to_string(l) + ".";
    model::LayerWeights& w = m.layers.emplace_back();
    w.kind = c.layer_types[static_cast<std::size_t>(l)];
    w.input_norm = wb.vector(B + "attn_norm.weight", d);
    w.post_norm = wb.vector(B + (c.family == ModelFamily::kQwen35Moe ? "post_attention_norm.weight" : "ffn_norm.weight"), d);
    if (w.kind == model::LayerKind::kFullAttention) {
      std::int64_t const q_rows = std::int64_t{c.n_head} * c.d_head * (c.attn_output_gate ? 2 : 1);
      std::int64_t const kv_rows = std::int64_t{c.n_head_kv} * c.d_head;
      w.attention.q = wb.matrix(B + "attn_q.weight", WeightRole::kAttentionQkv, q_rows, d);
      w.attention.k = wb.matrix(B + "attn_k.weight", WeightRole::kAttentionQkv, kv_rows, d);
      w.attention.v = wb.matrix(B + "attn_v.weight", WeightRole::kAttentionV, kv_rows, d);
      w.attention.o = wb.matrix(B + "attn_output.weight", WeightRole::kAttentionOut, d, std::int64_t{c.n_head} * c.d_head);
      w.attention.q_norm = wb.vector(B + "attn_q_norm.weight", c.d_head);
      w.attention.k_norm = wb.vector(B + "attn_k_norm.weight", c.d_head);
    } else {
      std::int64_t const value_dim = c.linear_value_dim(), conv_dim = c.linear_conv_dim();
      w.linear.qkv = wb.matrix(B + "attn_qkv.weight", WeightRole::kDeltaNetIn, conv_dim, d);
      w.linear.z = wb.matrix(B + "attn_gate.weight", WeightRole::kDeltaNetIn, value_dim, d);
      w.linear.b = wb.matrix(B + "ssm_beta.weight", WeightRole::kDeltaNetIn, c.n_head_v_linear, d);
      w.linear.a = wb.matrix(B + "ssm_alpha.weight", WeightRole::kDeltaNetIn, c.n_head_v_linear, d);
      w.linear.out = wb.matrix(B + "ssm_out.weight", WeightRole::kDeltaNetOut, d, value_dim);
      w.linear.conv = wb.table(B + "ssm_conv1d.weight", conv_dim, c.d_conv);
      w.linear.dt_bias = wb.vector(B + "ssm_dt.bias", c.n_head_v_linear);
      w.linear.neg_a = wb.vector(B + "ssm_a", c.n_head_v_linear);  // stored as -exp(A_log)
      w.linear.norm = wb.vector(B + "ssm_norm.weight", c.d_head_v_linear);
    }
    WeightView const router = wb.matrix(B + "ffn_gate_inp.weight", WeightRole::kRouter, n_expert, d);
    for (std::int64_t e = 0; e < n_expert; ++e)
      w.moe.experts.push_back({wb.expert(B + "ffn_gate_exps.weight", WeightRole::kExpert, e, n_expert, d_ff, d),
                               wb.expert(B + "ffn_up_exps.weight", WeightRole::kExpert, e, n_expert, d_ff, d),
                               wb.expert(B + "ffn_down_exps.weight", WeightRole::kExpert, e, n_expert, d, d_ff)});
    if (c.d_ff_shared > 0) {
      w.moe.shared = ExpertWeights{wb.matrix(B + "ffn_gate_shexp.weight", WeightRole::kSharedExpert, c.d_ff_shared, d),
                                   wb.matrix(B + "ffn_up_shexp.weight", WeightRole::kSharedExpert, c.d_ff_shared, d),
                                   wb.matrix(B + "ffn_down_shexp.weight", WeightRole::kSharedExpert, d, c.d_ff_shared)};
      // ffn_gate_inp_shexp is [d] or {d, 1}: one row either way.
      w.moe.router = wb.stack(router, wb.matrix(B + "ffn_gate_inp_shexp.weight", WeightRole::kRouter, 1, d));
    } else {
      w.moe.router = router;
    }
  }
  std::vector<std::string> const unused = wb.unused();
  if (!unused.empty())
    QFLASH_LOG_INFO(unused.size(), " GGUF tensors are not used (e.g. MTP blocks), e.g. '", unused.front(), "'");
  log_fallbacks(wb.fallbacks());
  return m;
}
}  // namespace detail

namespace detail {
/// The files of a model directory that loading and running read (names relative to it): the
/// configs and tokenizer present, and the weights Checkpoint::open will choose.
inline std::vector<std::string> model_files(std::string const& dir) {
  namespace fs = std::filesystem;
  std::set<std::string> out;
  std::error_code ec;
  for (std::string name : {"config.json", "generation_config.json", "tokenizer.json"})
    if (fs::exists(fs::path(dir) / name, ec)) out.insert(name);
  std::string const index(io::Checkpoint::kIndexFile);
  if (fs::exists(fs::path(dir) / io::Checkpoint::kSingleFile, ec)) {
    out.insert(std::string(io::Checkpoint::kSingleFile));
  } else if (fs::exists(fs::path(dir) / index, ec)) {
    out.insert(index);
    io::Json const j = io::read_json_file((fs::path(dir) / index).string());
    if (auto it = j.find("weight_map"); it != j.end() && it->is_object())
      for (auto const& shard : *it)
        if (shard.is_string()) out.insert(shard.get<std::string>());
  }
  return {out.begin(), out.end()};
}
}  // namespace detail

/// True when `path` is a GGUF file (by its magic), not a model directory.
inline bool is_gguf_file(std::string const& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  f.read(magic, 4);
  return f.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0;
}

/// Loads a llama.cpp GGUF file (qwen35moe or qwen3moe); throws Error naming the file and key/tensor.
inline LoadedModel load_gguf(std::string const& path, LoadOptions const& opts = {}) {
  LoadedModel m;
  m.scheme = opts.weights;
  m.storage = std::make_shared<WeightStorage>();
  m.storage->gguf = std::make_unique<io::GgufFile>(path);
  io::GgufFile const& f = *m.storage->gguf;
  m.config = opts.config ? *opts.config : io::config_from_gguf(f);
  io::Progress progress("loading " + path, f.weight_bytes(), opts.progress);
  detail::GgufBinder binder(f, opts.weights, *m.storage, &progress);
  m.weights = detail::bind_gguf_weights(m.config, binder);
  progress.finish();
  return m;
}

/// Loads a Hugging Face model directory, or a GGUF file (load_gguf); throws Error naming the
/// file and field/tensor.
inline LoadedModel load_model(std::string const& dir, LoadOptions const& opts = {}) {
  if (is_gguf_file(dir)) return load_gguf(dir, opts);
  if (opts.verify_checksums && io::has_checksums(dir)) io::verify_checksums(dir, detail::model_files(dir), opts.progress);
  LoadedModel m;
  m.config = opts.config ? *opts.config : io::load_config(dir);
  m.scheme = opts.weights;
  m.storage = std::make_shared<WeightStorage>();
  m.storage->checkpoint = std::make_unique<io::Checkpoint>(io::Checkpoint::open(dir));
  io::Checkpoint const& ckpt = *m.storage->checkpoint;
  QFLASH_CHECK(ckpt.has_weights(), dir, ": no weights (model.safetensors or its index) found");
  io::Progress progress("loading " + ckpt.dir(), ckpt.weight_bytes(), opts.progress);
  detail::Binder binder(ckpt, opts.weights, *m.storage, &progress);
  m.weights = detail::bind_weights(m.config, binder);
  progress.finish();
  return m;
}

/// The model as compiled spec S on Arch (throws when S does not run it).
template <MoeSpec S, class Arch = arch::Cpu>
std::unique_ptr<model::Model<S, Arch>> make_model(LoadedModel m, model::ModelOptions const& opts = {}) {
  return std::make_unique<model::Model<S, Arch>>(std::move(m.config), std::move(m.weights),
                                                 std::move(m.storage), opts);
}

/// load_model, then make_model<S, Arch>.
template <MoeSpec S, class Arch = arch::Cpu>
std::unique_ptr<model::Model<S, Arch>> load_model_as(std::string const& dir, LoadOptions const& opts = {}) {
  return make_model<S, Arch>(load_model(dir, opts), opts.model);
}

}  // namespace qflash::runtime
