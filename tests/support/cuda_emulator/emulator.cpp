// The CUDA emulator's scheduler (a block's threads as fibers on one host thread) and the CUDA
// runtime calls qflash makes, on host memory. See emulator.hpp for what it models.
#include "cuda_emulator/emulator.hpp"

#include <sys/mman.h>

#include <boost/context/fiber.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mma_emulator.hpp"

struct CUstream_st {
  std::vector<std::function<void()>>* capture = nullptr;  // the graph being captured, if any
};
struct CUevent_st {
  std::chrono::steady_clock::time_point at{};
};
struct CUgraph_st {
  std::vector<std::function<void()>> ops;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> ops;
};

namespace qflash::emulator {
namespace {

[[noreturn]] void fail(std::string const& what) {
  std::fprintf(stderr, "CUDA emulator: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

constexpr std::size_t kStackBytes = std::size_t{512} << 10;
constexpr std::size_t kGuardBytes = 4096;
constexpr std::size_t kDefaultSmemLimit = 48 << 10;
// The device it claims: compute capability 8.0 (an A100's limits), so the sm_80 instances run.
// The sm_90a ones differ from them only behind __CUDA_ARCH__, which the emulator does not take.
constexpr int kMajor = 8;
constexpr int kMinor = 0;
constexpr std::size_t kSmemOptInLimit = 163 << 10;
constexpr int kMultiprocessors = 8;
constexpr std::size_t kGlobalBytes = std::size_t{16} << 30;

/// A fiber's stack, with an inaccessible page below it (an overflow faults).
class Stack {
 public:
  Stack() {
    base_ = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) fail("cannot map a fiber stack");
    mprotect(base_, kGuardBytes, PROT_NONE);
  }
  Stack(Stack const&) = delete;
  Stack& operator=(Stack const&) = delete;
  ~Stack() { munmap(base_, kStackBytes + kGuardBytes); }
  /// Boost.Context's stack allocator interface, over this one stack.
  boost::context::stack_context allocate() {
    boost::context::stack_context s;
    s.size = kStackBytes;
    s.sp = static_cast<char*>(base_) + kGuardBytes + kStackBytes;
    return s;
  }
  void deallocate(boost::context::stack_context&) {}

 private:
  void* base_;
};

/// A Stack lent to one fiber.
class LentStack {
 public:
  explicit LentStack(Stack& s) : s_(&s) {}
  boost::context::stack_context allocate() { return s_->allocate(); }
  void deallocate(boost::context::stack_context& c) { s_->deallocate(c); }

 private:
  Stack* s_;
};

struct Copy {
  void* dst;
  void const* src;
  int bytes;
  int src_bytes;
};

enum class State { kReady, kAtBarrier, kAtWarp, kDone };

struct Fiber {
  boost::context::fiber context;    // the thread's, while it is suspended
  boost::context::fiber scheduler;  // the scheduler's, while the thread runs
  Coordinates at;
  int linear = 0;
  State state = State::kReady;
  std::vector<Copy> uncommitted;
  std::deque<std::vector<Copy>> committed;
};

struct Warp {
  unsigned arrived = 0;
  unsigned mask = 0;
  Combine combine = nullptr;
  std::array<Slot, 32> in{};
  std::array<Slot, 32> out{};
};

/// The block being run: its threads, warps, dynamic shared memory and the threads ready to run.
struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<std::byte> shared;
  std::function<void()> const* body = nullptr;
  std::deque<Fiber*> ready;
  Fiber* current = nullptr;
  int live = 0;
  int at_barrier = 0;
  std::string name;
};

Block* g_block = nullptr;
std::vector<std::unique_ptr<Stack>> g_stacks;
std::mutex g_launch_mutex;  // one launch at a time: the fibers share g_block
thread_local cudaError_t g_last_error = cudaSuccess;

std::mutex g_limits_mutex;
std::map<void const*, int>& smem_limits() {  // under g_limits_mutex
  static std::map<void const*, int> limits;
  return limits;
}

void yield() {
  Fiber& f = *g_block->current;
  f.scheduler = std::move(f.scheduler).resume();
}

void make_ready(Fiber& f) {
  f.state = State::kReady;
  g_block->ready.push_back(&f);
}

void release_barrier() {
  for (Fiber& f : g_block->fibers)
    if (f.state == State::kAtBarrier) make_ready(f);
  g_block->at_barrier = 0;
}

boost::context::fiber fiber_entry(Fiber& f, boost::context::fiber&& scheduler) {
  f.scheduler = std::move(scheduler);
  (*g_block->body)();
  f.state = State::kDone;
  --g_block->live;
  // Threads that have returned no longer hold a barrier back.
  if (g_block->at_barrier > 0 && g_block->at_barrier == g_block->live) release_barrier();
  return std::move(f.scheduler);
}

std::string describe_deadlock(Block const& b) {
  std::string s = b.name + " deadlocked: ";
  int barrier = 0, done = 0;
  for (Fiber const& f : b.fibers) barrier += f.state == State::kAtBarrier, done += f.state == State::kDone;
  s += std::to_string(barrier) + " threads wait at __syncthreads, " + std::to_string(done) + " have returned";
  for (std::size_t w = 0; w < b.warps.size(); ++w)
    if (b.warps[w].arrived) {
      char buf[128];
      std::snprintf(buf, sizeof buf, "; warp %zu: lanes 0x%08x of 0x%08x at a warp collective", w, b.warps[w].arrived,
                    b.warps[w].mask);
      s += buf;
    }
  return s;
}

void run_block(Block& b, dim3 block_idx) {
  int const n = static_cast<int>(b.fibers.size());
  std::fill(b.shared.begin(), b.shared.end(), std::byte{0xff});
  for (Warp& w : b.warps) w.arrived = 0;
  b.ready.clear();
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.context = boost::context::fiber(std::allocator_arg, LentStack(*g_stacks[i]),
                                      [&f](boost::context::fiber&& s) { return fiber_entry(f, std::move(s)); });
    f.at.block_idx = {block_idx.x, block_idx.y, block_idx.z};
    f.uncommitted.clear();
    f.committed.clear();
    f.state = State::kReady;
    b.ready.push_back(&f);
  }
  b.live = n;
  b.at_barrier = 0;
  while (b.live > 0) {
    if (b.ready.empty()) fail(describe_deadlock(b));
    b.current = b.ready.front();
    b.ready.pop_front();
    b.current->context = std::move(b.current->context).resume();
  }
}

void run_launch(dim3 grid, dim3 block, std::size_t smem, std::function<void()> const& body) {
  std::lock_guard lock(g_launch_mutex);
  int const n = static_cast<int>(block.x * block.y * block.z);
  Block b;
  b.body = &body;
  b.fibers.resize(n);
  b.warps.resize((n + 31) / 32);
  b.shared.resize(smem);
  while (static_cast<int>(g_stacks.size()) < n) g_stacks.push_back(std::make_unique<Stack>());
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.at.thread_idx = {i % block.x, i / block.x % block.y, i / (block.x * block.y)};
    f.at.block_dim = block;
    f.at.grid_dim = grid;
  }
  g_block = &b;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.name = "block (" + std::to_string(x) + ", " + std::to_string(y) + ", " + std::to_string(z) + ")";
        run_block(b, dim3(x, y, z));
      }
  g_block = nullptr;
}

