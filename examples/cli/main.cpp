// The qflash command-line program: a thin layer that parses flags and calls the library.
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "qflash/io/hf_config.hpp"
#include "qflash/io/npy.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/perplexity.hpp"
#include "qflash/runtime/weight_plan.hpp"

namespace {

using namespace qflash;

struct CommonOptions {
  std::string model_dir = QFLASH_DEFAULT_MODEL_DIR;
  std::string weights = "auto";
  int threads = 0;
  bool no_verify = false;
};

void add_common(CLI::App* cmd, CommonOptions& o) {
  cmd->add_option("-m,--model", o.model_dir, "Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a llama.cpp .gguf file")
      ->capture_default_str();
  std::vector<std::string> schemes;
  for (auto const& [k, name] : runtime::kWeightSchemes) schemes.emplace_back(name);
  cmd->add_option("--weights", o.weights,
                  "weight format in memory: auto (as stored), f32, bf16, fp8 (e4m3, 128x128 scales), q8_0, q4_k, "
                  "q6_k, q4_k_m (q4_k with q6_k for output projections, shared expert, embeddings, lm_head), "
                  "int4 (group 128); converted at load, router gates keep the checkpoint's precision")
      ->check(CLI::IsMember(schemes))
      ->capture_default_str();
  cmd->add_option("-t,--threads", o.threads, "CPU threads (0: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_flag("--no-verify", o.no_verify, "skip checking the files against the model's SHA256SUMS");
}

runtime::LoadOptions load_options(CommonOptions const& o) {
#if defined(_OPENMP)
  if (o.threads > 0) omp_set_num_threads(o.threads);
#endif
  std::error_code ec;
  QFLASH_CHECK(std::filesystem::exists(o.model_dir, ec), "model '", o.model_dir, "' does not exist",
               o.model_dir == QFLASH_DEFAULT_MODEL_DIR ? " (the embedded default model is missing: pass --model DIR)" : "");
  QFLASH_CHECK(std::filesystem::is_directory(o.model_dir, ec) || runtime::is_gguf_file(o.model_dir), "model '",
               o.model_dir, "' is neither a model directory nor a GGUF file");
  runtime::LoadOptions m;
  m.weights = runtime::parse_weight_scheme(o.weights);
  m.verify_checksums = !o.no_verify;
  return m;
}

/// Loads the model as the compiled spec that fits it and calls fn(model).
template <class Fn>
void with_model(CommonOptions const& o, Fn&& fn) {
  auto opts = load_options(o);
  runtime::with_model(runtime::load_model(o.model_dir, opts), opts.model, fn);
}

/// The model's tokenizer: tokenizer.json beside the weights, or a GGUF file's tokenizer.ggml.*.
io::Tokenizer load_tokenizer(std::string const& model) {
  if (runtime::is_gguf_file(model)) return io::Tokenizer::from_gguf(io::GgufFile(model));
  return io::Tokenizer::from_file(model + "/tokenizer.json");
}

std::vector<std::int32_t> parse_ids(std::string const& text) {
  std::vector<std::int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::size_t used = 0;
    long v = -1;
    try {
      v = std::stol(item, &used);
    } catch (std::exception const&) {
      used = 0;
    }
    QFLASH_CHECK(used == item.size() && !item.empty() && v >= 0, "--prompt-ids: '", item,
                 "' is not a non-negative integer (expected e.g. 1,2,3)");
    ids.push_back(static_cast<std::int32_t>(v));
  }
  QFLASH_CHECK(!ids.empty(), "--prompt-ids: no ids given");
  return ids;
}

std::string human_count(double n) {
  char buf[32];
  if (n >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

/// Matrix bytes per format: one line each, then the total.
void print_weight_bytes(char const* label, std::map<WeightFormat, std::int64_t> const& bytes, std::int64_t extra) {
  std::int64_t total = extra;
  std::string parts;
  for (auto const& [f, b] : bytes) {
    total += b;
    parts += (parts.empty() ? "" : ", ") + std::string(to_string(f)) + " " + human_bytes(static_cast<double>(b));
  }
  std::printf("%-18s%s total (%s)\n", label, human_bytes(static_cast<double>(total)).c_str(), parts.c_str());
}

int cmd_inspect(CommonOptions const& o, bool verbose) {
  bool const gguf = runtime::is_gguf_file(o.model_dir);
  auto cfg = gguf ? io::config_from_gguf(io::GgufFile(o.model_dir)) : io::load_config(o.model_dir);
  auto const scheme = runtime::parse_weight_scheme(o.weights);
  std::string pattern;
  int n_full = 0;
  for (auto k : cfg.layer_types) {
    pattern += k == io::LayerKind::kFullAttention ? 'F' : 'L';
    n_full += k == io::LayerKind::kFullAttention;
  }
  std::printf("model_type        %s\n", cfg.model_type.c_str());
  std::printf("layers            %d (%d full attention, %d Gated DeltaNet)\n", cfg.n_layer, n_full, cfg.n_layer - n_full);
  std::printf("layer pattern     %s  (F: full attention, L: linear attention)\n", pattern.c_str());
  std::printf("hidden            %d, vocab %d, max positions %d\n", cfg.d_model, cfg.vocab, cfg.max_position_embeddings);
  std::printf("attention         %d query heads, %d kv heads, head dim %d, rotary dim %d, theta %g%s\n", cfg.n_head,
              cfg.n_head_kv, cfg.d_head, cfg.rotary_dim, static_cast<double>(cfg.rope_theta),
              cfg.attn_output_gate ? ", output gate" : "");
  if (cfg.n_head_k_linear > 0)
    std::printf("gated deltanet    %d qk heads x %d, %d v heads x %d, conv %d\n", cfg.n_head_k_linear,
                cfg.d_head_k_linear, cfg.n_head_v_linear, cfg.d_head_v_linear, cfg.d_conv);
  std::printf("experts           %d routed, top-%d, ffn %d%s\n", cfg.n_expert, cfg.n_expert_used, cfg.d_ff_expert,
              cfg.d_ff_shared > 0 ? (", shared expert ffn " + std::to_string(cfg.d_ff_shared)).c_str() : "");
  double const total = static_cast<double>(cfg.n_params_total());
  double const active = static_cast<double>(cfg.n_params_active());
  std::printf("parameters        %s total, %s active per token (incl. lm_head)\n", human_count(total).c_str(),
              human_count(active).c_str());
  std::printf("weights           %s in bf16, %s in f32\n", human_bytes(total * 2).c_str(), human_bytes(total * 4).c_str());
  std::printf("kv cache          %lld bytes/token in bf16\n", static_cast<long long>(cfg.kv_bytes_per_token(DType::kBF16)));
  if (cfg.n_head_k_linear > 0)
    std::printf("deltanet state    %s per sequence in f32\n",
                human_bytes(static_cast<double>(cfg.linear_state_bytes_per_sequence(DType::kF32, DType::kF32))).c_str());
  std::string const label = "resident (" + std::string(runtime::to_string(scheme)) + ")";
  if (!gguf) {
    // From the config alone, which says the stored dtype (f32 when absent, as PyTorch's default).
    WeightFormat const stored = cfg.dtype == DType::kBF16 ? WeightFormat::kBf16
                                : cfg.dtype == DType::kF16 ? WeightFormat::kF16
                                                           : WeightFormat::kF32;
    auto const plan = runtime::plan_weights(cfg, scheme, stored);
    print_weight_bytes(label.c_str(), plan.bytes, plan.vector_bytes);
  }
  // A GGUF file's formats are per tensor: bind it (mapped, converted only if --weights asks).
  if (gguf || (verbose && io::Checkpoint::open(o.model_dir).has_weights())) {
    auto opts = load_options(o);
    opts.progress = false;
    auto m = runtime::load_model(o.model_dir, opts);
    if (verbose)
      m.weights.for_each_matrix([](std::string const& name, WeightView const& v) {
        std::printf("  %-40s %-9s [%lld, %lld] %s\n", name.c_str(), std::string(to_string(v.format)).c_str(),
                    static_cast<long long>(v.rows), static_cast<long long>(v.cols),
                    human_bytes(static_cast<double>(v.bytes())).c_str());
      });
    print_weight_bytes(gguf ? label.c_str() : "bound", m.bytes_per_format(), 0);
  }
  std::printf("spec              %s\n", to_string(cfg.spec(KvScheme::kBf16, WeightFormat::kAny)).c_str());
  return 0;
}

int cmd_run(CommonOptions const& o, std::string const& prompt, runtime::GenerateOptions gen) {
  int rc = 0;
  with_model(o, [&](auto& m) {
    auto tok = load_tokenizer(o.model_dir);
    auto ids = tok.encode(prompt);
    QFLASH_CHECK(!ids.empty(), "the prompt encodes to no tokens");
    if (gen.eos_ids.empty()) gen.eos_ids = m.config().eos_token_ids;
    std::fputs(prompt.c_str(), stdout);
    std::fflush(stdout);
    auto res = runtime::generate(m, tok, ids, gen, [](std::string_view t) {
      std::fwrite(t.data(), 1, t.size(), stdout);
      std::fflush(stdout);
    });
    std::fputs("\n", stdout);
    std::fflush(stdout);
    double const pf = res.prefill_seconds > 0 ? static_cast<double>(res.n_prompt) / res.prefill_seconds : 0;
    // The first generated token comes from the prefill; the rest from decode steps.
    double const n_decode = res.tokens.size() > 1 ? static_cast<double>(res.tokens.size() - 1) : 0;
    double const dc = res.decode_seconds > 0 ? n_decode / res.decode_seconds : 0;
    std::fprintf(stderr, "prompt: %lld tokens, %.1f tok/s | generation: %zu tokens, %.1f tok/s | finish: %s\n",
                 static_cast<long long>(res.n_prompt), pf, res.tokens.size(), dc,
                 std::string(runtime::to_string(res.finish)).c_str());
  });
  return rc;
}

int cmd_logits(CommonOptions const& o, std::string const& ids_text, std::string const& output, bool incremental) {
  auto ids = parse_ids(ids_text);
  with_model(o, [&](auto& m) {
    std::int64_t const vocab = m.config().vocab;
    auto state = m.new_sequence();
    std::vector<float> all, step;
    if (incremental) {
      for (auto id : ids) {
        model::SequenceChunk c{std::span(&id, 1), &state};
        m.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, step);
        all.insert(all.end(), step.begin(), step.end());
      }
    } else {
      model::SequenceChunk c{ids, &state};
      m.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, all);
    }
    io::write_npy_f32(output, all, {static_cast<std::int64_t>(ids.size()), vocab});
    std::fprintf(stderr, "wrote logits [%zu, %lld] to %s\n", ids.size(), static_cast<long long>(vocab), output.c_str());
  });
  return 0;
}

int cmd_perplexity(CommonOptions const& o, std::string const& text_path, int context) {
  std::ifstream f(text_path, std::ios::binary);
  QFLASH_CHECK(f.good(), text_path, ": cannot open");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  with_model(o, [&](auto& m) {
    auto tok = load_tokenizer(o.model_dir);
    auto ids = tok.encode(text);
    int const ctx = context > 0 ? context : std::min(m.config().max_position_embeddings, 512);
    bool const tty = ::isatty(2) != 0;
    auto r = runtime::perplexity(m, ids, ctx, [tty](std::size_t done, std::size_t total) {
      if (tty) std::fprintf(stderr, "\rperplexity: %zu/%zu tokens", done, total);
    });
    if (tty) std::fprintf(stderr, "\n");
    std::printf("perplexity %.4f over %lld predicted tokens (%lld windows of %d)\n", r.perplexity,
                static_cast<long long>(r.n_predicted), static_cast<long long>(r.n_windows), ctx);
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto logger = spdlog::stderr_color_mt("qflash");
  logger->set_pattern("%^%l%$: %v");
  logger->set_level(spdlog::level::warn);
  qflash::set_log_sink([logger](qflash::LogLevel l, std::string_view msg) {
    auto const level = l == qflash::LogLevel::kDebug  ? spdlog::level::debug
                       : l == qflash::LogLevel::kInfo ? spdlog::level::info
                       : l == qflash::LogLevel::kWarn ? spdlog::level::warn
                                                      : spdlog::level::err;
    logger->log(level, "{}", msg);
  });

  CLI::App app{"qflash: fast, memory-lean inference of sparse Mixture-of-Experts LLMs"};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "log progress details");

  CommonOptions common;
  std::string prompt = "Once upon a time";
  runtime::GenerateOptions gen;
  auto* run = app.add_subcommand("run", "generate text from a prompt, streaming it");
  add_common(run, common);
  run->add_option("-p,--prompt", prompt, "prompt text")->capture_default_str();
  run->add_option("-n,--max-tokens", gen.max_tokens, "tokens to generate at most")->check(CLI::NonNegativeNumber)->capture_default_str();
  run->add_option("--temperature", gen.sampling.temperature, "sampling temperature (0: greedy)")->capture_default_str();
  run->add_option("--top-k", gen.sampling.top_k, "keep the k most likely tokens (0: off)")->capture_default_str();
  run->add_option("--top-p", gen.sampling.top_p, "nucleus sampling mass (1: off)")->capture_default_str();
  run->add_option("--min-p", gen.sampling.min_p, "drop tokens below min-p x the top probability (0: off)")->capture_default_str();
  run->add_option("--repetition-penalty", gen.sampling.repetition_penalty, "penalty for tokens already seen (1: off)")->capture_default_str();
  run->add_option("--seed", gen.sampling.seed, "random seed")->capture_default_str();
  run->add_option("--stop", gen.stop, "stop string (repeatable)");

  auto* inspect = app.add_subcommand("inspect", "print the architecture, sizes and memory needs of a model (config.json is enough)");
  add_common(inspect, common);

  std::string ids_text, output;
  bool incremental = false;
  auto* logits = app.add_subcommand("logits", "write the logits of a token sequence as a float32 .npy [n_tokens, vocab]");
  add_common(logits, common);
  logits->add_option("--prompt-ids", ids_text, "comma-separated token ids, e.g. 1,2,3")->required();
  logits->add_option("-o,--output", output, "output .npy file")->required();
  logits->add_flag("--incremental", incremental, "one token at a time through the caches instead of one full forward");

  std::string text_path;
  int context = 0;
  auto* ppl = app.add_subcommand("perplexity", "perplexity of a text file, in independent windows");
  add_common(ppl, common);
  ppl->add_option("--text", text_path, "UTF-8 text file")->required()->check(CLI::ExistingFile);
  ppl->add_option("-c,--context", context, "window length in tokens (0: min(512, max positions))")->check(CLI::NonNegativeNumber);

  CLI11_PARSE(app, argc, argv);
  if (verbose) logger->set_level(spdlog::level::debug);

  try {
    if (*run) return cmd_run(common, prompt, gen);
    if (*inspect) return cmd_inspect(common, verbose);
    if (*logits) return cmd_logits(common, ids_text, output, incremental);
    if (*ppl) return cmd_perplexity(common, text_path, context);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "qflash: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
