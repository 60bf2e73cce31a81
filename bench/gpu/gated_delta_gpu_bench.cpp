// The gated delta rule on CUDA at Qwen3.6-35B-A3B's Gated DeltaNet shape (16 q/k heads, 32
// value heads, d_k = d_v = 128): time per call (CUDA events) of one sequence's prompt of 16
// tokens (the recurrence, as every call of up to 16 tokens runs) and of 64, 512 and 4096 tokens
// in the chunked form (chunks of 64: chunk_kernel, then the state pass, both on tensor cores),
// each against the recurrence over the same tokens; with tokens per second and the chunked
// form's TFLOP/s (its matrix products, counted below).
//
//   build/ci/bench/gpu/gated_delta_gpu_bench     (exits 77 without a CUDA device)
//
// Inputs are fixed pseudo-random values in a trained layer's ranges (decays g in [-0.5, 0],
// β in [0, 1]); the state carries over from call to call. Each timed call is the mean of 10
// after 2 warm-up calls (3 and 1 for the recurrence over 4096 tokens). Every compiled arch
// this device can run is measured, with the qwen3_6_35b_a3b instance when it is compiled, else
// the first whose Gated DeltaNet shape is dynamic.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gpu_bench.hpp"
#include "qflash/generated/instances.hpp"
#include "qflash/kernels/gated_delta/op.hpp"
#include "qflash/spec/presets.hpp"

using namespace qflash;
using namespace qflash::bench::gpu;
using qflash::kernels::DeltaRuleForm;
using qflash::kernels::GatedDeltaArgs;

namespace {

constexpr int kHeadsK = 16, kHeadsV = 32, kDk = 128, kDv = 128, kChunk = 64;
constexpr std::int64_t kMaxTokens = 4096;

/// The spec to bench: Qwen3.6's when compiled, else the first with a dynamic Gated DeltaNet.
constexpr std::size_t bench_spec_index() {
  for (std::size_t i = 0; i < instances::kSpecs.size(); ++i)
    if (instances::kSpecs[i] == spec::qwen3_6_35b_a3b) return i;
  for (std::size_t i = 0; i < instances::kSpecs.size(); ++i)
    if (MoeSpec const& s = instances::kSpecs[i]; s.n_head_k_linear == kDynamic && s.d_head_k_linear == kDynamic &&
                                                 s.n_head_v_linear == kDynamic && s.d_head_v_linear == kDynamic)
      return i;
  return instances::kSpecs.size();
}

/// Multiply-adds of the chunked form's products per value head and chunk of c tokens: Q Kᵀ and
/// K Kᵀ (lower triangles), the substitution for W and U, then W S, e^γ q̂ S, (Q Kᵀ ⊙ Γ) V' and
/// kdᵀ V'.
double chunk_macs(double c) {
  return c * c * kDk + c * c / 2 * (kDk + kDv) + 2 * c * kDk * kDv + c * c / 2 * kDv + c * kDk * kDv;
}

float* device_copy(std::vector<float> const& host) {
  float* d = nullptr;
  if (!ok(cudaMalloc(&d, host.size() * sizeof(float)), "cudaMalloc")) return nullptr;
  ok(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}

std::vector<float> uniform(std::size_t n, std::uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <class Tag>
void bench_arch(int major, int minor, cudaStream_t stream) {
  constexpr std::size_t I = bench_spec_index();
  if constexpr (compiled<Tag>() && I < instances::kSpecs.size()) {
    constexpr MoeSpec S = instances::kSpecs[I];
    if (!runs_on<Tag>(major, minor)) return;
    std::size_t const qk = static_cast<std::size_t>(kMaxTokens * kHeadsK * kDk);
    std::size_t const vw = static_cast<std::size_t>(kMaxTokens * kHeadsV * kDv);
    std::size_t const gb = static_cast<std::size_t>(kMaxTokens * kHeadsV);
    float* const q = device_copy(uniform(qk, 1, -1, 1));
    float* const k = device_copy(uniform(qk, 2, -1, 1));
    float* const v = device_copy(uniform(vw, 3, -1, 1));
    float* const g = device_copy(uniform(gb, 4, -0.5f, 0.0f));
    float* const beta = device_copy(uniform(gb, 5, 0.0f, 1.0f));
    float* const state = device_copy(std::vector<float>(static_cast<std::size_t>(kHeadsV * kDk * kDv), 0.0f));
    float* out = nullptr;
    ok(cudaMalloc(&out, vw * sizeof(float)), "cudaMalloc");
    if (q && k && v && g && beta && state && out) {
      for (std::int64_t tokens : {std::int64_t{16}, std::int64_t{64}, std::int64_t{512}, kMaxTokens})
        for (DeltaRuleForm form : {DeltaRuleForm::kChunked, DeltaRuleForm::kRecurrent}) {
          if (tokens == 16 && form == DeltaRuleForm::kRecurrent) continue;  // 16 tokens run it either way
          GatedDeltaArgs a{};
          a.q = q, a.k = k, a.v = v, a.g = g, a.beta = beta, a.state = state, a.out = out;
          a.n_tokens = tokens;
          a.n_head_k = kHeadsK, a.n_head_v = kHeadsV, a.d_k = kDk, a.d_v = kDv;
          a.form = form, a.chunk_size = kChunk;
          Status st = Status::kSuccess;
          bool const long_run = form == DeltaRuleForm::kRecurrent && tokens == kMaxTokens;
          double const sec = time_calls(
              stream,
              [&] {
                Status const s = kernels::launch_gated_delta<S>(Tag{}, a, stream);
                if (s != Status::kSuccess) st = s;
              },
              long_run ? 1 : 2, long_run ? 3 : 10);
          cudaError_t const e = cudaStreamSynchronize(stream);
          std::string const name = tokens <= 16 ? "recurrent (16 or fewer tokens)" : std::string(to_string(form));
          if (st != Status::kSuccess || e != cudaSuccess) {
            std::printf("%-6s %5lld tokens %-30s FAILED (%s%s%s)\n", std::string(Tag::name).c_str(),
                        static_cast<long long>(tokens), name.c_str(), std::string(to_string(st)).c_str(),
                        e != cudaSuccess ? ", " : "", e != cudaSuccess ? cudaGetErrorString(e) : "");
            continue;
          }
          std::printf("%-6s %-16s %5lld tokens %-30s %10.1f us %9.0f tok/s", std::string(Tag::name).c_str(),
                      std::string(instances::kSpecNames[I]).c_str(), static_cast<long long>(tokens), name.c_str(), sec * 1e6,
                      static_cast<double>(tokens) / sec);
          if (form == DeltaRuleForm::kChunked && tokens > 16) {
            double const chunks = static_cast<double>(tokens) / kChunk;
            std::printf(" %6.2f TFLOP/s", 2 * chunks * kHeadsV * chunk_macs(kChunk) / sec / 1e12);
          }
          std::printf("\n");
        }
    }
    for (float* p : {q, k, v, g, beta, state, out}) cudaFree(p);
  } else if constexpr (compiled<Tag>()) {
    std::printf("%s: no compiled spec takes Qwen3.6's Gated DeltaNet shape, skipped\n", std::string(Tag::name).c_str());
  }
}

}  // namespace

int main() {
  return run_on_device([](int major, int minor, Roofs const&, cudaStream_t stream) {
    bench_arch<arch::Sm90a>(major, minor, stream);
    bench_arch<arch::Sm80>(major, minor, stream);
  });
}