void perform(std::vector<Copy> const& group) {
  for (Copy const& c : group) {
    std::memcpy(c.dst, c.src, static_cast<std::size_t>(c.src_bytes));
    std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, static_cast<std::size_t>(c.bytes - c.src_bytes));
  }
}

template <int kKind>
void shuffle_combine(std::array<Slot, 32> const& in, std::array<Slot, 32>& out, unsigned mask) {
  for (int lane = 0; lane < 32; ++lane) {
    if (!(mask >> lane & 1)) continue;
    int const arg = static_cast<int>(in[lane][10]), width = static_cast<int>(in[lane][11]);
    int const base = lane & ~(width - 1), within = lane - base;
    int src = lane;
    if constexpr (kKind == kShuffleXor) src = base + ((within ^ arg) & (width - 1));
    if constexpr (kKind == kShuffleIndex) src = base + (arg & (width - 1));
    if constexpr (kKind == kShuffleUp) src = within >= arg ? lane - arg : lane;
    if constexpr (kKind == kShuffleDown) src = within + arg < width ? lane + arg : lane;
    if (!(mask >> src & 1)) fail("a shuffle reads lane " + std::to_string(src) + ", which is not in its mask");
    out[lane] = in[src];
  }
}

}  // namespace

Coordinates const& self() {
  if (!g_block || !g_block->current) fail("threadIdx and its kind read outside a kernel");
  return g_block->current->at;
}

