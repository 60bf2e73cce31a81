/// @file
/// PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`, as PEFT's
/// save_pretrained writes them) read for a loaded model, validated by name, and either run
/// unmerged beside the base projections (model/lora.hpp) or merged into the weights at load.
///
/// What an adapter may update (the Flash design's target_modules): attention q/k/v/o_proj, the
/// Gated DeltaNet in_proj_qkv/z/b/a and out_proj, the shared expert's gate/up/down_proj, the
/// routed experts (PEFT's target_parameters `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`
/// on transformers' stacked experts, or per-expert gate/up/down_proj modules), and, through
/// modules_to_save, whole lm_head / embed_tokens tables. An adapter that touches the router
/// (`mlp.gate`, `shared_expert_gate`) is refused: routing stays the base model's. Updates are
/// B (A x) * scale with scale = lora_alpha / r (use_rslora: / sqrt(r)) times the caller's scale,
/// held in f32. Host only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/json.hpp"
#include "qflash/io/safetensors.hpp"
#include "qflash/model/lora.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "qflash/runtime/load_model.hpp"

namespace qflash::runtime {

/// The bytes behind a LoraAdapter's views.
struct LoraStorage {
  std::deque<std::vector<float>> buffers;
  std::deque<OwnedMatrix> tables;
  std::span<float> allocate(std::int64_t n) {
    auto& b = buffers.emplace_back(static_cast<std::size_t>(n));
    return b;
  }
};

namespace detail {

/// Whether a module path, target or parameter name is the router or the shared-expert gate.
inline bool is_router(std::string_view module) {
  return module == "gate" || module.ends_with(".gate") || module.find("mlp.gate.") != std::string_view::npos ||
         module.find("shared_expert_gate") != std::string_view::npos || module == "router" ||
         module.ends_with(".router");
}

/// A tensor of the adapter file in f32, every value finite; `what` names it in errors.
inline std::vector<float> lora_tensor(io::TensorRecord const& t, std::string const& file) {
  QFLASH_CHECK(t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16, file, ": tensor '",
               t.name, "' is ", io::detail::safetensors_dtype_name(t.dtype), "; LoRA weights must be F32, BF16 or F16");
  QFLASH_CHECK(t.shape.rank == 2, file, ": tensor '", t.name, "' has ", t.shape.rank,
               " dimensions; LoRA weights are matrices");
  std::vector<float> v = io::read_f32(t);
  for (std::size_t i = 0; i < v.size(); ++i)
    QFLASH_CHECK(std::isfinite(v[i]), file, ": tensor '", t.name, "' holds a non-finite value (NaN or Inf) at ", i);
  return v;
}

}  // namespace detail

/// Reads the PEFT LoRA adapter in `dir` for model `m`.
/// @param scale  multiplies the adapter's own lora_alpha / r
/// @param name   what requests and logs call it (default: the directory's name)
/// @throws Error naming the file and the field or tensor, for anything it cannot apply exactly
inline std::shared_ptr<model::LoraAdapter const> load_lora(std::string const& dir, LoadedModel const& m,
                                                          float scale = 1.0f, std::string name = {}) {
  namespace fs = std::filesystem;
  QFLASH_CHECK(fs::is_directory(dir), "LoRA adapter '", dir,
               "' is not a directory (expected PEFT's adapter_config.json and adapter_model.safetensors in one)");
  QFLASH_CHECK(std::isfinite(scale), "LoRA adapter '", dir, "': scale ", scale, " is not a finite number");
  QFLASH_CHECK(!(m.storage && m.storage->gguf), "LoRA adapter '", dir, "': adapters apply to Hugging Face "
               "checkpoints; ", m.config.source, " is a GGUF file (its matrices are laid out differently)");
  std::string const cfg_path = (fs::path(dir) / "adapter_config.json").string();
  std::string const st_path = (fs::path(dir) / "adapter_model.safetensors").string();
  QFLASH_CHECK(fs::exists(cfg_path), "LoRA adapter '", dir, "': no adapter_config.json");
  QFLASH_CHECK(fs::exists(st_path), "LoRA adapter '", dir, "': no adapter_model.safetensors",
               fs::exists(fs::path(dir) / "adapter_model.bin") ? " (adapter_model.bin is a pickle: save with "
                                                                 "safe_serialization=True)"
                                                               : "");
  io::Json const cfg_json = io::read_json_file(cfg_path);
  io::JsonFields const cfg(cfg_json, cfg_path);

  std::string const type = cfg.string("peft_type");
  QFLASH_CHECK(type == "LORA", cfg_path, ": field 'peft_type' is '", type, "'; only LORA adapters are supported");
  int const r = cfg.positive_int("r");
  double const alpha = cfg.number("lora_alpha", 8.0);
  QFLASH_CHECK(std::isfinite(alpha), cfg_path, ": field 'lora_alpha' must be a finite number");
  bool const rslora = cfg.boolean("use_rslora", false);
  QFLASH_CHECK(!cfg.boolean("use_dora", false), cfg_path, ": field 'use_dora' is true; DoRA adapters are not supported");
  QFLASH_CHECK(!cfg.boolean("fan_in_fan_out", false), cfg_path, ": field 'fan_in_fan_out' is true; the models' "
               "projections are nn.Linear, so it must be false");
  QFLASH_CHECK(!cfg.boolean("lora_bias", false), cfg_path, ": field 'lora_bias' is true; LoRA biases are not supported");
  std::string const bias = cfg.string("bias", "none");
  QFLASH_CHECK(bias == "none", cfg_path, ": field 'bias' is '", bias, "'; only 'none' is supported");
  for (char const* key : {"rank_pattern", "alpha_pattern"})
    if (io::Json const* p = cfg.find(key))
      QFLASH_CHECK(p->is_object() && p->empty(), cfg_path, ": field '", key,
                   "' is set; per-module ranks and alphas are not supported");
  if (io::Json const* t = cfg.find("target_modules")) {
    std::vector<std::string> targets;
    if (t->is_string())
      targets.push_back(t->get<std::string>());
    else
      targets = cfg.string_list("target_modules");
    for (auto const& tm : targets)
      QFLASH_CHECK(!detail::is_router(tm), cfg_path,
                   ": target_modules names the router ('", tm, "'); the router stays frozen, so an adapter may not "
                   "change it (train without it)");
  }
  std::vector<std::string> params;
  if (cfg.find("target_parameters")) params = cfg.string_list("target_parameters");
  for (auto const& p : params) {
    QFLASH_CHECK(!detail::is_router(p), cfg_path,
                 ": target_parameters names the router ('", p, "'); the router stays frozen, so an adapter may not "
                 "change it (train without it)");
    QFLASH_CHECK(p.ends_with("experts.gate_up_proj") || p.ends_with("experts.down_proj"), cfg_path,
                 ": target_parameters entry '", p, "' is not one qflash applies (mlp.experts.gate_up_proj, "
                 "mlp.experts.down_proj)");
  }
  bool save_lm_head = false, save_embed = false;
  if (cfg.find("modules_to_save"))
    for (auto const& mod : cfg.string_list("modules_to_save")) {
      if (mod == "lm_head")
        save_lm_head = true;
      else if (mod == "embed_tokens")
        save_embed = true;
      else
        QFLASH_CHECK(!detail::is_router(mod), cfg_path, ": modules_to_save names the router ('", mod,
                     "'); the router stays frozen");
      QFLASH_CHECK(mod == "lm_head" || mod == "embed_tokens", cfg_path, ": modules_to_save entry '", mod,
                   "' is not supported (lm_head, embed_tokens)");
    }

  double const s = scale * (rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / r);
  auto storage = std::make_shared<LoraStorage>();
  auto ad = std::make_shared<model::LoraAdapter>();
  ad->name = name.empty() ? fs::path(dir).lexically_normal().filename().string() : std::move(name);
  if (ad->name.empty()) ad->name = fs::path(dir).lexically_normal().parent_path().filename().string();
  ad->layers.resize(m.weights.layers.size());

  io::SafetensorsFile const file(st_path);
  auto const& ws = m.weights;
  // A: [r, in] as stored; B: [out, r] times the scale.
  auto make = [&](std::vector<float> const& a, std::int64_t rank, std::int64_t in, std::vector<float> const& b,
                  std::int64_t out, std::int64_t b_stride, std::int64_t b_col0, std::int64_t b_col_step,
                  std::int64_t a_row0) {
    std::span<float> ab = storage->allocate(rank * in), bb = storage->allocate(out * rank);
    for (std::int64_t j = 0; j < rank; ++j)
      for (std::int64_t i = 0; i < in; ++i) ab[static_cast<std::size_t>(j * in + i)] = a[static_cast<std::size_t>((a_row0 + j) * in + i)];
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t j = 0; j < rank; ++j)
        bb[static_cast<std::size_t>(o * rank + j)] = static_cast<float>(
            s * b[static_cast<std::size_t>(o * b_stride + b_col0 + j * b_col_step)]);
    return kernels::LowRank{WeightView{WeightFormat::kF32, ab.data(), rank, in},
                            WeightView{WeightFormat::kF32, bb.data(), out, rank}};
  };

