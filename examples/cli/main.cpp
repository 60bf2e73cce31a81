// The qflash command-line program: a thin layer that parses flags and calls the library.
// Flags are validated before a model is loaded, so a typo never costs a load.
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "args.hpp"
#include "bench.hpp"
#include "chat.hpp"
#include "device.hpp"
#include "engine.hpp"
#include "flash_config.hpp"
#include "budget.hpp"
#include "kv_option.hpp"
#include "lora_option.hpp"
#include "route_stats.hpp"
#include "sampling_option.hpp"
#include "serve.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/io/gguf_config.hpp"
#include "qflash/io/hf_config.hpp"
#include "qflash/io/npy.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/io/kv_map.hpp"
#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/kv_calibration.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/perplexity.hpp"
#include "qflash/runtime/weight_plan.hpp"
#include "qflash/runtime/with_model.hpp"

#ifndef QFLASH_VERSION
#define QFLASH_VERSION "unknown"
#endif
#ifndef QFLASH_SOURCE_DIR
#define QFLASH_SOURCE_DIR "."
#endif

namespace {

using namespace qflash;
using cli::human_bytes;
using cli::UsageError;

struct CommonOptions {
  std::string model_dir = QFLASH_DEFAULT_MODEL_DIR;
  std::string weights = "auto";
  std::string device = "cpu";
  int threads = 0;
  bool no_verify = false;
  cli::KvOptions kv;
  std::string routing;  ///< --routing text; empty: the model's top-k
  cli::LoraOptions lora;
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
  cmd->add_option("--device", o.device,
                  std::string("where the model runs: cpu, or cuda[:N] (CUDA device N, default 0) for run, logits, "
                              "perplexity, calibrate, route-stats, bench, chat and serve; this build: ") +
                      (QFLASH_CLI_CUDA ? "cpu and cuda" : "cpu only"))
      ->check(cli::device_validator())
      ->capture_default_str();
  cmd->add_option("-t,--threads", o.threads,
                  "CPU threads (0: one per physical core, or QFLASH_NUM_THREADS; more than the CPUs "
                  "available is reduced to them)")
      ->check(cli::integer_in(0));
  cmd->add_flag("--no-verify", o.no_verify, "skip checking the files against the model's SHA256SUMS");
}

/// `--routing` on the commands that run the model.
void add_routing_option(CLI::App* cmd, CommonOptions& o) {
  cmd->add_option("--routing", o.routing,
                  "experts per token: top_k (the model's, default), top_k=K, top_p=P[,k_min=A][,k_max=B] (per token "
                  "the fewest experts whose probability reaches P), threshold=T[,k_min=A][,k_max=B] (those with "
                  "probability >= T); k_max defaults to the model's top-k");
}

/// The parsed --routing (top-k when not given); throws UsageError naming the flag.
model::Routing parse_routing_option(std::string const& text) {
  if (text.empty()) return {};
  try {
    return model::parse_routing(text);
  } catch (Error const& e) {
    throw UsageError(std::string("--routing: ") + e.what());
  }
}

/// Sizes the thread pool from -t: a request above the CPUs this process may use is reduced to
/// them (more threads than CPUs only take turns on them).
void apply_threads(int requested) {
  int const cpus = available_cpus();
  int n = requested > 0 ? requested : default_threads();
  if (n > cpus) {
    QFLASH_LOG_WARN(requested > 0 ? "-t " : "the default of ", n, requested > 0 ? "" : " threads",
                    " is more than the ", cpus, " CPUs this process may use; using ", cpus, " threads");
    n = cpus;
  }
  set_max_threads(n);
  QFLASH_LOG_INFO("threads: ", n, " (", physical_cores(), " physical cores, ", cpus, " CPUs available)");
}

runtime::LoadOptions load_options(CommonOptions const& o) {
  runtime::LoadOptions m;
  m.weights = runtime::parse_weight_scheme(o.weights);
  m.verify_checksums = !o.no_verify;
  m.model.routing = parse_routing_option(o.routing);
  return m;
}

model::ModelConfig peek_config(CommonOptions const& o) { return cli::peek_config(o.model_dir); }

/// Throws UsageError unless `tokens` (the value of `flag`) fits the model's positions.
void check_context(std::string const& flag, int tokens, model::ModelConfig const& cfg) {
  if (tokens > cfg.max_position_embeddings)
    throw UsageError(flag + " " + std::to_string(tokens) + " is above the model's limit of " +
                     std::to_string(cfg.max_position_embeddings) + " tokens (max_position_embeddings)");
}

/// Throws unless the model has weights to run: a directory with only a config.json can be
/// inspected, not run (checked before the tokenizer, whose absence would say less).
void require_weights(std::string const& model) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (runtime::is_gguf_file(model)) return;
  QFLASH_CHECK(fs::exists(fs::path(model) / io::Checkpoint::kSingleFile, ec) ||
                   fs::exists(fs::path(model) / io::Checkpoint::kIndexFile, ec),
               model, ": no weights (", io::Checkpoint::kSingleFile, " or ", io::Checkpoint::kIndexFile,
               ") found; 'qflash inspect' works on a config alone");
}