void sync_block() {
  Block& b = *g_block;
  if (++b.at_barrier == b.live) {
    release_barrier();
    return;
  }
  b.current->state = State::kAtBarrier;
  yield();
}

Slot warp_collective(unsigned mask, Combine combine, Slot const& in) {
  Block& b = *g_block;
  Fiber& f = *b.current;
  int const lane = f.linear % 32;
  Warp& w = b.warps[f.linear / 32];
  if (!(mask >> lane & 1))
    fail(b.name + ": lane " + std::to_string(lane) + " calls a warp collective without its own bit in the mask");
  if (w.arrived == 0) {
    w.mask = mask;
    w.combine = combine;
  } else if (w.mask != mask || w.combine != combine) {
    char buf[160];
    std::snprintf(buf, sizeof buf, ": lanes of warp %d meet at different warp collectives (masks 0x%08x and 0x%08x)",
                  f.linear / 32, w.mask, mask);
    fail(b.name + buf);
  }
  w.in[lane] = in;
  w.arrived |= 1u << lane;
  if ((w.arrived & mask) == mask) {
    combine(w.in, w.out, mask);
    w.arrived = 0;
    for (int l = 0; l < 32; ++l)
      if (l != lane && (mask >> l & 1)) make_ready(b.fibers[f.linear / 32 * 32 + l]);
    return w.out[lane];
  }
  f.state = State::kAtWarp;
  yield();
  return w.out[lane];
}

Slot shuffle(unsigned mask, Slot const& v, int kind, int arg, int width) {
  Slot in = v;
  in[10] = static_cast<std::uint32_t>(arg);
  in[11] = static_cast<std::uint32_t>(width);
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail("shuffle width " + std::to_string(width) + " is not a power of 2 up to 32");
  Combine const combine = kind == kShuffleXor     ? shuffle_combine<kShuffleXor>
                          : kind == kShuffleIndex ? shuffle_combine<kShuffleIndex>
                          : kind == kShuffleUp    ? shuffle_combine<kShuffleUp>
                                                  : shuffle_combine<kShuffleDown>;
  return warp_collective(mask, combine, in);
}

std::uint32_t reduce_add(unsigned mask, std::uint32_t v) {
  Slot in{};
  in[0] = v;
  Slot const out = warp_collective(
      mask,
      [](std::array<Slot, 32> const& lanes, std::array<Slot, 32>& result, unsigned m) {
        std::uint32_t sum = 0;
        for (int l = 0; l < 32; ++l)
          if (m >> l & 1) sum += lanes[l][0];
        for (int l = 0; l < 32; ++l) result[l][0] = sum;
      },
      in);
  return out[0];
}

void* dynamic_shared() { return g_block->shared.data(); }

void launch(dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, int sm, void const* kernel,
            std::function<void()> body) {
  // sm_90a code runs only on cc 9.0; sm_80 code (with its PTX) on 8.0 and later.
  int const cc = kMajor * 10 + kMinor;
  if (sm >= 90 ? cc != sm : cc < sm) {
    g_last_error = cudaErrorNoKernelImageForDevice;
    return;
  }
  std::size_t const threads = std::size_t{block.x} * block.y * block.z;
  int const limit = [&] {
    std::lock_guard lock(g_limits_mutex);
    auto const it = smem_limits().find(kernel);
    return it == smem_limits().end() ? static_cast<int>(kDefaultSmemLimit) : it->second;
  }();
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || grid.x > 0x7fffffffu) {
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (smem > static_cast<std::size_t>(limit)) {
    std::fprintf(stderr,
                 "CUDA emulator: a launch asks for %zu bytes of dynamic shared memory; the kernel's limit is %d\n",
                 smem, limit);
    g_last_error = cudaErrorInvalidValue;
    return;
  }
  if (stream && stream->capture) {
    stream->capture->push_back([grid, block, smem, body = std::move(body)] { run_launch(grid, block, smem, body); });
    return;
  }
  run_launch(grid, block, smem, body);
}