  // Pairs of lora_A / lora_B by module path (PEFT's prefix stripped).
  struct Pair {
    io::TensorRecord const* a = nullptr;
    io::TensorRecord const* b = nullptr;
  };
  std::map<std::string, Pair> pairs;
  for (auto const& t : file.tensors()) {
    std::string_view key = t.name;
    if (key.starts_with("base_model.model.")) key.remove_prefix(std::string_view("base_model.model.").size());
    if (key.starts_with("model.language_model.")) key.remove_prefix(std::string_view("model.language_model.").size());
    else if (key.starts_with("model.")) key.remove_prefix(std::string_view("model.").size());
    QFLASH_CHECK(!detail::is_router(key.substr(0, key.rfind(".lora_"))), st_path, ": tensor '", t.name, "' updates the router; the router stays frozen, so an adapter may not "
                 "change it");
    if (key == "embed_tokens.weight" || key == "lm_head.weight") {
      bool const embed = key == "embed_tokens.weight";
      QFLASH_CHECK(embed ? save_embed : save_lm_head, st_path, ": tensor '", t.name, "' is not in adapter_config.json's "
                   "modules_to_save");
      WeightView const& base = embed ? ws.embed : ws.lm_head;
      QFLASH_CHECK(t.shape.rank == 2 && t.shape[0] == base.rows && t.shape[1] == base.cols, st_path, ": tensor '",
                   t.name, "' has shape ", to_string(t.shape), ", the model's ", embed ? "embed_tokens" : "lm_head", " is [",
                   base.rows, ", ", base.cols, "]");
      std::vector<float> v = detail::lora_tensor(t, st_path);
      auto& owned = storage->tables.emplace_back(encode_matrix(WeightFormat::kF32, v.data(), base.rows, base.cols));
      (embed ? ad->embed : ad->lm_head) = owned.view;
      continue;
    }
    std::size_t const at = key.rfind(".lora_");
    QFLASH_CHECK(at != std::string_view::npos && (key.substr(at) == ".lora_A.weight" || key.substr(at) == ".lora_B.weight"),
                 st_path, ": tensor '", t.name, "' is not a LoRA weight qflash knows (module.lora_A.weight / "
                 "module.lora_B.weight, embed_tokens.weight, lm_head.weight)");
    auto& p = pairs[std::string(key.substr(0, at))];
    (key[at + 6] == 'A' ? p.a : p.b) = &t;
  }

