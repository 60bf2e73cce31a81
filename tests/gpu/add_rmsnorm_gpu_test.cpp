// add + RMSNorm on CUDA: every compiled instance (spec x arch) that this device can run, against
// ref::add_rmsnorm and the CPU twin, over the CPU test's shapes plus wide rows, many rows,
// misaligned views and y aliasing x. Tolerances: tests/kernels/add_rmsnorm_common.hpp.
//
// A host .cpp (cuda_runtime.h only) linked with qflash_cuda_instances. Its own main exits 77
// (ctest: Skipped) when there is no CUDA device, or when no compiled arch runs on it.
#include "gpu/gpu_main.hpp"

#include <algorithm>
#include <array>
#include <string>
#include <utility>
#include <vector>

#include "kernels/add_rmsnorm_common.hpp"
#include "qflash/kernels/add_rmsnorm/cpu.hpp"

using namespace qflash;
using namespace qflash::test::add_rmsnorm;
using kernels::launch_add_rmsnorm;
using test::gpu::compiled;
using test::gpu::g_device;

namespace {

/// Device memory for one host Buffer, `pad` elements before it (to misalign the view).
class DeviceBuffer {
 public:
  DeviceBuffer(Buffer const& host, std::size_t pad) : pad_bytes_(pad * size_of(host.dtype)) {
    QFLASH_TEST_CUDA(cudaMalloc(&base_, pad_bytes_ + host.bytes() + 16));
    if (host.bytes() > 0)
      QFLASH_TEST_CUDA(cudaMemcpy(data(), host.data(), host.bytes(), cudaMemcpyHostToDevice));
  }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
  ~DeviceBuffer() { cudaFree(base_); }

  void* data() { return static_cast<char*>(base_) + pad_bytes_; }
  void download(Buffer& host) {
    if (host.bytes() > 0)
      QFLASH_TEST_CUDA(cudaMemcpy(host.data(), data(), host.bytes(), cudaMemcpyDeviceToHost));
  }