/// Throws UsageError, before anything loads, when --device names a CUDA device that this build
/// cannot use.
void check_device(CommonOptions const& o) {
  if (cli::cuda_device(o.device)) cli::check_cuda_build(o.device);
}

/// Loads the model (whose config `cfg` is) as the compiled spec that fits it, on the device
/// --device names, and calls fn(model).
template <class Fn>
void with_model(CommonOptions const& o, model::ModelConfig const& cfg, Fn&& fn) {
  std::optional<int> const device = cli::cuda_device(o.device);
  cli::check_device_usable(device);  // said before loading
  apply_threads(o.threads);
  auto opts = load_options(o);
  opts.config = cfg;
  auto m = runtime::load_model(o.model_dir, opts);
  opts.model.lora = cli::apply_loras(o.lora, m);
  cli::with_model_on(device, std::move(m), opts.model, std::forward<Fn>(fn));
}

/// The model's tokenizer (tokenizer.json beside the weights, or a GGUF file's tokenizer.ggml.*),
/// checked against the model's vocabulary.
io::Tokenizer load_tokenizer(std::string const& model, model::ModelConfig const& cfg) {
  auto tok = runtime::is_gguf_file(model) ? io::Tokenizer::from_gguf(io::GgufFile(model))
                                          : io::Tokenizer::from_file(model + "/tokenizer.json");
  runtime::check_tokenizer_fits(tok, cfg);
  return tok;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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

/// Every value of every matrix decoded once: names the first tensor that holds a NaN or Inf
/// (the loader already checks vectors, and matrices it converts).
void scan_weights(model::ModelWeights const& w) {
  std::uint64_t total = 0;
  w.for_each_matrix([&](std::string const&, WeightView const& v) { total += static_cast<std::uint64_t>(v.bytes()); });
  io::Progress progress("checking weights", total);
  w.for_each_matrix([&](std::string const& name, WeightView const& v) {
    std::atomic<std::int64_t> bad{-1};
    parallel_for(0, v.rows, v.cols * 4, [&](std::int64_t r) {
      thread_local std::vector<float> row;
      row.resize(static_cast<std::size_t>(v.cols));
      dequantize_row(v, r, row.data());
      if (!all_finite(row)) bad.store(r);
    });
    QFLASH_CHECK(bad.load() < 0, "tensor '", name, "': row ", bad.load(), " holds a non-finite value (NaN or Inf)");
    progress.advance(static_cast<std::uint64_t>(v.bytes()));
  });
  progress.finish();
  std::printf("weights checked   every value finite\n");
}

int cmd_inspect(CommonOptions const& o, bool verbose, bool check_weights) {
  bool const gguf = runtime::is_gguf_file(o.model_dir);
  auto const cfg = peek_config(o);
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
    // From the config alone (runtime::stored_format).
    auto const plan = runtime::plan_weights(cfg, scheme, runtime::stored_format(cfg));
    print_weight_bytes(label.c_str(), plan.bytes, plan.vector_bytes);
  }
  // A GGUF file's formats are per tensor: bind it (mapped, converted only if --weights asks).
  if (gguf || ((verbose || check_weights) && io::Checkpoint::open(o.model_dir).has_weights())) {
    apply_threads(o.threads);
    auto opts = load_options(o);
    opts.config = cfg;
    opts.progress = false;
    auto m = runtime::load_model(o.model_dir, opts);
    if (check_weights) scan_weights(m.weights);
    if (verbose)
      m.weights.for_each_matrix([](std::string const& name, WeightView const& v) {
        std::printf("  %-40s %-9s [%lld, %lld] %s\n", name.c_str(), std::string(to_string(v.format)).c_str(),
                    static_cast<long long>(v.rows), static_cast<long long>(v.cols),
                    human_bytes(static_cast<double>(v.bytes())).c_str());
      });
    print_weight_bytes(gguf ? label.c_str() : "bound", m.bytes_per_format(), 0);
  }
  else if (check_weights)
    throw UsageError("--check-weights: '" + o.model_dir + "' has no weights to check");
  std::printf("spec              %s\n", to_string(cfg.spec(KvScheme::kBf16, WeightFormat::kAny)).c_str());
  return cli::kExitOk;
}

