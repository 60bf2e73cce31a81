// Checkpoints in Qwen's FP8 layout (e4m3 weights, fp32 `weight_scale_inv` per 128x128 tile,
// `quantization_config` in config.json) are bound as stored: written here from the
// qwen3_5_moe_tiny fixture, per-expert and stacked, each must give the logits of an fp32
// checkpoint holding the same dequantized values (within fp32 rounding), and `--weights fp8` at load must make the
// same bytes from the fp32 fixture.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qflash/io/safetensors.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "qflash/runtime/load_model.hpp"
#include "support/safetensors_writer.hpp"
#include "support/temp_dir.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
namespace fs = std::filesystem;

namespace {

std::string const kTiny = std::string(QFLASH_FIXTURES_DIR) + "/qwen3_5_moe_tiny";

runtime::LoadOptions quiet(runtime::WeightScheme w = runtime::WeightScheme::kAuto) {
  runtime::LoadOptions o;
  o.progress = false;
  o.weights = w;
  return o;
}

bool quantized_in_fp8(std::string const& name, int rank) {
  if (rank < 2 || name.find("embed_tokens") != std::string::npos || name == "lm_head.weight") return false;
  if (name.ends_with("mlp.gate.weight") || name.ends_with("shared_expert_gate.weight")) return false;
  return name.find("conv1d") == std::string::npos;
}

struct Written {
  std::vector<test::Entry> fp8;         // the FP8 checkpoint
  std::vector<test::Entry> dequantized;  // the same values as f32
};

/// Adds tensor `name` [rows x cols, or E x rows x cols] to both checkpoints.
void add(Written& w, std::string const& name, std::vector<std::int64_t> const& shape, std::vector<float> const& x) {
  bool const fp8 = quantized_in_fp8(name, static_cast<int>(shape.size()));
  if (!fp8) {
    w.fp8.push_back({name, "F32", shape, test::to_bytes(x)});
    w.dequantized.push_back({name, "F32", shape, test::to_bytes(x)});
    return;
  }
  std::int64_t const n_mat = shape.size() == 3 ? shape[0] : 1;
  std::int64_t const rows = shape[shape.size() - 2], cols = shape.back();
  std::vector<std::uint8_t> q;
  std::vector<float> scales, deq;
  for (std::int64_t m = 0; m < n_mat; ++m) {
    auto const enc = encode_matrix(WeightFormat::kFp8E4m3, x.data() + m * rows * cols, rows, cols);
    auto const* b = reinterpret_cast<std::uint8_t const*>(enc.bytes.data());
    q.insert(q.end(), b, b + enc.bytes.size());
    scales.insert(scales.end(), enc.scales.begin(), enc.scales.end());
    std::vector<float> row(static_cast<std::size_t>(cols));
    for (std::int64_t r = 0; r < rows; ++r) {
      dequantize_row(enc.view, r, row.data());
      deq.insert(deq.end(), row.begin(), row.end());
    }
  }
  std::vector<std::int64_t> grid{fp8_scale_blocks(rows), fp8_scale_blocks(cols)};
  if (shape.size() == 3) grid.insert(grid.begin(), shape[0]);
  w.fp8.push_back({name, "F8_E4M3", shape, test::to_bytes(q)});
  w.fp8.push_back({name + "_scale_inv", "F32", grid, test::to_bytes(scales)});
  w.dequantized.push_back({name, "F32", shape, test::to_bytes(deq)});
}

/// Writes the two checkpoints of the tiny fixture; `stacked` joins each layer's experts into
/// experts.gate_up_proj [E, 2 d_ff, d] and experts.down_proj [E, d, d_ff].
void write_checkpoints(fs::path const& fp8_dir, fs::path const& f32_dir, bool stacked) {
  io::SafetensorsFile const src(kTiny + "/model.safetensors");
  auto const cfg = io::load_config(kTiny);
  Written w;
  for (auto const& t : src.tensors()) {
    if (stacked && t.name.find(".mlp.experts.") != std::string::npos) continue;
    std::vector<std::int64_t> shape(t.shape.dims.begin(), t.shape.dims.begin() + t.shape.rank);
    add(w, t.name, shape, io::read_f32(t));
  }
  if (stacked)
    for (int l = 0; l < cfg.n_layer; ++l) {
      std::string const M = "model.layers." + std::to_string(l) + ".mlp.experts.";
      std::vector<float> gate_up, down;
      for (int e = 0; e < cfg.n_expert; ++e) {
        std::string const E = M + std::to_string(e) + ".";
        for (auto const* part : {"gate_proj.weight", "up_proj.weight"}) {
          auto v = io::read_f32(*src.find(E + part));
          gate_up.insert(gate_up.end(), v.begin(), v.end());
        }
        auto v = io::read_f32(*src.find(E + "down_proj.weight"));
        down.insert(down.end(), v.begin(), v.end());
      }
      add(w, M + "gate_up_proj", {cfg.n_expert, 2 * cfg.d_ff_expert, cfg.d_model}, gate_up);
      add(w, M + "down_proj", {cfg.n_expert, cfg.d_model, cfg.d_ff_expert}, down);
    }
  auto config = nlohmann::json::parse(std::ifstream(kTiny + "/config.json"));
  for (auto const& dir : {f32_dir, fp8_dir}) {
    fs::create_directories(dir);
    if (dir == fp8_dir)
      config["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                       {"weight_block_size", {128, 128}}};
    std::ofstream(dir / "config.json") << config.dump(2);
    test::write_safetensors((dir / "model.safetensors").string(), dir == fp8_dir ? w.fp8 : w.dequantized);
  }
}

template <class M>
std::vector<float> logits_of(M& m, std::vector<std::int32_t> const& ids) {
  auto state = m.new_sequence();
  model::SequenceChunk c{ids, &state};
  std::vector<float> out;
  m.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, out);
  return out;
}

}  // namespace

