// A user-defined MoE spec, checked at compile time, and the fused add+RMSNorm kernel
// instantiated for it on the CPU and compared with the scalar reference.
#include <cmath>
#include <cstdio>
#include <vector>

#include <qflash/qflash.hpp>

namespace {

constexpr qflash::MoeSpec kMySpec{
    .family = qflash::ModelFamily::kQwen35Moe,
    .d_model = 96,
    .n_head = 4,
    .n_head_kv = 2,
    .d_head = 32,
    .n_expert = 16,
    .n_expert_used = 2,
    .d_ff_expert = 64,
    .d_ff_shared = 64,
    .n_head_k_linear = 2,
    .n_head_v_linear = 4,
    .d_head_k_linear = 16,
    .d_head_v_linear = 16,
    .d_conv = 4,
    .kv = qflash::KvScheme::kBf16,
    .weights = qflash::WeightFormat::kF32,
};
static_assert(qflash::valid(kMySpec), "consumer spec must be valid");

}  // namespace

int main() {
  using namespace qflash;
  constexpr int rows = 3, cols = kMySpec.d_model;
  std::vector<float> x(rows * cols), res(rows * cols), w(cols), y(rows * cols);
  for (int i = 0; i < rows * cols; ++i) {
    x[i] = std::sin(0.1f * i);
    res[i] = std::cos(0.07f * i);
  }
  for (int i = 0; i < cols; ++i) w[i] = 0.01f * i;
  std::vector<float> res_ref = res, y_ref(rows * cols);

  kernels::AddRmsNormArgs a{};
  a.x = x.data();
  a.residual = res.data();
  a.weight = w.data();
  a.y = y.data();
  a.n_rows = rows;
  a.n_cols = cols;
  a.weight_kind = kernels::NormWeight::kZeroCentered;
  if (Status s = kernels::launch_add_rmsnorm<kMySpec>(arch::Cpu{}, a); s != Status::kSuccess) {
    std::printf("consumer: launch failed: %s\n", std::string(to_string(s)).c_str());
    return 1;
  }
  kernels::AddRmsNormArgs r = a;
  r.residual = res_ref.data();
  r.y = y_ref.data();
  kernels::ref::add_rmsnorm(r);
  for (int i = 0; i < rows * cols; ++i) {
    if (std::fabs(y[i] - y_ref[i]) > 1e-5f + 1e-5f * std::fabs(y_ref[i])) {
      std::printf("consumer: mismatch at %d: %g vs %g\n", i, y[i], y_ref[i]);
      return 1;
    }
  }
  std::printf("consumer: %s OK\n", to_string(kMySpec).c_str());
  return 0;
}
