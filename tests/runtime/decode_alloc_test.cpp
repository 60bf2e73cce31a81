// A warm decode step allocates nothing: this executable replaces the global operator new
// and counts every allocation, from every thread, while tokens go through Model::forward.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "qflash/core/parallel.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/spec/presets.hpp"

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations{0};

void* allocate(std::size_t n, std::size_t align) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  n = n ? n : 1;
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align) : std::malloc(n);
  if (!p) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t n) { return allocate(n, 0); }
void* operator new[](std::size_t n) { return allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return allocate(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate(n, static_cast<std::size_t>(a)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

using namespace qflash;

TEST_CASE("a warm decode step of the default model allocates nothing, in every weight path and thread count") {
  std::string const dir = std::string(QFLASH_SOURCE_DIR) + "/models/qwen3_5_moe-micro";
  using runtime::WeightScheme;
  for (auto scheme : {WeightScheme::kAuto, WeightScheme::kQ8_0, WeightScheme::kF32, WeightScheme::kFp8,
                      WeightScheme::kQ4KM, WeightScheme::kInt4})
    for (int threads : {1, 2}) {
      CAPTURE(runtime::to_string(scheme));
      CAPTURE(threads);
      set_max_threads(threads);
      runtime::LoadOptions o;
      o.progress = false;
      o.weights = scheme;
      auto m = runtime::load_model_as<spec::qwen3_5_moe_micro>(dir, o);
      auto state = m->new_sequence();
      state.reserve(64);
      std::vector<float> logits;
      std::vector<std::int32_t> const prompt{1, 2, 3, 4, 5, 6, 7, 8};
      model::SequenceChunk chunk{prompt, &state};
      m->forward(std::span(&chunk, 1), model::LogitsFor::kLastToken, logits);
      std::int32_t token = 9;
      auto step = [&] {
        chunk = {std::span(&token, 1), &state};
        m->forward(std::span(&chunk, 1), model::LogitsFor::kLastToken, logits);
      };
      for (int i = 0; i < 3; ++i) step();  // warm: scratch and thread-local buffers reach their sizes
      g_allocations = 0;
      g_counting = true;
      for (int i = 0; i < 8; ++i) step();
      g_counting = false;
      CHECK(g_allocations.load() == 0);
    }
  set_max_threads(0);
}