int cmd_run(CommonOptions const& o, std::string const& prompt, runtime::GenerateOptions gen,
            cli::SamplingOptions const& sampling, bool ignore_eos) {
  auto const cfg = peek_config(o);
  gen.sampling = cli::resolve_sampling(sampling, cfg);
  if (!ignore_eos) gen.eos_ids.assign(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end());
  check_context("-c/--ctx-size", gen.max_context, cfg);
  require_weights(o.model_dir);
  auto tok = load_tokenizer(o.model_dir, cfg);
  auto ids = tok.encode(prompt);
  QFLASH_CHECK(!ids.empty(), "the prompt encodes to no tokens");
  int const context = gen.max_context > 0 ? gen.max_context : cfg.max_position_embeddings;
  QFLASH_CHECK(static_cast<int>(ids.size()) < context, "the prompt has ", ids.size(),
               " tokens, which leaves no room to generate in a context of ", context, " tokens (-c/--ctx-size)");
  gen.kv = cli::resolve_kv(o.kv, cfg, o.model_dir);
  with_model(o, cfg, [&](auto& m) {
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
  return cli::kExitOk;
}

/// `qflash chat`: the batch engine with one sequence, the model's chat template, the terminal.
int cmd_chat(CommonOptions const& o, cli::SamplingOptions const& sampling_flags, cli::ChatOptions const& c) {
  std::optional<int> const device = cli::cuda_device(o.device);
  cli::check_device_usable(device);  // said before anything loads
  auto const cfg = peek_config(o);
  auto const sampling = cli::resolve_sampling(sampling_flags, cfg);
  require_weights(o.model_dir);
  auto tok = load_tokenizer(o.model_dir, cfg);
  auto const chat_template = cli::load_chat_template(o.model_dir, tok, cfg);
  QFLASH_CHECK(chat_template, o.model_dir, ": the model has no chat template (chat_template.jinja, tokenizer_config.json's "
               "chat_template or a GGUF file's tokenizer.chat_template); 'qflash run' generates from plain text");
  if (c.context > 0) check_context("--context", c.context, cfg);
  runtime::EngineOptions eo;
  eo.max_num_seqs = 1;
  eo.max_context = c.context;
  eo.kv = cli::resolve_kv(o.kv, cfg, o.model_dir);
  eo.routing = parse_routing_option(o.routing);
  apply_threads(o.threads);
  auto opts = load_options(o);
  opts.config = cfg;
  auto m = runtime::load_model(o.model_dir, opts);
  if (auto adapter = cli::apply_loras(o.lora, m)) {
    eo.default_lora = adapter->name;
    eo.adapters.push_back(std::move(adapter));
  }
  auto engine = cli::make_engine_on(device, std::move(m), std::move(tok), eo, cli::model_name_of(o.model_dir));
  return cli::run_chat(*engine, *chat_template, sampling, c, std::cin);
}

int cmd_logits(CommonOptions const& o, std::vector<std::int32_t> const& ids, std::string const& output,
               bool incremental) {
  auto const cfg = peek_config(o);
  if (static_cast<std::int64_t>(ids.size()) > cfg.max_position_embeddings)
    throw UsageError("--prompt-ids: " + std::to_string(ids.size()) + " ids are more than the model's " +
                     std::to_string(cfg.max_position_embeddings) + " positions (max_position_embeddings)");
  for (auto id : ids)
    if (id >= cfg.vocab)
      throw UsageError("--prompt-ids: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(cfg.vocab) + ")");
  with_model(o, cfg, [&](auto& m) {
    std::int64_t const vocab = m.config().vocab;
    auto const t0 = std::chrono::steady_clock::now();
    auto state = m.new_sequence(cli::resolve_kv(o.kv, cfg, o.model_dir));
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
    double const secs = seconds_since(t0);
    io::write_npy_f32(output, all, {static_cast<std::int64_t>(ids.size()), vocab});
    std::fprintf(stderr, "wrote logits [%zu, %lld] to %s\n", ids.size(), static_cast<long long>(vocab),
                 printable(output).c_str());
    std::fprintf(stderr, "logits: %zu tokens in %.3f s, %.1f tok/s\n", ids.size(), secs,
                 secs > 0 ? static_cast<double>(ids.size()) / secs : 0.0);
  });
  return cli::kExitOk;
}

struct CalibrateOptions {
  std::string text;
  double budget = 0.45;
  std::string output;
  int context = 256;
  long long max_tokens = 4096;
  std::vector<std::string> formats{"bf16", "fp8_e4m3", "int8", "int6"};
};

/// `qflash calibrate`: each KV head's sensitivity on a text, and the map under a byte budget.
int cmd_calibrate(CommonOptions const& o, CalibrateOptions const& c) {
  auto const cfg = peek_config(o);
  QFLASH_CHECK(cfg.n_layer_of(model::LayerKind::kFullAttention) > 0, o.model_dir,
               ": the model has no full-attention layer, so no KV to calibrate");
  check_context("-c/--context", c.context, cfg);
  std::vector<KvFormat> formats;
  for (auto const& name : c.formats) {
    try {
      formats.push_back(parse_kv_format(name));
    } catch (Error const& e) {
      throw UsageError(std::string("--formats: ") + e.what());
    }
  }
  require_weights(o.model_dir);
  std::string const output = !c.output.empty() ? c.output
                             : runtime::is_gguf_file(o.model_dir)
                                 ? o.model_dir + "." + io::kKvMapFile
                                 : (std::filesystem::path(o.model_dir) / io::kKvMapFile).string();
  std::string const text = cli::read_text(c.text, "--text");
  auto tok = load_tokenizer(o.model_dir, cfg);
  auto ids = tok.encode(text);
  QFLASH_CHECK(ids.size() >= 2, c.text, ": encodes to ", ids.size(), " tokens; calibration needs at least 2");
  if (static_cast<long long>(ids.size()) > c.max_tokens) ids.resize(static_cast<std::size_t>(c.max_tokens));
  with_model(o, cfg, [&](auto& m) {
    bool const tty = ::isatty(2) != 0;
    auto const t0 = std::chrono::steady_clock::now();
    auto const sens = runtime::measure_kv_sensitivity(m, ids, c.context, formats, [&](std::int64_t done, std::int64_t total) {
      if (!tty) return;
      double const secs = seconds_since(t0);
      std::fprintf(stderr, "\rcalibrate: %lld/%lld forwards, %.0f s left   ", static_cast<long long>(done),
                   static_cast<long long>(total), secs / static_cast<double>(done) * static_cast<double>(total - done));
    });
    if (tty) std::fprintf(stderr, "\n");
    auto const choice = runtime::choose_kv_map(cfg, sens, c.budget);
    std::printf("KV sensitivity: mean KL vs f32 KV (nats/token) over %lld tokens of %s, one unit in each format\n",
                static_cast<long long>(sens.tokens), printable(c.text).c_str());
    std::printf("| layer | head | K/V |");
    for (KvFormat f : sens.formats) std::printf(" %s |", std::string(to_string(f)).c_str());
    std::printf(" chosen |\n|---:|---:|---|");
    for (std::size_t f = 0; f < sens.formats.size(); ++f) std::printf("---:|");
    std::printf("---|\n");
    io::Json units = io::Json::array();
    for (std::size_t u = 0; u < sens.units.size(); ++u) {
      runtime::KvUnit const& unit = sens.units[u];
      kv::KvFormats const chosen = choice.map.layer(unit.layer)[static_cast<std::size_t>(unit.head)];
      KvFormat const pick = unit.value ? chosen.v : chosen.k;
      std::printf("| %zu | %d | %s |", unit.layer, unit.head, unit.value ? "V" : "K");
      io::Json kl = io::Json::object();
      for (std::size_t f = 0; f < sens.formats.size(); ++f) {
        std::printf(" %.3g |", sens.kl[u][f]);
        kl[std::string(to_string(sens.formats[f]))] = sens.kl[u][f];
      }
      std::printf(" %s |\n", std::string(to_string(pick)).c_str());
      units.push_back({{"layer", unit.layer}, {"head", unit.head}, {"kv", unit.value ? "v" : "k"}, {"kl", kl}});
    }
    double const ratio = static_cast<double>(choice.bytes_per_token) / static_cast<double>(choice.bf16_bytes_per_token);
    io::Json const calibration = {{"text", c.text},
                                  {"tokens", sens.tokens},
                                  {"context", c.context},
                                  {"budget", c.budget},
                                  {"bytes_per_token", choice.bytes_per_token},
                                  {"bytes_vs_bf16", ratio},
                                  {"predicted_kl", choice.predicted_kl},
                                  {"units", units}};
    io::write_kv_map(output, choice.map, cfg, calibration);
    std::printf("wrote %s: %lld KV bytes/token, %.3f x bf16 (budget %.3g), predicted KL %.3g nats/token\n",
                printable(output).c_str(), static_cast<long long>(choice.bytes_per_token), ratio, c.budget,
                choice.predicted_kl);
    std::fprintf(stderr, "calibrate: %.1f s\n", seconds_since(t0));
  });
  return cli::kExitOk;
}

int cmd_perplexity(CommonOptions const& o, std::string const& text_path, int context, std::string const& kl_base) {
  auto const cfg = peek_config(o);
  check_context("-c/--context", context, cfg);
  require_weights(o.model_dir);
  std::string const text = cli::read_text(text_path, "--text");
  auto tok = load_tokenizer(o.model_dir, cfg);
  auto ids = tok.encode(text);
  QFLASH_CHECK(ids.size() >= 2, text_path, ": encodes to ", ids.size(), " tokens; perplexity needs at least 2");
  int const ctx = context > 0 ? context : std::min(cfg.max_position_embeddings, 512);
  with_model(o, cfg, [&](auto& m) {
    bool const tty = ::isatty(2) != 0;
    auto const t0 = std::chrono::steady_clock::now();
    std::optional<kv::KvMap> base;
    if (!kl_base.empty()) base = kv::KvMap::uniform(cfg, cli::parse_kv_option(kl_base, "--kl-base"));
    auto r = runtime::perplexity(m, ids, ctx, cli::resolve_kv(o.kv, cfg, o.model_dir),
                                 [tty](std::size_t done, std::size_t total) {
      if (tty) std::fprintf(stderr, "\rperplexity: %zu/%zu tokens", done, total);
    }, base ? &*base : nullptr);
    double const secs = seconds_since(t0);
    if (tty) std::fprintf(stderr, "\n");
    std::printf("perplexity %.4f over %lld predicted tokens (%lld windows of %d)\n", r.perplexity,
                static_cast<long long>(r.n_predicted), static_cast<long long>(r.n_windows), ctx);
    if (base) std::printf("mean KL %.4e nats/token from --kv %s\n", r.mean_kl, kl_base.c_str());
    std::fprintf(stderr, "perplexity: %zu tokens in %.3f s, %.1f tok/s\n", ids.size(), secs,
                 secs > 0 ? static_cast<double>(ids.size()) / secs : 0.0);
  });
  return cli::kExitOk;
}

/// `qflash route-stats`: routing statistics and each policy's quality and expert compute.
int cmd_route_stats(CommonOptions const& o, cli::RouteStatsOptions const& r) {
  auto const cfg = peek_config(o);
  check_context("-c/--context", r.context, cfg);
  auto const policies = cli::route_stats_policies(r);
  for (auto const& p : policies) {
    try {
      model::check_routing(p, cfg.n_expert, cfg.n_expert_used);
    } catch (Error const& e) {
      throw UsageError(std::string("--routing: ") + e.what());
    }
  }
  require_weights(o.model_dir);
  std::string const text = cli::read_text(r.text, "--text");
  auto tok = load_tokenizer(o.model_dir, cfg);
  auto ids = tok.encode(text);
  QFLASH_CHECK(ids.size() >= 2, r.text, ": encodes to ", ids.size(), " tokens; route-stats needs at least 2");
  if (static_cast<long long>(ids.size()) > r.max_tokens) ids.resize(static_cast<std::size_t>(r.max_tokens));
  with_model(o, cfg, [&](auto& m) {
    bool const tty = ::isatty(2) != 0;
    auto const t0 = std::chrono::steady_clock::now();
    auto const stats = runtime::measure_routing(m, ids, r.context, policies, [&](std::size_t done, std::size_t total) {
      if (tty) std::fprintf(stderr, "\rroute-stats: %zu/%zu tokens x %zu policies", done, total, policies.size());
    });
    if (tty) std::fprintf(stderr, "\n");
    std::printf("Routing on %lld tokens of %s (windows of %d), %d experts, top-%d\n\n",
                static_cast<long long>(ids.size()), printable(r.text).c_str(), r.context, cfg.n_expert,
                cfg.n_expert_used);
    cli::print_route_stats(stats, cfg);
    cli::write_route_stats_outputs(
        r, cli::route_stats_json(stats, cfg, o.model_dir, r.text, static_cast<std::int64_t>(ids.size()), r.context));
    std::fprintf(stderr, "route-stats: %.1f s\n", seconds_since(t0));
  });
  return cli::kExitOk;
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
  app.fallthrough();  // -v and --help also work after the command
  app.set_version_flag("--version", "qflash " QFLASH_VERSION);
  app.footer("Exit status: 0 success, 1 the model could not be loaded or run, 2 invalid command line.");
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "log progress details (threads, seed, defaults applied)");

  CommonOptions common;
  std::string prompt = "Once upon a time", prompt_file;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  runtime::GenerateOptions gen;
  auto* run = app.add_subcommand("run", "generate text from a prompt, streaming it");
  add_common(run, common);
  auto* p_opt = run->add_option("-p,--prompt", prompt, "prompt text ('-': read standard input)")->capture_default_str();
  run->add_option("-f,--file", prompt_file, "read the prompt from a file")->excludes(p_opt);
  run->add_option("-n,--max-tokens,--n-predict", gen.max_tokens, "tokens to generate at most (-1: until eos or the context is full)")
      ->check(cli::integer_in(-1))
      ->capture_default_str();
  run->add_option("-c,--ctx-size", gen.max_context, "prompt + generated tokens at most (0: the model's max positions)")
      ->check(cli::integer_in(0));
  cli::SamplingOptions sampling;
  cli::add_sampling_options(run, sampling);
  run->add_option("--stop", stop, "stop string, with \\n-style escapes (repeatable)");
  run->add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-sequence tokens");
  cli::add_kv_options(run, common.kv);
  add_routing_option(run, common);
  cli::add_lora_options(run, common.lora, false);

  bool check_weights = false;
  auto* inspect = app.add_subcommand("inspect", "print the architecture, sizes and memory needs of a model (config.json is enough)");
  add_common(inspect, common);
  inspect->add_flag("--check-weights", check_weights, "decode every weight once and name any tensor holding NaN or Inf");

  std::string ids_text, output;
  bool incremental = false;
  auto* logits = app.add_subcommand("logits", "write the logits of a token sequence as a float32 .npy [n_tokens, vocab]");
  add_common(logits, common);
  logits->add_option("--prompt-ids", ids_text, "comma-separated token ids, e.g. 1,2,3")->required();
  logits->add_option("-o,--output", output, "output .npy file")->required();
  logits->add_flag("--incremental", incremental, "one token at a time through the caches instead of one full forward");
  cli::add_kv_options(logits, common.kv);
  add_routing_option(logits, common);
  cli::add_lora_options(logits, common.lora, false);

  std::string text_path;
  int context = 0;
  auto* ppl = app.add_subcommand("perplexity", "perplexity of a text file, in independent windows");
  add_common(ppl, common);
  ppl->add_option("--text", text_path, "UTF-8 text file ('-': standard input)")->required();
  ppl->add_option("-c,--context,--ctx-size", context, "window length in tokens (0: min(512, max positions))")
      ->check(cli::integer_in(0));
  cli::add_kv_options(ppl, common.kv);
  add_routing_option(ppl, common);
  cli::add_lora_options(ppl, common.lora, false);
  std::string kl_base;
  ppl->add_option("--kl-base", kl_base,
                  "also print the mean KL divergence of the next-token distributions from those with KV stored in "
                  "this format (e.g. bf16); every window runs twice");

  CalibrateOptions cal;
  auto* calibrate = app.add_subcommand(
      "calibrate", std::string("measure each KV head's sensitivity on a text and write the per-head formats that fit a "
                               "byte budget (") + io::kKvMapFile + ")");
  add_common(calibrate, common);
  calibrate->add_option("--text", cal.text, "UTF-8 calibration text ('-': standard input)")->required();
  calibrate->add_option("--budget", cal.budget, "KV bytes to reach, relative to bf16 KV (e.g. 0.45)")
      ->check(cli::number_in(0, 1, /*lo_open=*/true))
      ->capture_default_str();
  calibrate->add_option("-o,--output", cal.output,
                        std::string("where to write the map (default: ") + io::kKvMapFile +
                            " in the model directory, which run, logits, perplexity and bench then use)");
  calibrate->add_option("-c,--context", cal.context, "window length in tokens")
      ->check(cli::integer_in(2))
      ->capture_default_str();
  calibrate->add_option("--max-tokens", cal.max_tokens, "calibration tokens at most (the text's first ones)")
      ->check(cli::integer_in(2))
      ->capture_default_str();
  calibrate->add_option("--formats", cal.formats, "candidate formats; each unit starts in the largest")
      ->delimiter(',')
      ->capture_default_str();
  calibrate->footer(
      "A unit is one (layer, KV head, K or V). Its sensitivity to a format is the mean KL divergence of the next-token "
      "distributions with only that unit in the format (all other KV f32) from those with all KV f32, over windows of "
      "--context tokens. Starting from every unit in the largest format, the unit whose next smaller format adds the "
      "least KL per byte saved takes it, until the KV bytes are within the budget. Costs one forward per window and "
      "per (unit, format).");

  cli::RouteStatsOptions route_stats_opts;
  route_stats_opts.tools_dir = QFLASH_SOURCE_DIR "/tools";
  auto* route_stats = app.add_subcommand(
      "route-stats", "router entropy, expert load and experts per token on a text, and each routing policy's "
                     "perplexity, KL from top-k and expert compute");
  add_common(route_stats, common);
  cli::add_route_stats_options(route_stats, route_stats_opts);

  cli::BenchOptions bench_opts;
  bench_opts.model = QFLASH_DEFAULT_MODEL_DIR;
  bench_opts.tools_dir = QFLASH_SOURCE_DIR "/tools";
  auto* bench = app.add_subcommand("bench", "prefill and decode tok/s like llama-bench, with the decode roofline "
                                            "(bytes per token, read bandwidth measured in the same run)");
  cli::add_bench_options(bench, bench_opts);
  cli::ServeOptions serve_opts;
  auto* serve = app.add_subcommand("serve", "serve the model over HTTP: the OpenAI API (/v1/completions, "
                                            "/v1/chat/completions, /v1/models), /generate, /health, /metrics");
  add_common(serve, common);
  cli::add_kv_options(serve, common.kv);
  add_routing_option(serve, common);
  cli::add_lora_options(serve, common.lora, true);
  cli::add_serve_options(serve, serve_opts);

  cli::ChatOptions chat_opts;
  cli::SamplingOptions chat_sampling;
  auto* chat = app.add_subcommand("chat", "talk with the model on the terminal through its chat template "
                                          "(/reset starts over, /exit quits)");
  add_common(chat, common);
  cli::add_kv_options(chat, common.kv);
  add_routing_option(chat, common);
  cli::add_lora_options(chat, common.lora, false);
  cli::add_sampling_options(chat, chat_sampling);
  chat->add_option("--system", chat_opts.system, "a system message that starts the conversation");
  chat->add_option("-n,--max-tokens", chat_opts.max_tokens, "tokens per answer at most")
      ->check(cli::integer_in(1))
      ->capture_default_str();
  chat->add_option("-c,--context", chat_opts.context,
                   "tokens the conversation holds at most, answers included (default: the model's); the oldest "
                   "turns are dropped to keep room for an answer")
      ->check(cli::integer_in(2));

  cli::BudgetOptions budget_opts;
  auto* budget = app.add_subcommand("budget", "plan memory: weights, KV per context, DeltaNet state per sequence, "
                                              "scratch, and how many sequences fit (config.json is enough)");
  cli::add_budget_options(budget, budget_opts);

  std::string const usage_hint = "Run 'qflash --help' (or 'qflash COMMAND --help') for the options.";
  try {
    std::span<char* const> const args(argv, static_cast<std::size_t>(argc));
    cli::refuse_foreign_flags(args);
    if (auto c = cli::command_of(args); !c.empty()) {
      std::string names;
      bool known = false;
      for (CLI::App const* sub : app.get_subcommands([](CLI::App*) { return true; })) {
        names += (names.empty() ? "" : ", ") + sub->get_name();
        known = known || sub->get_name() == c;
      }
      if (!known) throw UsageError("unknown command '" + printable(c) + "' (commands: " + names + ")");
    }
    try {
      app.parse(argc, argv);
    } catch (CLI::Success const& e) {
      return app.exit(e);  // --help, --version
    } catch (CLI::ParseError const& e) {
      throw UsageError(printable(e.what()));
    }
    if (verbose) logger->set_level(spdlog::level::debug);

    // Everything the command line alone decides, checked before any model is read.
    if (*run) {
      if (!prompt_file.empty()) prompt = cli::read_text(prompt_file, "-f/--file");
      else if (prompt == "-") prompt = cli::read_text("-", "-p");
      else cli::require_utf8(prompt, "-p: the prompt");
      if (prompt.empty()) throw UsageError("the prompt is empty");
      for (auto& s : stop) gen.stop.push_back(cli::unescape(s, "--stop"));
      if (gen.max_tokens < 0) gen.max_tokens = std::numeric_limits<int>::max();
    }
    std::vector<std::int32_t> ids;
    if (*logits) {
      ids = cli::parse_ids(ids_text);
      auto const dir = std::filesystem::path(output).parent_path();
      std::error_code ec;
      if (!dir.empty() && !std::filesystem::is_directory(dir, ec))
        throw UsageError("-o/--output: directory '" + printable(dir.string()) + "' does not exist");
    }
    if (*ppl && text_path != "-" && !std::filesystem::is_regular_file(text_path))
      throw UsageError("--text: '" + printable(text_path) + "' is not a file");
    if (*route_stats && route_stats_opts.text != "-" && !std::filesystem::is_regular_file(route_stats_opts.text))
      throw UsageError("--text: '" + printable(route_stats_opts.text) + "' is not a file");
    if (*route_stats) (void)cli::route_stats_policies(route_stats_opts);
    if (*calibrate && cal.text != "-" && !std::filesystem::is_regular_file(cal.text))
      throw UsageError("--text: '" + printable(cal.text) + "' is not a file");
    if (*calibrate && !cal.output.empty()) {
      auto const dir = std::filesystem::path(cal.output).parent_path();
      std::error_code ec;
      if (!dir.empty() && !std::filesystem::is_directory(dir, ec))
        throw UsageError("-o/--output: directory '" + printable(dir.string()) + "' does not exist");
    }

    if (*run || *logits || *ppl || *serve || *chat) cli::check_kv_options(common.kv);
    if (!kl_base.empty()) (void)cli::parse_kv_option(kl_base, "--kl-base");
    (void)parse_routing_option(common.routing);
    cli::check_lora_options(common.lora);
    for (auto* cmd : {run, logits, ppl, route_stats, calibrate, serve, chat})
      if (*cmd) check_device(common);
    if (*serve) {
      if (!verbose) logger->set_level(spdlog::level::info);  // one line per request
      cli::check_serve_options(serve_opts);
      cli::apply_flash_config(serve_opts.flash_config, common.model_dir, *serve, serve_opts, common.kv);
      if (serve_opts.engine.gpu_memory_utilization > 0 && !cli::cuda_device(common.device))
        throw UsageError("--gpu-memory-utilization (or flash_config.json's gpu_memory_utilization) applies to a "
                         "model on a GPU: add --device cuda[:N], or give --kv-cache-memory");
    }

    if (*run) return cmd_run(common, prompt, gen, sampling, ignore_eos);
    if (*inspect) return cmd_inspect(common, verbose, check_weights);
    if (*logits) return cmd_logits(common, ids, output, incremental);
    if (*ppl) return cmd_perplexity(common, text_path, context, kl_base);
    if (*route_stats) return cmd_route_stats(common, route_stats_opts);
    if (*calibrate) return cmd_calibrate(common, cal);
    if (*bench) return cli::cmd_bench(bench_opts);
    if (*budget) return cli::cmd_budget(budget_opts);
    if (*chat) return cmd_chat(common, chat_sampling, chat_opts);
    if (*serve) {
      auto const cfg = peek_config(common);
      require_weights(common.model_dir);
      std::optional<int> const device = cli::cuda_device(common.device);
      cli::check_device_usable(device);  // said before the port is bound
      return cli::cmd_serve(serve_opts, common.model_dir, cfg, [&] {
        auto tok = load_tokenizer(common.model_dir, cfg);
        auto kv = cli::resolve_kv(common.kv, cfg, common.model_dir);
        apply_threads(common.threads);
        auto opts = load_options(common);
        opts.config = cfg;
        auto m = runtime::load_model(common.model_dir, opts);
        auto adapters = cli::load_loras(common.lora, m);
        return cli::ServedModel{device,          std::move(m),       std::move(tok),
                                std::move(kv),   opts.model.routing, std::move(adapters)};
      });
    }
  } catch (UsageError const& e) {
    std::fprintf(stderr, "qflash: error: %s\n%s\n", printable(e.what()).c_str(), usage_hint.c_str());
    return cli::kExitUsageError;
  } catch (std::bad_alloc const&) {
    std::fprintf(stderr, "qflash: error: out of memory\n");
    return cli::kExitRuntimeError;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "qflash: error: %s\n", printable(e.what()).c_str());
    return cli::kExitRuntimeError;
  }
  return cli::kExitOk;
}