TEST_CASE("FP8 checkpoints (per-expert and stacked) equal fp32 checkpoints of their dequantized values") {
  std::vector<std::int32_t> const ids{171, 56, 115, 66, 64, 182, 125, 75, 29, 93};
  for (bool stacked : {false, true}) {
    CAPTURE(stacked);
    test::TempDir const tmp;
    write_checkpoints(tmp.path / "fp8", tmp.path / "f32", stacked);
    auto fp8 = runtime::load_model_as<spec::generic>((tmp.path / "fp8").string(), quiet());
    auto f32 = runtime::load_model_as<spec::generic>((tmp.path / "f32").string(), quiet());
    CHECK(fp8->weights().layers[0].linear.qkv.format == WeightFormat::kFp8E4m3);
    CHECK(fp8->weights().layers[0].moe.experts[3].down.format == WeightFormat::kFp8E4m3);
    CHECK(fp8->weights().embed.format == WeightFormat::kF32);
    // The fp8 rows hold exactly the fp32 values. Projections of 8 tokens or more decode them
    // and run the fp32 kernel; under 8 (the experts' few tokens each) they are multiplied in
    // registers, scaled once per 128-column tile, so the logits agree within fp32 rounding.
    auto const a = logits_of(*fp8, ids), b = logits_of(*f32, ids);
    REQUIRE(a.size() == b.size());
    test::Tolerance const fp32_sums{1e-5, 1e-5};
    auto const r = test::all_close<float, float>(a, b, fp32_sums);
    CHECK_MESSAGE(r.ok, r.report);
  }
}

TEST_CASE("--weights fp8 makes the bytes an FP8 checkpoint stores") {
  test::TempDir const tmp;
  write_checkpoints(tmp.path / "fp8", tmp.path / "f32", false);
  auto stored = runtime::load_model((tmp.path / "fp8").string(), quiet());
  auto made = runtime::load_model(kTiny, quiet(runtime::WeightScheme::kFp8));
  auto same = [](WeightView const& a, WeightView const& b) {
    REQUIRE(a.format == WeightFormat::kFp8E4m3);
    REQUIRE(b.format == WeightFormat::kFp8E4m3);
    REQUIRE(a.bytes() == b.bytes());
    std::int64_t const n_scales = fp8_scale_blocks(a.rows) * fp8_scale_blocks(a.cols);
    return std::memcmp(a.data, b.data, static_cast<std::size_t>(a.bytes())) == 0 &&
           std::equal(a.scales, a.scales + n_scales, b.scales);
  };
  for (std::size_t l = 0; l < made.weights.layers.size(); ++l) {
    CAPTURE(l);
    auto const& a = made.weights.layers[l];
    auto const& b = stored.weights.layers[l];
    CHECK(same(a.moe.experts[1].gate, b.moe.experts[1].gate));
    CHECK(same(a.moe.shared->down, b.moe.shared->down));
    if (a.kind == model::LayerKind::kFullAttention)
      CHECK(same(a.attention.q, b.attention.q));
    else
      CHECK(same(a.linear.qkv, b.linear.qkv));
  }
}

TEST_CASE("an FP8 tensor without its scales is refused, naming both") {
  test::TempDir const tmp;
  write_checkpoints(tmp.path / "fp8", tmp.path / "f32", false);
  io::SafetensorsFile const f((tmp.path / "fp8" / "model.safetensors").string());
  std::vector<test::Entry> kept;
  for (auto const& t : f.tensors()) {
    if (t.name == "model.layers.0.linear_attn.out_proj.weight_scale_inv") continue;
    std::vector<std::int64_t> shape(t.shape.dims.begin(), t.shape.dims.begin() + t.shape.rank);
    kept.push_back({t.name, t.dtype == DType::kFp8E4m3 ? "F8_E4M3" : "F32", shape,
                    test::to_bytes(t.data.data(), t.data.size())});
  }
  test::write_safetensors((tmp.path / "fp8" / "model.safetensors").string(), kept);
  CHECK_THROWS_WITH_AS(runtime::load_model((tmp.path / "fp8").string(), quiet()),
                       doctest::Contains("'model.layers.0.linear_attn.out_proj.weight' has no "
                                         "'model.layers.0.linear_attn.out_proj.weight_scale_inv'"),
                       Error);
}
