// `qflash bench`: prefill and decode speed like llama-bench (tests pp<P> and tg<N>, mean ±
// stddev of tok/s over repetitions), with the decode roofline beside it: the weight bytes a
// decoded token reads, the read bandwidth measured in the same run with the same threads, and
// the fraction of bandwidth / bytes that decode reaches. Benches a model from disk or a
// synthetic preset built in memory with the real shapes (runtime/synthetic.hpp).
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "args.hpp"
#include "device.hpp"
#include "kv_option.hpp"
#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/log.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/io/gguf_config.hpp"
#include "qflash/io/hf_config.hpp"
#include "qflash/runtime/bandwidth.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/roofline.hpp"
#include "qflash/runtime/synthetic.hpp"
#include "qflash/runtime/weight_plan.hpp"
#if QFLASH_CLI_CUDA
#include "qflash/runtime/cuda/bandwidth.hpp"
#endif

extern char** environ;

namespace qflash::cli {

struct BenchOptions {
  std::string model;      ///< a model directory or .gguf file
  std::string synthetic;  ///< a preset name (runtime::kSyntheticPresets)
  int layers = 0, vocab = 0;
  std::string weights = "auto";
  std::string device = "cpu";
  std::vector<int> n_prompt{512}, n_gen{128}, n_depth{0}, batch{1}, threads;
  KvOptions kv;
  std::string routing;  ///< --routing text; empty: top-k
  int repetitions = 5;
  bool json = false, no_verify = false;
  std::string plot;
  long long seed = 0;
  std::string tools_dir;  ///< where tools/plot_bench.py and the tools venv live