  for (auto const& [module, p] : pairs) {
    QFLASH_CHECK(p.a && p.b, st_path, ": module '", module, "' has lora_", p.a ? "A" : "B", " but no lora_",
                 p.a ? "B" : "A");
    // layers.N.<rest>
    QFLASH_CHECK(module.starts_with("layers."), st_path, ": tensor '", p.a->name, "' updates module '", module,
                 "', which qflash does not apply adapters to (known: attention q/k/v/o_proj, Gated DeltaNet "
                 "in_proj_qkv/z/b/a and out_proj, shared and routed experts' gate/up/down_proj)");
    std::size_t const dot = module.find('.', 7);
    std::string const num = module.substr(7, dot == std::string::npos ? std::string::npos : dot - 7);
    char* end = nullptr;
    long const layer = std::strtol(num.c_str(), &end, 10);
    QFLASH_CHECK(dot != std::string::npos && !num.empty() && *end == '\0' && layer >= 0 &&
                     layer < static_cast<long>(ws.layers.size()),
                 st_path, ": tensor '", p.a->name, "': layer '", num, "' is not one of the model's ", ws.layers.size());
    std::string const rest = module.substr(dot + 1);
    model::LayerWeights const& lw = ws.layers[static_cast<std::size_t>(layer)];
    model::LoraLayer& ll = ad->layers[static_cast<std::size_t>(layer)];
    std::vector<float> const a = detail::lora_tensor(*p.a, st_path), b = detail::lora_tensor(*p.b, st_path);
    std::int64_t const a_rows = p.a->shape[0], a_cols = p.a->shape[1], b_rows = p.b->shape[0], b_cols = p.b->shape[1];
    auto shape_check = [&](std::int64_t want_a_rows, std::int64_t in, std::int64_t out, std::string const& what) {
      QFLASH_CHECK(a_rows == want_a_rows && a_cols == in && b_rows == out && b_cols == want_a_rows, st_path, ": ", what,
                   " in layer ", layer, ": lora_A is ", to_string(p.a->shape), " and lora_B ", to_string(p.b->shape), "; rank ", r,
                   " needs lora_A [", want_a_rows, ", ", in, "] and lora_B [", out, ", ", want_a_rows, "]");
    };

    if (model::LoraProjection const* target = model::lora_projection(rest)) {
      kernels::LowRank* slot = &(ll.*target->update);
      WeightView const* base = target->base(lw);
      QFLASH_CHECK(base, st_path, ": tensor '", p.a->name, "' updates ", rest, " in layer ", layer,
                   ", which the model does not have there (", model::describe_layer(lw),
                   "): is the adapter for another model?");
      shape_check(r, base->cols, base->rows, rest);
      *slot = make(a, r, base->cols, b, base->rows, r, 0, 1, 0);
      continue;
    }

    // Routed experts: PEFT's stacked-parameter wrappers (mlp.experts[.base_layer]*), or per-expert modules.
    std::size_t const n_expert = lw.moe.experts.size();
    std::int64_t const d_model = ws.embed.cols;
    std::int64_t const d_ff = n_expert ? lw.moe.experts[0].gate.rows : 0;
    auto ensure = [&](std::vector<kernels::LowRank>& v) {
      if (v.empty()) v.resize(n_expert);
    };
    if (rest.starts_with("mlp.experts") && (rest == "mlp.experts" || rest.starts_with("mlp.experts.base_layer"))) {
      std::size_t depth = 0;
      for (std::size_t at2 = rest.find("base_layer"); at2 != std::string::npos; at2 = rest.find("base_layer", at2 + 1)) ++depth;
      QFLASH_CHECK(depth < params.size(), st_path, ": tensor '", p.a->name, "' is a stacked-experts update, but "
                   "adapter_config.json's target_parameters lists ", params.size(), " expert parameters");
      std::string const& param = params[params.size() - 1 - depth];  // PEFT wraps in list order: the first is innermost
      bool const gate_up = param.ends_with("gate_up_proj");
      std::int64_t const E = static_cast<std::int64_t>(n_expert);
      shape_check(r * E, gate_up ? d_model : d_ff, gate_up ? 2 * d_ff : d_model, "mlp.experts." + param.substr(param.rfind('.') + 1));
      // A: rows e * r + j; B: [out, r * E] with column j * E + e (PEFT's reshape(out, r, E)).
      if (gate_up) {
        ensure(ll.gate);
        ensure(ll.up);
      } else {
        ensure(ll.down);
      }
      std::vector<float> const b_up = gate_up ? std::vector<float>(b.begin() + d_ff * r * E, b.end()) : std::vector<float>{};
      for (std::int64_t e = 0; e < E; ++e) {
        if (gate_up) {  // gate_up_proj's rows: gate [0, d_ff), up [d_ff, 2 d_ff)
          ll.gate[static_cast<std::size_t>(e)] = make(a, r, d_model, b, d_ff, r * E, e, E, e * r);
          ll.up[static_cast<std::size_t>(e)] = make(a, r, d_model, b_up, d_ff, r * E, e, E, e * r);
        } else {
          ll.down[static_cast<std::size_t>(e)] = make(a, r, d_ff, b, d_model, r * E, e, E, e * r);
        }
      }
      continue;
    }
    // mlp.experts.E.{gate,up,down}_proj (per-expert nn.Linear modules)
    if (rest.starts_with("mlp.experts.")) {
      std::string const tail = rest.substr(12);
      std::size_t const d2 = tail.find('.');
      std::string const en = tail.substr(0, d2);
      long const e = std::strtol(en.c_str(), &end, 10);
      std::string const proj = d2 == std::string::npos ? "" : tail.substr(d2 + 1);
      QFLASH_CHECK(!en.empty() && *end == '\0' && e >= 0 && e < static_cast<long>(n_expert) &&
                       (proj == "gate_proj" || proj == "up_proj" || proj == "down_proj"),
                   st_path, ": tensor '", p.a->name, "' names expert module '", rest, "'; layer ", layer, " has ",
                   n_expert, " experts with gate_proj, up_proj and down_proj");
      bool const down = proj == "down_proj";
      shape_check(r, down ? d_ff : d_model, down ? d_model : d_ff, rest);
      auto& v = proj == "gate_proj" ? ll.gate : proj == "up_proj" ? ll.up : ll.down;
      ensure(v);
      v[static_cast<std::size_t>(e)] = make(a, r, down ? d_ff : d_model, b, down ? d_model : d_ff, r, 0, 1, 0);
      continue;
    }
    QFLASH_FAIL(st_path, ": tensor '", p.a->name, "' updates module '", rest, "' in layer ", layer,
                ", which qflash does not apply adapters to (known: self_attn.{q,k,v,o}_proj, linear_attn.{in_proj_qkv,"
                "in_proj_z,in_proj_b,in_proj_a,out_proj}, mlp.shared_expert.{gate,up,down}_proj, mlp.experts)");
  }
  // A routed-expert update list is either complete or absent: a per-expert file may cover some experts.
  for (auto& ll : ad->layers)
    for (auto* v : {&ll.gate, &ll.up, &ll.down})
      if (std::all_of(v->begin(), v->end(), [](kernels::LowRank const& d) { return d.empty(); })) v->clear();