 private:
  void* base_ = nullptr;
  std::size_t pad_bytes_;
};

struct GpuRun {
  std::size_t pad = 0;   // elements: 1 misaligns every view (scalar-access kernels)
  bool y_is_x = false;   // write y over x
};

/// Runs a copy of `input` through `launch_add_rmsnorm<S>(Tag{}, ...)` on a non-default stream.
template <MoeSpec S, class Tag>
Status run_gpu(Problem& p, GpuRun how = {}) {
  DeviceBuffer x(p.x, how.pad), residual(p.residual, how.pad), weight(p.weight, how.pad), y(p.y, how.pad);
  AddRmsNormArgs a = p.args();
  a.x = x.data();
  a.residual = p.c.with_residual ? residual.data() : nullptr;
  a.weight = weight.data();
  a.y = how.y_is_x ? x.data() : y.data();
  cudaStream_t stream = nullptr;
  QFLASH_TEST_CUDA(cudaStreamCreate(&stream));
  Status const st = launch_add_rmsnorm<S>(Tag{}, a, stream);
  cudaError_t const sync = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  REQUIRE_MESSAGE(sync == cudaSuccess, "kernel failed: ", cudaGetErrorString(sync));
  if (st == Status::kSuccess) {
    (how.y_is_x ? x : y).download(p.y);
    residual.download(p.residual);
  }
  return st;
}

/// GPU result of `c` vs the reference and vs the CPU kernel.
template <MoeSpec S, class Tag>
void check_case(Case const& c, GpuRun how = {}) {
  CAPTURE(to_string(c));
  CAPTURE(how.pad);
  CAPTURE(how.y_is_x);
  Problem const input(c);
  Problem const want = [&] {
    Problem p = input;
    REQUIRE(kernels::ref::add_rmsnorm(p.args()) == Status::kSuccess);
    return p;
  }();
  Problem got = input;
  REQUIRE(run_gpu<S, Tag>(got, how) == Status::kSuccess);
  check_matches_reference(got, want);

  Problem cpu = input;
  REQUIRE(launch_add_rmsnorm<S>(arch::Cpu{}, cpu.args()) == Status::kSuccess);
  auto const g = got.y.values();
  auto const w = cpu.y.values();
  auto const close = all_close(std::span<double const>(g), std::span<double const>(w),
                               tolerance_for(c.dtype));
  CHECK_MESSAGE(close.ok, "GPU vs CPU twin: ", close.report);
  if (c.with_residual) CHECK(got.residual == cpu.residual);
}

template <class Tag, std::size_t I>
void check_instance() {
  constexpr MoeSpec S = instances::kSpecs[I];
  CAPTURE(instances::kSpecNames[I]);
  CAPTURE(Tag::name);
  if constexpr (S.d_model != kDynamic) {
    for (Case const& c : all_cases(std::array{S.d_model}, std::array<std::int64_t, 4>{1, 3, 17, 257}))
      check_case<S, Tag>(c);
    // Rows beyond the grid cap (blocks loop over rows), misaligned views, in place.
    if (test::gpu::kLargeCases)
      check_case<S, Tag>(Case{DType::kBF16, DType::kBF16, NormWeight::kZeroCentered, true, 66000, S.d_model});
    for (Case const& c : all_cases(std::array{S.d_model}, std::array<std::int64_t, 1>{5})) {
      check_case<S, Tag>(c, GpuRun{1, false});
      check_case<S, Tag>(c, GpuRun{0, true});
    }
    // A width the spec does not have is refused before any launch.
    Problem wrong(Case{DType::kF32, DType::kF32, NormWeight::kPlain, true, 3, S.d_model + 8});
    CHECK(run_gpu<S, Tag>(wrong) == Status::kErrorInvalidProblem);
  } else {
    constexpr int kGpuWidths[] = {1, 31, 71, 129, 1000, 2048, 4096, 16384};
    for (Case const& c : all_cases(kGpuWidths, std::array<std::int64_t, 4>{1, 3, 17, 257}))
      check_case<S, Tag>(c);
    // Grid-stride loops of the block and the warp kernels.
    if (test::gpu::kLargeCases) {
      check_case<S, Tag>(Case{DType::kBF16, DType::kF32, NormWeight::kPlain, true, 70000, 129});
      check_case<S, Tag>(Case{DType::kF32, DType::kBF16, NormWeight::kZeroCentered, true, 600000, 32});
    }
    for (Case const& c : all_cases(std::array{71, 1000, 4096}, std::array<std::int64_t, 1>{5})) {
      check_case<S, Tag>(c, GpuRun{1, false});
      check_case<S, Tag>(c, GpuRun{0, true});
    }
  }
}


template <class Tag>
void check_arch() {
  if constexpr (compiled<Tag>()) {
    if (!arch::can_run(Tag::id, g_device.major, g_device.minor)) {
      // Code for another GPU must fail loudly (no kernel image), never run or pass silently.
      MESSAGE(Tag::name, " cannot run on cc ", g_device.major, ".", g_device.minor,
              ": checking that its launch reports an error");
      Problem p(Case{DType::kBF16, DType::kBF16, NormWeight::kPlain, true, 3, 2048});
      CHECK(run_gpu<spec::generic, Tag>(p) == Status::kErrorCuda);
      return;
    }
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (check_instance<Tag, I>(), ...);
    }(std::make_index_sequence<instances::kSpecs.size()>{});
  } else {
    MESSAGE(Tag::name, " is not compiled in this build (QFLASH_CUDA_ARCHS)");
  }
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("the compiled arch selected for this device") {
    auto const selected = arch::select_cuda_arch(instances::kArchs, g_device.major, g_device.minor);
    REQUIRE(selected.has_value());
    MESSAGE(g_device.name, " (cc ", g_device.major, ".", g_device.minor, "): runs ",
            arch::to_string(*selected));
  }
  TEST_CASE("add_rmsnorm sm80 instances match ref and the CPU") { check_arch<arch::Sm80>(); }
  TEST_CASE("add_rmsnorm sm90a instances match ref and the CPU") { check_arch<arch::Sm90a>(); }
}