  CLI::Option const* model_flag = nullptr;
  CLI::Option const* synthetic_flag = nullptr;
  CLI::Option const* layers_flag = nullptr;
  CLI::Option const* vocab_flag = nullptr;
};

/// Registers the flags of `qflash bench` on `cmd`.
inline void add_bench_options(CLI::App* cmd, BenchOptions& o) {
  o.model_flag = cmd->add_option("-m,--model", o.model,
                                 "Hugging Face model directory or llama.cpp .gguf file (default: the embedded model)");
  o.synthetic_flag = cmd->add_option("--synthetic", o.synthetic,
                                     "bench random weights with a preset's exact shapes, built in memory (" +
                                         runtime::synthetic_preset_names() + "); instead of --model");
  o.layers_flag = cmd->add_option("--layers", o.layers,
                                  "--synthetic only: layers (default 4: 3 Gated DeltaNet + 1 full attention)")
                      ->check(integer_in(1));
  o.vocab_flag = cmd->add_option("--vocab", o.vocab, "--synthetic only: vocabulary (default: the real model's)")
                     ->check(integer_in(1));
  std::vector<std::string> schemes;
  for (auto const& [k, name] : runtime::kWeightSchemes) schemes.emplace_back(name);
  cmd->add_option("--weights", o.weights,
                  "weight format in memory, as for 'qflash run' (auto: as stored; bf16 for --synthetic)")
      ->check(CLI::IsMember(schemes))
      ->capture_default_str();
  cmd->add_option("-p,--n-prompt", o.n_prompt, "prompt lengths of the prefill tests, e.g. 128,512 (0: none)")
      ->delimiter(',')
      ->check(integer_in(0))
      ->capture_default_str();
  cmd->add_option("-n,--n-gen", o.n_gen, "tokens of the decode tests, e.g. 16,128 (0: none)")
      ->delimiter(',')
      ->check(integer_in(0))
      ->capture_default_str();
  cmd->add_option("-d,--n-depth", o.n_depth,
                  "context already in the KV cache before each test, e.g. 0,4096 (filled untimed, as llama-bench)")
      ->delimiter(',')
      ->check(integer_in(0))
      ->capture_default_str();
  cmd->add_option("-b,--batch", o.batch,
                  "sequences run together, e.g. 1,4,16: pp<P> b<B> is one forward of B prompts, tg<N> b<B> N steps of "
                  "B tokens (tok/s counts every sequence's tokens)")
      ->delimiter(',')
      ->check(integer_in(1, 4096))
      ->capture_default_str();
  add_kv_options(cmd, o.kv);
  cmd->add_option("--device", o.device,
                  std::string("cpu, or cuda[:N]: the model on CUDA device N (default 0), decode against the device's "
                              "copy bandwidth; this build: ") +
                      (QFLASH_CLI_CUDA ? "cpu and cuda" : "cpu only"))
      ->check(device_validator())
      ->capture_default_str();
  cmd->add_option("--routing", o.routing,
                  "experts per token (see 'qflash run --help'); the roofline still counts the model's top-k");
  cmd->add_option("-t,--threads", o.threads, "thread counts to bench, e.g. 1,2 (default: one per physical core)")
      ->delimiter(',')
      ->check(integer_in(1));
  cmd->add_option("-r,--repetitions", o.repetitions, "timed runs of each test, after one warm-up")
      ->check(integer_in(1))
      ->capture_default_str();
  cmd->add_flag("--json", o.json, "one JSON object per test and line instead of a markdown table");
  cmd->add_option("--plot", o.plot, "also draw tok/s per format and threads into this PNG (needs the tools venv)");
  cmd->add_option("-s,--seed", o.seed, "seed of the synthetic weights and the benched token ids")
      ->check(integer_in(0, std::numeric_limits<long long>::max()))
      ->capture_default_str();
  cmd->add_flag("--no-verify", o.no_verify, "skip checking the files against the model's SHA256SUMS");
  cmd->footer(
      "Tests: pp<P> is one forward of P tokens on a fresh sequence, tg<N> is N single-token steps from an empty one "
      "(as llama-bench); with -d D both start from a sequence holding D tokens (\"@ dD\"). bytes_per_token counts the "
      "weight matrices a decoded token reads: attention / Gated DeltaNet projections, the router, n_expert_used "
      "routed experts at the layer's mean expert size, the shared expert, lm_head and one embedding row, plus the KV "
      "a decode step reads at the test's mean context (depth + (n+1)/2) in the --kv formats; DeltaNet state reads (and "
      "norm vectors) are not counted; with -b above 1 the experts a step reads depend on the routing, so no roofline is "
      "given. "
      "bandwidth_gbs is the read bandwidth measured in the same run with the same threads (--device cuda: the "
      "device's copy bandwidth, bytes read + written, as bandwidthTest); roofline_fraction = "
      "decode_tok_s x bytes_per_token / bandwidth. peak_rss_bytes excludes the bandwidth probe's buffer.");
}

/// "1.50 GiB", "12.00 MiB", "3.5 KiB", "512 B": the CLI's one way to print a byte count.
inline std::string human_bytes(double b) {
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

/// Checks that `path` names a model and reads its config (cheap: no weights), so flags that
/// depend on the model are checked before it is loaded.
inline model::ModelConfig peek_config(std::string const& path) {
  std::error_code ec;
  QFLASH_CHECK(std::filesystem::exists(path, ec), "model '", path, "' does not exist",
               path == QFLASH_DEFAULT_MODEL_DIR ? " (the embedded default model is missing: pass --model DIR)" : "");
  if (runtime::is_gguf_file(path)) return io::config_from_gguf(io::GgufFile(path));
  QFLASH_CHECK(std::filesystem::is_directory(path, ec), "model '", path,
               "' is neither a model directory nor a GGUF file");
  return io::load_config(path);
}

namespace bench_detail {

struct Stats {
  double mean = 0, stddev = 0;
};

/// Mean and sample standard deviation (0 for one sample), as llama-bench reports them.
inline Stats stats_of(std::vector<double> const& v) {
  Stats s;
  if (v.empty()) return s;
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  if (v.size() > 1) {
    double ss = 0;
    for (double x : v) ss += (x - s.mean) * (x - s.mean);
    s.stddev = std::sqrt(ss / static_cast<double>(v.size() - 1));
  }
  return s;
}

/// "1 thread", "2 threads".
inline std::string count_of(int n, std::string const& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

/// The process's peak resident memory (getrusage) leaving out the read-bandwidth probe: before
/// each probe the peak so far is kept, after it the kernel's high-water mark is reset to the
/// current size (Linux: /proc/self/clear_refs "5"). Where that is refused, the peak includes
/// the probe's buffer, and a warning says so.
class PeakRss {
 public:
  [[nodiscard]] std::int64_t bytes() const { return std::max(carried_, now()); }
  void before_probe() { carried_ = std::max(carried_, now()); }
  void after_probe(std::int64_t probe_bytes) {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.flush();
    if (!clear && !warned_) {
      warned_ = true;
      QFLASH_LOG_WARN("peak_rss_bytes includes the bandwidth probe's ", human_bytes(static_cast<double>(probe_bytes)),
                      " buffer: the peak cannot be reset here (/proc/self/clear_refs)");
    }
  }

 private:
  static std::int64_t now() {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    return static_cast<std::int64_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
  }
  std::int64_t carried_ = 0;
  bool warned_ = false;
};

/// One test's result: the row of the table and the JSON object.
struct Row {
  std::string test;
  int threads = 0, n_prompt = 0, n_gen = 0, n_depth = 0, batch = 1;
  std::vector<double> samples;  // tok/s of each repetition
  double bandwidth_gbs = 0;
  std::int64_t peak_rss = 0;
};

/// What every row shares.
struct Context {
  std::string model, format, kv, routing = "top_k";
  std::string device = "cpu";  ///< "cpu", or "cuda:N" and the device's name
  int n_layer = 0, vocab = 0, repetitions = 0;
  std::int64_t model_bytes = 0, bytes_per_token = 0;  ///< weights a decoded token reads
  std::int64_t kv_bytes_per_position = 0;              ///< K and V of every layer, one position
  /// What a decode step of row r reads: the weights and the KV at its mean context (the
  /// steps see depth + 1 ... depth + n_gen positions).
  [[nodiscard]] std::int64_t bytes_read(Row const& r) const {
    return bytes_per_token + (r.n_gen > 0 ? (2 * std::int64_t{r.n_depth} + r.n_gen + 1) * kv_bytes_per_position / 2 : 0);
  }
};

inline nlohmann::ordered_json to_json(Context const& c, Row const& r) {
  Stats const s = stats_of(r.samples);
  bool const decode = r.n_gen > 0;
  nlohmann::ordered_json j;
  j["model"] = c.model;
  j["format"] = c.format;
  j["n_layer"] = c.n_layer;
  j["vocab"] = c.vocab;
  j["model_bytes"] = c.model_bytes;
  j["kv"] = c.kv;
  j["routing"] = c.routing;
  j["device"] = c.device;
  j["threads"] = r.threads;
  j["cpu_isa"] = arch::to_string(arch::cpu_isa());
  j["test"] = r.test;
  j["n_prompt"] = r.n_prompt;
  j["n_gen"] = r.n_gen;
  j["n_depth"] = r.n_depth;
  j["batch"] = r.batch;
  j["repetitions"] = c.repetitions;
  j["prefill_tok_s"] = decode ? nlohmann::ordered_json() : nlohmann::ordered_json(s.mean);
  j["decode_tok_s"] = decode ? nlohmann::ordered_json(s.mean) : nlohmann::ordered_json();
  j["stddev_tok_s"] = s.stddev;
  j["samples_tok_s"] = r.samples;
  j["bytes_per_token"] = c.bytes_read(r);
  j["bandwidth_gbs"] = r.bandwidth_gbs;
  j["roofline_fraction"] =
      decode && r.batch == 1 ? nlohmann::ordered_json(runtime::roofline_fraction(s.mean, c.bytes_read(r), r.bandwidth_gbs))
             : nlohmann::ordered_json();
  j["peak_rss_bytes"] = r.peak_rss;
  return j;
}

inline void print_table_header() {
  std::printf("| %-36s | %-14s | %10s | %7s | %7s | %20s | %11s | %9s | %8s | %10s |\n", "model", "format", "size",
              "threads", "test", "t/s", "bytes/token", "read GB/s", "roofline", "peak RSS");
  std::printf("| %-36s | %-14s | %10s | %7s | %7s | %20s | %11s | %9s | %8s | %10s |\n",
              "------------------------------------", "--------------", "---------:", "------:", "-------",
              "-------------------:", "----------:", "--------:", "-------:", "---------:");
}

inline void print_table_row(Context const& c, Row const& r) {
  Stats const s = stats_of(r.samples);
  char tps[48], roof[16] = "-";
  std::snprintf(tps, sizeof tps, "%.2f ± %.2f", s.mean, s.stddev);
  if (r.n_gen > 0 && r.batch == 1) std::snprintf(roof, sizeof roof, "%.2f", runtime::roofline_fraction(s.mean, c.bytes_read(r), r.bandwidth_gbs));
  // "±" is two bytes: one more column of padding keeps the table aligned.
  std::printf("| %-36s | %-14s | %10s | %7d | %7s | %21s | %11s | %9.1f | %8s | %10s |\n", c.model.c_str(),
              c.format.c_str(), human_bytes(static_cast<double>(c.model_bytes)).c_str(), r.threads, r.test.c_str(),
              tps, human_bytes(static_cast<double>(c.bytes_read(r))).c_str(), r.bandwidth_gbs, roof,
              human_bytes(static_cast<double>(r.peak_rss)).c_str());
  std::fflush(stdout);
}

/// "q4_k" for a scheme; for auto the formats the matrices are in, the most bytes first.
inline std::string format_label(runtime::LoadedModel const& m) {
  if (m.scheme != runtime::WeightScheme::kAuto) return std::string(runtime::to_string(m.scheme));
  std::vector<std::pair<std::int64_t, WeightFormat>> by_bytes;
  for (auto const& [f, b] : m.bytes_per_format()) by_bytes.emplace_back(b, f);
  std::sort(by_bytes.rbegin(), by_bytes.rend());
  std::string out;
  for (auto const& [b, f] : by_bytes) out += (out.empty() ? "" : "+") + std::string(to_string(f));
  return out;
}

/// Runs argv[0] with the given arguments (no shell); throws Error unless it exits 0.
inline void run_program(std::vector<std::string> const& argv) {
  std::vector<char*> args;
  for (auto const& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  int const err = ::posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ);
  QFLASH_CHECK(err == 0, "cannot run ", argv[0], ": ", std::strerror(err));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  QFLASH_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, argv[0], " ", argv[1], " failed (",
               WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status)) : std::string("killed"), ")");
}

/// Random token ids in [0, vocab).
inline std::vector<std::int32_t> random_tokens(std::mt19937_64& rng, int n, int vocab) {
  std::uniform_int_distribution<std::int32_t> dist(0, vocab - 1);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = dist(rng);
  return ids;
}

/// What each timed step brings back: its rows' best token, as greedy generation does
/// (kernels/token_candidates, on the device for a CUDA model).
inline model::CandidateRequest const kGreedy{};

/// A sequence in `pool` already holding `depth` (filled in chunks of 512, untimed), with
/// blocks reserved for `more` tokens after them.
template <class Model>
model::SequenceState filled_sequence(Model& m, std::shared_ptr<kv::KvBlockPool> const& pool,
                                     std::vector<std::int32_t> const& depth, int more, model::LogitCandidates& logits) {
  auto state = m.new_sequence(pool);
  state.reserve(static_cast<std::int64_t>(depth.size()) + more);
  for (std::size_t b = 0; b < depth.size(); b += 512) {
    std::span<std::int32_t const> const part(depth.data() + b, std::min<std::size_t>(512, depth.size() - b));
    model::SequenceChunk const chunk{part, &state};
    m.forward(std::span(&chunk, 1), model::LogitsFor::kLastToken, kGreedy, logits);
  }
  return state;
}

/// tok/s of one prefill: a forward of every sequence's `tokens[i]` on `states[i]` at once,
/// the best token of each last token's logits.
template <class Model>
double time_prefill(Model& m, std::vector<model::SequenceState>& states,
                    std::vector<std::vector<std::int32_t>> const& tokens, model::LogitCandidates& logits) {
  std::vector<model::SequenceChunk> chunks;
  std::size_t n = 0;
  for (std::size_t i = 0; i < states.size(); ++i) {
    chunks.push_back({tokens[i], &states[i]});
    n += tokens[i].size();
  }
  auto const t0 = std::chrono::steady_clock::now();
  m.forward(chunks, model::LogitsFor::kLastToken, kGreedy, logits);
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(n) / secs;
}

/// tok/s of decoding: step j runs token j of every sequence's `tokens[i]` on `states[i]`, all
/// sequences in one forward.
template <class Model>
double time_decode(Model& m, std::vector<model::SequenceState>& states,
                   std::vector<std::vector<std::int32_t>> const& tokens, model::LogitCandidates& logits) {
  std::vector<model::SequenceChunk> chunks(states.size());
  std::size_t const steps = tokens.front().size();
  auto const t0 = std::chrono::steady_clock::now();
  for (std::size_t j = 0; j < steps; ++j) {
    for (std::size_t i = 0; i < states.size(); ++i) chunks[i] = {std::span(&tokens[i][j], 1), &states[i]};
    m.forward(chunks, model::LogitsFor::kLastToken, kGreedy, logits);
  }
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(steps * states.size()) / secs;
}

/// The model's name in the table: the synthetic preset and its cut, or the path's last part.
inline std::string model_label(BenchOptions const& o, model::ModelConfig const& c) {
  if (o.synthetic_flag->count() > 0)
    return o.synthetic + " synthetic " + std::to_string(c.n_layer) + "L v" + std::to_string(c.vocab);
  std::filesystem::path p(o.model);
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

}  // namespace bench_detail

/// `qflash bench`; every command-line mistake is a UsageError raised before any weights are
/// read or generated.
inline int cmd_bench(BenchOptions o) {
  using namespace bench_detail;
  namespace fs = std::filesystem;
  bool const synthetic = o.synthetic_flag->count() > 0;
  if (synthetic && o.model_flag->count() > 0)
    throw UsageError("--model and --synthetic exclude each other: bench a model from disk or a synthetic preset");
  if (!synthetic && o.layers_flag->count() > 0)
    throw UsageError("--layers: only for --synthetic (a model from disk has its own layers)");
  if (!synthetic && o.vocab_flag->count() > 0)
    throw UsageError("--vocab: only for --synthetic (a model from disk has its own vocabulary)");
  check_cuda_build(o.device);
  std::optional<int> const device = cuda_device(o.device);
  if (device && o.threads.size() > 1)
    throw UsageError("-t: one thread count with --device " + o.device + " (the host threads only feed the device)");
  std::erase(o.n_prompt, 0);
  std::erase(o.n_gen, 0);
  if (o.n_prompt.empty() && o.n_gen.empty()) throw UsageError("-p and -n are all 0: no test to run");

  model::ModelConfig cfg;
  if (synthetic) {
    runtime::SyntheticPreset preset{};
    try {
      preset = runtime::synthetic_preset(o.synthetic);
    } catch (Error const& e) {
      throw UsageError(std::string("--synthetic: ") + e.what());
    }
    if (o.layers > preset.n_layer)
      throw UsageError("--layers: " + std::to_string(o.layers) + " is more than the " + std::to_string(preset.n_layer) +
                       " layers of " + o.synthetic);
    if (o.vocab > preset.vocab)
      throw UsageError("--vocab: " + std::to_string(o.vocab) + " is more than the " + std::to_string(preset.vocab) +
                       " tokens of " + o.synthetic + "'s vocabulary");
    cfg = runtime::synthetic_config(o.synthetic, o.layers, o.vocab);
  } else {
    cfg = peek_config(o.model);
  }
  check_kv_options(o.kv);
  model::ModelOptions model_opts;
  if (!o.routing.empty()) {
    try {
      model_opts.routing = model::parse_routing(o.routing);
    } catch (Error const& e) {
      throw UsageError(std::string("--routing: ") + e.what());
    }
  }
  int const max_depth = *std::max_element(o.n_depth.begin(), o.n_depth.end());
  for (auto const* list : {&o.n_prompt, &o.n_gen})
    for (int n : *list)
      if (std::int64_t{n} + max_depth > cfg.max_position_embeddings)
        throw UsageError(std::string(list == &o.n_prompt ? "-p " : "-n ") + std::to_string(n) +
                         (max_depth > 0 ? " after -d " + std::to_string(max_depth) : std::string()) +
                         " is above the model's limit of " + std::to_string(cfg.max_position_embeddings) +
                         " tokens (max_position_embeddings)");
  std::string python, plot_script;
  if (!o.plot.empty()) {
    fs::path const dir = fs::path(o.plot).parent_path();
    std::error_code ec;
    if (!dir.empty() && !fs::is_directory(dir, ec))
      throw UsageError("--plot: directory '" + printable(dir.string()) + "' does not exist");
    python = (fs::path(o.tools_dir) / ".venv" / "bin" / "python").string();
    plot_script = (fs::path(o.tools_dir) / "plot_bench.py").string();
    QFLASH_CHECK(fs::exists(plot_script, ec), "--plot: ", plot_script, " is missing (it comes with the qflash sources)");
    QFLASH_CHECK(::access(python.c_str(), X_OK) == 0, "--plot needs matplotlib from the tools venv, and ", python,
                 " does not exist; create the venv with: ", (fs::path(o.tools_dir) / "setup_venv").string());
  }

  // Thread counts above the CPUs this process may use are reduced to them, as 'run' does.
  int const cpus = available_cpus();
  if (o.threads.empty()) o.threads.push_back(std::min(default_threads(), cpus));
  for (int& t : o.threads)
    if (t > cpus) {
      QFLASH_LOG_WARN("-t ", t, " is more than the ", cpus, " CPUs this process may use; using ", cpus, " threads");
      t = cpus;
    }
  set_max_threads(*std::max_element(o.threads.begin(), o.threads.end()));  // for loading

  check_device_usable(device);  // said before the weights are made
  runtime::WeightScheme const scheme = runtime::parse_weight_scheme(o.weights);
  auto const t_load = std::chrono::steady_clock::now();
  runtime::LoadedModel loaded;
  if (synthetic) {
    loaded = runtime::synthetic_model(cfg, scheme, static_cast<std::uint64_t>(o.seed), ::isatty(2) != 0);
  } else {
    runtime::LoadOptions lo;
    lo.weights = scheme;
    lo.verify_checksums = !o.no_verify;
    lo.config = cfg;
    loaded = runtime::load_model(o.model, lo);
  }
  Context ctx;
  ctx.model = model_label(o, cfg) + (device ? " on " + o.device : std::string());
  ctx.format = format_label(loaded);
  kv::KvMap const kv = resolve_kv(o.kv, cfg, synthetic ? std::string() : o.model);
  ctx.kv = describe_kv(kv);
  ctx.routing = model::to_string(model_opts.routing);
  ctx.kv_bytes_per_position = kv.bytes_per_token(cfg.d_head);
  ctx.n_layer = cfg.n_layer;
  ctx.vocab = cfg.vocab;
  ctx.repetitions = o.repetitions;
  for (auto const& [f, b] : loaded.bytes_per_format()) ctx.model_bytes += b;
  std::fprintf(stderr, "bench: %s weights (%s) %s in %.1f s\n", human_bytes(static_cast<double>(ctx.model_bytes)).c_str(),
               ctx.format.c_str(), synthetic ? "generated" : "loaded",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  runtime::DecodeWeightBytes const per_token = runtime::decode_weight_bytes(cfg, loaded.weights);
  ctx.bytes_per_token = per_token.total();
  QFLASH_LOG_INFO("bytes per decoded token: ", ctx.bytes_per_token, " (mixers ", per_token.mixers, ", routers ",
                  per_token.routers, ", routed experts ", per_token.routed_experts, ", shared experts ",
                  per_token.shared_experts, ", lm_head ", per_token.lm_head, ", embedding row ", per_token.embedding_row,
                  ")");
  // The routed experts change from token to token; the rest is read again by every token.
  std::int64_t const reread = per_token.total() - per_token.routed_experts;
  std::int64_t cache = runtime::last_level_cache_bytes();
#if QFLASH_CLI_CUDA
  if (device) cache = runtime::device_l2_bytes(*device);
#endif
  if (cache > 0 && reread <= cache)
    QFLASH_LOG_WARN("the weights every decoded token reads again (", human_bytes(static_cast<double>(reread)),
                    ") fit in the ", human_bytes(static_cast<double>(cache)), device ? " L2" : " last-level",
                    " cache: decode can read them from cache, and roofline_fraction then overstates the "
                    "share of memory bandwidth reached (bench a model whose dense weights exceed the cache, e.g. "
                    "more --layers)");

  PeakRss peak;
  std::vector<std::string> lines;  // JSON, for --plot
  std::mt19937_64 rng(static_cast<std::uint64_t>(o.seed));
  if (!o.json) print_table_header();
  auto emit = [&](Row const& r) {
    std::string const line = to_json(ctx, r).dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
    lines.push_back(line);
    if (o.json) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    } else {
      print_table_row(ctx, r);
    }
  };
  /// The bandwidth decode is put against: the CPU's read bandwidth with the pool's threads, or
  /// the device's copy bandwidth.
  auto measure_bandwidth = [&]() -> double {
#if QFLASH_CLI_CUDA
    if (device) {
      runtime::DeviceBandwidth const bw = runtime::measure_device_bandwidth(*device);
      ctx.device = o.device + " " + bw.device;
      std::fprintf(stderr, "bench: %s copy bandwidth %.1f GB/s (read + written, %s buffers)\n", bw.device.c_str(),
                   bw.gbs, human_bytes(static_cast<double>(bw.buffer_bytes)).c_str());
      return bw.gbs;
    }
#endif
    peak.before_probe();
    runtime::ReadBandwidth const bw = runtime::measure_read_bandwidth();
    peak.after_probe(bw.buffer_bytes);
    std::fprintf(stderr, "bench: read bandwidth %.1f GB/s (%s, %s loads over %s)\n", bw.gbs,
                 count_of(bw.threads, "thread").c_str(), std::string(arch::to_string(bw.isa)).c_str(),
                 human_bytes(static_cast<double>(bw.buffer_bytes)).c_str());
    return bw.gbs;
  };
  auto bench_model = [&](auto& m) {
    model::LogitCandidates logits;
    for (int t : o.threads) {
      set_max_threads(t);
      double const gbs = measure_bandwidth();
      auto run_test = [&](std::string name, int n_prompt, int n_gen, int depth, int batch) {
        if (batch > 1) name += " b" + std::to_string(batch);
        if (depth > 0) name += " @ d" + std::to_string(depth);
        std::fprintf(stderr, "bench: %s, %s: warm-up and %s\n", name.c_str(), count_of(t, "thread").c_str(),
                     count_of(o.repetitions, "run").c_str());
        Row r{name, t, n_prompt, n_gen, depth, batch, {}, gbs, 0};
        int const n = n_prompt > 0 ? n_prompt : n_gen;
        auto const context = random_tokens(rng, depth, cfg.vocab);
        auto once = [&](int tokens) {
          // The batch's sequences share one KV pool, as a serving engine's do.
          auto const pool = model::kv_pool_for(m.config(), kv, batch, m.memory());
          std::vector<std::vector<std::int32_t>> ids;
          std::vector<model::SequenceState> states;
          for (int i = 0; i < batch; ++i) {
            ids.push_back(random_tokens(rng, tokens, cfg.vocab));
            states.push_back(filled_sequence(m, pool, context, tokens, logits));
          }
          return n_prompt > 0 ? time_prefill(m, states, ids, logits) : time_decode(m, states, ids, logits);
        };
        (void)once(n_prompt > 0 ? n : 1);  // warm-up: llama-bench's (the whole prompt; one decode step)
        for (int i = 0; i < o.repetitions; ++i) r.samples.push_back(once(n));
        r.peak_rss = peak.bytes();
        emit(r);
      };
      for (int d : o.n_depth)
        for (int b : o.batch) {
          for (int p : o.n_prompt) run_test("pp" + std::to_string(p), p, 0, d, b);
          for (int n : o.n_gen) run_test("tg" + std::to_string(n), 0, n, d, b);
        }
    }
    if (StepRecorder const* rec = m.recorder()) std::fprintf(stderr, "bench: %s\n", rec->summary().c_str());
  };
  with_model_on(device, std::move(loaded), model_opts, bench_model);

  if (!o.plot.empty()) {
    fs::path const jsonl = fs::temp_directory_path() / ("qflash-bench-" + std::to_string(::getpid()) + ".jsonl");
    {
      std::ofstream f(jsonl);
      for (auto const& l : lines) f << l << '\n';
      QFLASH_CHECK(f.good(), "--plot: cannot write ", jsonl.string());
    }
    try {
      run_program({python, plot_script, "--out", o.plot, jsonl.string()});
    } catch (...) {
      std::error_code ec;
      fs::remove(jsonl, ec);
      throw;
    }
    std::error_code ec;
    fs::remove(jsonl, ec);
    std::fprintf(stderr, "bench: wrote %s\n", printable(o.plot).c_str());
  }
  return kExitOk;
}

}  // namespace qflash::cli