  ad->storage = storage;
  model::check_adapter(*ad, ws);
  return ad;
}

/// One adapter that applies all of `parts` at once: each update's ranks stacked (A rows, B
/// columns), so B (A x) is the sum of theirs; named "a+b". At most one part may replace each table.
inline std::shared_ptr<model::LoraAdapter const> combine_lora(
    std::vector<std::shared_ptr<model::LoraAdapter const>> const& parts) {
  QFLASH_CHECK(!parts.empty(), "combine_lora: no adapters");
  if (parts.size() == 1) return parts[0];
  auto storage = std::make_shared<LoraStorage>();
  auto out = std::make_shared<model::LoraAdapter>();
  std::vector<std::shared_ptr<void const>> keep;
  for (auto const& p : parts) {
    QFLASH_CHECK(p->layers.size() == parts[0]->layers.size(), "LoRA adapters '", parts[0]->name, "' and '", p->name,
                 "' are for models of different depths");
    out->name += (out->name.empty() ? "" : "+") + p->name;
    keep.push_back(p->storage);
    for (auto [mine, theirs, what] : {std::tuple{&out->embed, &p->embed, "embed_tokens"},
                                      std::tuple{&out->lm_head, &p->lm_head, "lm_head"}}) {
      QFLASH_CHECK(!(*mine && *theirs), "LoRA adapters: more than one replaces ", what, " (modules_to_save)");
      if (*theirs) *mine = *theirs;
    }
  }
  auto stack = [&](std::vector<kernels::LowRank const*> const& ds) {
    kernels::LowRank const* first = nullptr;
    std::int64_t rank = 0;
    for (auto const* d : ds)
      if (d && !d->empty()) {
        first = first ? first : d;
        rank += d->rank();
      }
    if (!first) return kernels::LowRank{};
    std::int64_t const in = first->a.cols, n_out = first->b.rows;
    std::span<float> a = storage->allocate(rank * in), b = storage->allocate(n_out * rank);
    std::int64_t j0 = 0;
    for (auto const* d : ds) {
      if (!d || d->empty()) continue;
      auto const* da = static_cast<float const*>(d->a.data);
      auto const* db = static_cast<float const*>(d->b.data);
      std::int64_t const r = d->rank();
      std::copy_n(da, r * in, a.data() + j0 * in);
      for (std::int64_t o = 0; o < n_out; ++o) std::copy_n(db + o * r, r, b.data() + o * rank + j0);
      j0 += r;
    }
    return kernels::LowRank{WeightView{WeightFormat::kF32, a.data(), rank, in},
                            WeightView{WeightFormat::kF32, b.data(), n_out, rank}};
  };
  out->layers.resize(parts[0]->layers.size());
  for (std::size_t l = 0; l < out->layers.size(); ++l) {
    model::LoraLayer& o = out->layers[l];
    for (auto const& proj : model::kLoraProjections) {
      auto const member = proj.update;
      std::vector<kernels::LowRank const*> ds;
      for (auto const& p : parts) ds.push_back(&(p->layers[l].*member));
      o.*member = stack(ds);
    }
    for (auto const& proj : model::kLoraExpertProjections) {
      auto const member = proj.updates;
      std::size_t n = 0;
      for (auto const& p : parts) n = std::max(n, (p->layers[l].*member).size());
      if (n == 0) continue;
      (o.*member).resize(n);
      for (std::size_t e = 0; e < n; ++e) {
        std::vector<kernels::LowRank const*> ds;
        for (auto const& p : parts)
          ds.push_back((p->layers[l].*member).empty() ? nullptr : &(p->layers[l].*member)[e]);
        (o.*member)[e] = stack(ds);
      }
    }
  }
  keep.push_back(storage);
  out->storage = std::make_shared<std::vector<std::shared_ptr<void const>>>(std::move(keep));
  return out;
}

