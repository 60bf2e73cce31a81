// runtime/cuda/device_weights.hpp: the default model's weights uploaded in several weight schemes
// are the host's bytes (fp8: with the scale rows every row uses), each layer's experts a
// StackedView on the device, the small vectors equal; and the routed experts of a layer run on
// the uploaded weights give the CPU's results on the host's (tolerances as expert_ffn_gpu_test:
// fp32 sums in another order, the device's expf in SwiGLU).
#include "gpu/gpu_main.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "qflash/kernels/expert_ffn/cpu.hpp"
#include "qflash/runtime/cuda/device_weights.hpp"
#include "qflash/runtime/load_model.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using test::gpu::DeviceArray;

namespace {

std::string const kMicro = std::string(QFLASH_SOURCE_DIR) + "/models/qwen3_5_moe-micro";

runtime::LoadedModel load(runtime::WeightScheme scheme) {
  runtime::LoadOptions o;
  o.progress = false;
  o.weights = scheme;
  return runtime::load_model(kMicro, o);
}

std::vector<std::byte> download(void const* p, std::int64_t bytes) {
  std::vector<std::byte> out(static_cast<std::size_t>(bytes));
  QFLASH_TEST_CUDA(cudaMemcpy(out.data(), p, out.size(), cudaMemcpyDeviceToHost));
  return out;
}

std::vector<float> download(model::FloatView v) {
  std::vector<float> out(v.size());
  if (!out.empty()) QFLASH_TEST_CUDA(cudaMemcpy(out.data(), v.data(), out.size() * 4, cudaMemcpyDeviceToHost));
  return out;
}

void check_same(WeightView const& host, WeightView const& dev) {
  REQUIRE(dev.format == host.format);
  REQUIRE(dev.rows == host.rows);
  REQUIRE(dev.cols == host.cols);
  auto const* h = static_cast<std::byte const*>(host.data);
  CHECK(download(dev.data, dev.bytes()) == std::vector<std::byte>(h, h + host.bytes()));
  if (host.format != WeightFormat::kFp8E4m3) return;
  std::int64_t const blocks = fp8_scale_blocks(host.cols);
  int wrong = 0;
  for (std::int64_t r = 0; r < host.rows; r += 37) {  // scale rows of every 128-row tile met
    std::vector<std::byte> const got = download(dev.scale_row(r), blocks * 4);
    if (std::memcmp(got.data(), host.scale_row(r), got.size()) != 0) ++wrong;
  }
  CHECK(wrong == 0);
}

void check_vector(model::FloatView host, model::FloatView dev) {
  REQUIRE(dev.size() == host.size());
  CHECK(download(dev) == std::vector<float>(host.begin(), host.end()));
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("uploaded weights are the host's, experts stacked, in every weight scheme") {
    using runtime::WeightScheme;
    for (WeightScheme scheme : {WeightScheme::kAuto, WeightScheme::kFp8, WeightScheme::kQ8_0, WeightScheme::kQ4KM,
                                WeightScheme::kInt4}) {
      CAPTURE(runtime::to_string(scheme));
      auto const host = load(scheme);
      auto const dev = runtime::upload_weights(host.weights, 0, false);
      std::vector<WeightView> h, d;
      host.weights.for_each_matrix([&](std::string const&, WeightView const& w) { h.push_back(w); });
      dev.weights.for_each_matrix([&](std::string const&, WeightView const& w) { d.push_back(w); });
      REQUIRE(d.size() == h.size());
      std::int64_t bytes = 0;
      for (std::size_t i = 0; i < h.size(); ++i) {
        CAPTURE(i);
        check_same(h[i], d[i]);
        bytes += h[i].bytes();
      }
      CHECK(dev.storage->bytes() >= bytes);
      CHECK((dev.weights.lm_head.data == dev.weights.embed.data) == (host.weights.lm_head.data == host.weights.embed.data));
      check_vector(host.weights.final_norm, dev.weights.final_norm);
      for (std::size_t l = 0; l < host.weights.layers.size(); ++l) {
        CAPTURE(l);
        auto const& hl = host.weights.layers[l];
        auto const& dl = dev.weights.layers[l];
        check_vector(hl.input_norm, dl.input_norm);
        check_vector(hl.post_norm, dl.post_norm);
        if (hl.kind == model::LayerKind::kFullAttention) {
          check_vector(hl.attention.q_norm, dl.attention.q_norm);
          check_vector(hl.attention.k_norm, dl.attention.k_norm);
        } else {
          check_vector(hl.linear.conv, dl.linear.conv);
          check_vector(hl.linear.dt_bias, dl.linear.dt_bias);
          check_vector(hl.linear.neg_a, dl.linear.neg_a);
          check_vector(hl.linear.norm, dl.linear.norm);
        }
        for (auto which : {&kernels::ExpertWeights::gate, &kernels::ExpertWeights::up, &kernels::ExpertWeights::down})
          CHECK(kernels::stack(dl.moe.experts, which).has_value());
      }
    }
  }

  TEST_CASE("routed experts on the uploaded weights equal the CPU's on the host's") {
    using runtime::WeightScheme;
    auto run = [&]<class Tag>(Tag) {
      if constexpr (test::gpu::compiled<Tag>()) {
        if (!test::gpu::runs_here<Tag>()) return;
        for (WeightScheme scheme : {WeightScheme::kAuto, WeightScheme::kFp8, WeightScheme::kQ4KM}) {
          CAPTURE(runtime::to_string(scheme));
          CAPTURE(Tag::name);
          auto const host = load(scheme);
          auto const dev = runtime::upload_weights(host.weights, 0, false);
          auto const& hm = host.weights.layers[0].moe;
          auto const& dm = dev.weights.layers[0].moe;
          std::int64_t const d = host.config.d_model, tokens = 5;
          int const k = host.config.n_expert_used, n_expert = host.config.n_expert;
          auto const x = test::random_floats(static_cast<std::size_t>(tokens * d), 3, -1, 1);
          std::vector<std::int32_t> routes;
          std::vector<float> weights, shared_weights;
          for (std::int64_t t = 0; t < tokens; ++t) {
            for (int j = 0; j < k; ++j) {
              routes.push_back(static_cast<std::int32_t>((t * 5 + j * 3) % n_expert));
              weights.push_back(0.3f - 0.02f * static_cast<float>(j));
            }
            shared_weights.push_back(0.6f);
          }
          std::vector<float> cpu(static_cast<std::size_t>(tokens * d), 0.0f);
          kernels::ExpertFfnArgs a{};
          a.experts = hm.experts;
          a.shared = hm.shared ? &*hm.shared : nullptr;
          a.shared_weights = hm.shared ? shared_weights.data() : nullptr;
          a.x = x.data(), a.routes = routes.data(), a.route_weights = weights.data(), a.out = cpu.data();
          a.n_tokens = tokens, a.n_expert_used = k;
          REQUIRE(kernels::launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
          DeviceArray<float> dx(x), dw(weights), dsw(shared_weights), out(cpu.size());
          DeviceArray<std::int32_t> dr(routes);
          a.experts = dm.experts;
          a.shared = dm.shared ? &*dm.shared : nullptr;
          a.shared_weights = dm.shared ? dsw.get() : nullptr;
          a.x = dx.get(), a.routes = dr.get(), a.route_weights = dw.get(), a.out = out.get();
          REQUIRE(kernels::launch_expert_ffn<spec::generic>(Tag{}, a, nullptr) == Status::kSuccess);
          QFLASH_TEST_CUDA(cudaDeviceSynchronize());
          auto const r = test::all_close<float, float>(out.download(), cpu, test::Tolerance{3e-3, 2e-4});
          CHECK_MESSAGE(r.ok, "GPU on uploaded weights vs CPU: ", r.report);
        }
      }
    };
    run(arch::Sm80{});
    run(arch::Sm90a{});
  }
}