void async_copy(void* dst, void const* src, int bytes, int src_bytes) {
  auto const misaligned = [&](void const* p) {
    return reinterpret_cast<std::uintptr_t>(p) % static_cast<unsigned>(bytes) != 0;
  };
  if (misaligned(dst) || (src_bytes && misaligned(src)))
    fail(g_block->name + ": cp.async of " + std::to_string(bytes) + " bytes at a misaligned address");
  g_block->current->uncommitted.push_back({dst, src, bytes, src_bytes});
}
void async_commit() {
  Fiber& f = *g_block->current;
  f.committed.push_back(std::move(f.uncommitted));
  f.uncommitted.clear();
}
void async_wait(int pending) {
  Fiber& f = *g_block->current;
  while (static_cast<int>(f.committed.size()) > pending) {
    perform(f.committed.front());
    f.committed.pop_front();
  }
}

namespace {

/// The last lane to arrive at an mma.sync: every lane's c from every lane's fragments (words 0-3
/// a, 4-5 b, 6-9 c).
template <class FragA, class FragB, auto kEmulate>
void mma_combine(std::array<Slot, 32> const& lanes, std::array<Slot, 32>& result, unsigned) {
  std::array<test::Acc, 32> acc;
  std::array<FragA, 32> a;
  std::array<FragB, 32> b;
  for (int l = 0; l < 32; ++l) {
    std::memcpy(a[l].data(), &lanes[l][0], 16);
    std::memcpy(b[l].data(), &lanes[l][4], 8);
    std::memcpy(acc[l].data(), &lanes[l][6], 16);
  }
  kEmulate(acc, a, b);
  for (int l = 0; l < 32; ++l) std::memcpy(&result[l][0], acc[l].data(), 16);
}

template <class FragA, class FragB, auto kEmulate>
void mma(float (&c)[4], void const* a, void const* b) {
  Slot in{};
  std::memcpy(&in[0], a, 16);
  std::memcpy(&in[4], b, 8);
  std::memcpy(&in[6], c, 16);
  Slot const out = warp_collective(0xffffffffu, mma_combine<FragA, FragB, kEmulate>, in);
  std::memcpy(c, &out[0], 16);
}

}  // namespace

void mma_bf16(float (&c)[4], std::uint32_t const (&a)[4], std::uint32_t const (&b)[2]) {
  mma<test::Regs4, test::Regs2, test::emulate_mma>(c, a, b);
}
void mma_tf32(float (&c)[4], float const (&a)[4], float const (&b)[2]) {
  mma<test::Floats4, test::Floats2, test::emulate_mma_tf32>(c, a, b);
}

void set_smem_limit(void const* kernel, int bytes) {
  std::lock_guard lock(g_limits_mutex);
  smem_limits()[kernel] = bytes;
}

}  // namespace qflash::emulator

// ---- The CUDA runtime calls qflash makes, on host memory. ------------------------------------

namespace {

using qflash::emulator::g_last_error;

std::mutex g_memory_mutex;
std::map<void*, std::size_t>& allocations() {
  static std::map<void*, std::size_t> a;
  return a;
}
std::size_t g_allocated = 0;

cudaError_t record(cudaError_t e) {
  if (e != cudaSuccess) g_last_error = e;
  return e;
}

cudaError_t allocate(void** p, std::size_t size) {
  if (!p) return record(cudaErrorInvalidValue);
  std::lock_guard lock(g_memory_mutex);
  if (g_allocated + size > qflash::emulator::kGlobalBytes) return record(cudaErrorMemoryAllocation);
  *p = std::aligned_alloc(256, (std::max<std::size_t>(size, 1) + 255) / 256 * 256);
  if (!*p) return record(cudaErrorMemoryAllocation);
  std::memset(*p, 0xff, size);  // uninitialized device memory reads as NaN
  allocations()[*p] = size;
  g_allocated += size;
  return cudaSuccess;
}

cudaError_t release(void* p) {
  if (!p) return cudaSuccess;
  std::lock_guard lock(g_memory_mutex);
  auto const it = allocations().find(p);
  if (it == allocations().end()) return record(cudaErrorInvalidValue);
  g_allocated -= it->second;
  allocations().erase(it);
  std::free(p);
  return cudaSuccess;
}

/// Runs op now, or records it when the stream is being captured.
cudaError_t on_stream(cudaStream_t stream, std::function<void()> op) {
  if (stream && stream->capture)
    stream->capture->push_back(std::move(op));
  else
    op();
  return cudaSuccess;
}

}  // namespace

