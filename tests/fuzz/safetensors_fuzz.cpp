// libFuzzer target for the safetensors header parser (qflash/io/safetensors.hpp) and the
// loader's binder (runtime/load_model.hpp): any input must either open or throw
// qflash::Error; then every tensor it lists is read through read_f32 where the dtype allows;
// then the input is bound as the weights of a fixed nano qwen3_moe config (kNanoConfig; the
// seed nano_qwen3_moe.safetensors binds) and, when it binds, run for two tokens. The files
// are written to one temp directory per process first. Built and run by scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/safetensors.hpp"
#include "qflash/runtime/load_model.hpp"
#include "fuzz_support.hpp"
// The CPU kernel bodies, so Model<generic, Cpu> instantiates here (scripts/fuzz builds one TU,
// without the generated instance library).
#include "qflash/kernels/cpu.hpp"

namespace {

/// 1 layer, hidden 8, 2 heads of 4 (1 kv head), 2 experts top-1 of width 4, vocab 16.
constexpr char kNanoConfig[] = R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 1,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "num_experts": 2,
  "num_experts_per_tok": 1, "moe_intermediate_size": 4, "intermediate_size": 4, "vocab_size": 16,
  "max_position_embeddings": 32, "tie_word_embeddings": false, "eos_token_id": 1})";

std::string const& temp_dir() {
  static std::string const dir = [] {
    std::string const& d = qflash::fuzz::temp_dir("safetensors");
    if (!qflash::fuzz::write_file(d + "/config.json", kNanoConfig)) std::abort();
    return d;
  }();
  return dir;
}

std::string const& temp_path() {
  static std::string const path = temp_dir() + "/model.safetensors";
  return path;
}

/// Binds the checkpoint as the nano model's weights and runs two tokens through it.
void bind_and_run() {
  qflash::runtime::LoadOptions o;
  o.progress = false;
  o.verify_checksums = false;
  auto m = qflash::runtime::load_model_as<qflash::spec::generic>(temp_dir(), o);
  auto state = m->new_sequence();
  std::vector<std::int32_t> const ids{3, 5};
  qflash::model::SequenceChunk c{ids, &state};
  std::vector<float> logits;
  m->forward(std::span(&c, 1), qflash::model::LogitsFor::kLastToken, logits);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  if (!qflash::fuzz::write_file(temp_path(), {reinterpret_cast<char const*>(data), size}))
    std::abort();  // the harness, not the parser, failed
  try {
    qflash::io::SafetensorsFile const f(temp_path());
    double sum = 0;
    for (auto const& t : f.tensors()) {
      if (t.dtype == qflash::DType::kF32 || t.dtype == qflash::DType::kF16 ||
          t.dtype == qflash::DType::kBF16) {
        for (float v : qflash::io::read_f32(t)) sum += v;
        if (t.numel() > 0) sum += qflash::io::read_scalar_f32(t, t.numel() - 1);
      } else if (!t.data.empty()) {
        sum += static_cast<double>(t.data.back());
      }
      sum += f.find(t.name) == &t;
    }
    for (auto const& [k, v] : f.metadata()) sum += static_cast<double>(k.size() + v.size());
    volatile double sink = sum;
    (void)sink;
    (void)f.weight_bytes();
  } catch (qflash::Error const&) {
    return 0;
  }
  try {
    bind_and_run();
  } catch (qflash::Error const&) {
  }
  return 0;
}