/// Folds `ad` into `m`'s weights at load: every matrix it updates becomes W + B A in W's own
/// format (decoded, summed in f32, encoded again: exact for f32, one rounding for bf16 / f16, a
/// requantization for block formats), and its modules_to_save tables replace the model's (in the
/// model's format). The base bytes are not written (a mapped checkpoint stays as it was).
inline void merge_lora(LoadedModel& m, model::LoraAdapter const& ad) {
  model::check_adapter(ad, m.weights);
  auto keep = [&](OwnedMatrix&& enc) {
    WeightView v = enc.view;
    std::byte* bytes = m.storage->allocate(static_cast<std::int64_t>(enc.bytes.size()));
    std::copy(enc.bytes.begin(), enc.bytes.end(), bytes);
    v.data = bytes;
    if (!enc.scales.empty()) v.scales = m.storage->scales.emplace_back(std::move(enc.scales)).data();
    return v;
  };
  auto merge = [&](WeightView& w, kernels::LowRank const& d) {
    if (d.empty()) return;
    std::vector<float> full(static_cast<std::size_t>(w.rows * w.cols));
    for (std::int64_t r = 0; r < w.rows; ++r) dequantize_row(w, r, full.data() + r * w.cols);
    auto const* a = static_cast<float const*>(d.a.data);
    auto const* b = static_cast<float const*>(d.b.data);
    std::int64_t const rank = d.rank();
    for (std::int64_t o = 0; o < w.rows; ++o)
      for (std::int64_t j = 0; j < rank; ++j) {
        float const bo = b[o * rank + j];
        float* row = full.data() + o * w.cols;
        for (std::int64_t i = 0; i < w.cols; ++i) row[i] += bo * a[j * w.cols + i];
      }
    w = keep(encode_matrix(w.format, full.data(), w.rows, w.cols));
  };
  for (std::size_t l = 0; l < m.weights.layers.size(); ++l) {
    model::LayerWeights& lw = m.weights.layers[l];
    model::LoraLayer const& u = ad.layers[l];
    for (auto const& p : model::kLoraProjections)
      if (WeightView* w = p.base(lw)) merge(*w, u.*p.update);
    for (auto const& p : model::kLoraExpertProjections)
      if (!(u.*p.updates).empty())
        for (std::size_t e = 0; e < lw.moe.experts.size(); ++e) merge(lw.moe.experts[e].*p.base, (u.*p.updates)[e]);
  }
  for (auto [table, base] : {std::pair{&ad.embed, &m.weights.embed}, std::pair{&ad.lm_head, &m.weights.lm_head}})
    if (*table) {
      std::vector<float> full(static_cast<std::size_t>(base->rows * base->cols));
      for (std::int64_t r = 0; r < base->rows; ++r) dequantize_row(**table, r, full.data() + r * base->cols);
      *base = keep(encode_matrix(base->format, full.data(), base->rows, base->cols));
    }
}

}  // namespace qflash::runtime