extern "C" {

cudaError_t cudaMalloc(void** p, std::size_t size) { return allocate(p, size); }
cudaError_t cudaMallocManaged(void** p, std::size_t size, unsigned) { return allocate(p, size); }
cudaError_t cudaMallocHost(void** p, std::size_t size) { return allocate(p, size); }
cudaError_t cudaMallocAsync(void** p, std::size_t size, cudaStream_t) { return allocate(p, size); }
cudaError_t cudaFree(void* p) { return release(p); }
cudaError_t cudaFreeHost(void* p) { return release(p); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t) { return release(p); }

cudaError_t cudaMemGetInfo(std::size_t* free, std::size_t* total) {
  std::lock_guard lock(g_memory_mutex);
  *total = qflash::emulator::kGlobalBytes;
  *free = *total - g_allocated;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, void const* src, std::size_t n, cudaMemcpyKind) {
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, void const* src, std::size_t n, cudaMemcpyKind, cudaStream_t stream) {
  return on_stream(stream, [=] {
    if (n) std::memmove(dst, src, n);
  });
}
cudaError_t cudaMemset(void* p, int value, std::size_t n) {
  std::memset(p, value, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t n, cudaStream_t stream) {
  return on_stream(stream, [=] { std::memset(p, value, n); });
}

cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : record(cudaErrorInvalidDevice); }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "qflash CUDA emulator");
  prop->major = qflash::emulator::kMajor;
  prop->minor = qflash::emulator::kMinor;
  prop->multiProcessorCount = qflash::emulator::kMultiprocessors;
  prop->totalGlobalMem = qflash::emulator::kGlobalBytes;
  prop->sharedMemPerBlock = qflash::emulator::kDefaultSmemLimit;
  prop->sharedMemPerBlockOptin = qflash::emulator::kSmemOptInLimit;
  prop->maxThreadsPerBlock = 1024;
  prop->warpSize = 32;
  prop->l2CacheSize = 40 << 20;
  prop->memoryBusWidth = 5120;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = qflash::emulator::kMultiprocessors; return cudaSuccess;
    case cudaDevAttrL2CacheSize: *value = 40 << 20; return cudaSuccess;
    case cudaDevAttrGlobalMemoryBusWidth: *value = 5120; return cudaSuccess;
    case cudaDevAttrMemoryClockRate: *value = 2619000; return cudaSuccess;  // kHz
    case cudaDevAttrComputeCapabilityMajor: *value = qflash::emulator::kMajor; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = qflash::emulator::kMinor; return cudaSuccess;
    default: return record(cudaErrorInvalidValue);
  }
}
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

cudaError_t cudaFuncSetAttribute(void const* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || static_cast<std::size_t>(value) > qflash::emulator::kSmemOptInLimit)
    return record(cudaErrorInvalidValue);
  qflash::emulator::set_smem_limit(func, value);
  return cudaSuccess;
}

cudaError_t cudaGetLastError() { return std::exchange(g_last_error, cudaSuccess); }
cudaError_t cudaPeekAtLastError() { return g_last_error; }
char const* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    default: return "cudaError (emulated)";
  }
}
char const* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new CUstream_st;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  return s && s->capture ? record(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  return on_stream(stream, [e] { e->at = std::chrono::steady_clock::now(); });
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (!s || s->capture) return record(cudaErrorStreamCaptureUnsupported);
  s->capture = new std::vector<std::function<void()>>;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  *status = s && s->capture ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  if (!s || !s->capture) return record(cudaErrorStreamCaptureUnsupported);
  *graph = new CUgraph_st{std::move(*s->capture)};
  delete s->capture;
  s->capture = nullptr;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  *exec = new CUgraphExec_st{graph->ops};
  return cudaSuccess;
}
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo* info) {
  exec->ops = graph->ops;
  if (info) *info = cudaGraphExecUpdateResultInfo{};
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  for (auto const& op : exec->ops) on_stream(stream, op);
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}

}  // extern "C"
