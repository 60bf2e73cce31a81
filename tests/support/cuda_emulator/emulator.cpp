// The CUDA emulator's scheduler (a block's threads as fibers on one host thread) and the CUDA
// runtime calls qflash makes, on host memory. See emulator.hpp for what it models.
#include "cuda_emulator/emulator.hpp"

#include <elf.h>
#include <link.h>
#include <signal.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <boost/context/fiber.hpp>

#include <atomic>
#include <charconv>
#include <chrono>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mma_emulator.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/mapped_file.hpp"

namespace qflash::emulator {
/// One piece of a stream's work; recorded while the stream is being captured, as a graph's node
/// (qflash captures one stream, so a graph is a chain of them).
enum class NodeType { kKernel, kMemcpy, kMemset };
struct Node {
  NodeType type;
  int operands = 0;  // a memcpy's memory types (source, destination), which an update may not change
  std::function<void()> run;
};
/// Runs `node` on `stream` now, or records it while the stream is being captured; fails as
/// CUDA does on a stream whose capture an invalid call broke, and on the legacy stream while a
/// blocking stream is being captured.
cudaError_t submit(cudaStream_t stream, Node node);
/// While a launch runs on this host thread (on), a fault in an allocation's guard page or in a
/// CUDA thread's stack guard is reported as the running CUDA thread's, and aborts; any other
/// fault goes to SIGSEGV's action before, which off restores.
void watch_faults(bool on);
}  // namespace qflash::emulator

struct CUstream_st {
  bool blocking = true;  // created without cudaStreamNonBlocking: ordered after the legacy stream
  std::vector<qflash::emulator::Node>* capture = nullptr;  // the graph being captured, if any
  std::uint64_t capture_id = 0;                            // which capture, of all
  // An invalid call during the capture (from any host thread): it ends with an error.
  std::atomic<bool> invalidated = false;
};
struct CUevent_st {
  std::chrono::steady_clock::time_point at{};
  cudaStream_t captured_on = nullptr;  // last recorded into this stream's capture, if so,
  std::uint64_t capture_id = 0;        // into this one
};
struct CUgraph_st {
  std::vector<qflash::emulator::Node> nodes;
};
struct CUgraphExec_st {
  std::vector<qflash::emulator::Node> nodes;
};

namespace qflash::emulator {
namespace {

[[noreturn]] void fail(std::string const& what) {
  std::fprintf(stderr, "CUDA emulator: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

/// The order in which the threads that become ready together (at the start of a block, at a
/// barrier's release, after a warp collective) run, and in which a launch's blocks run (see
/// emulator.hpp's set_schedule). A kernel whose result depends on it has a race: a thread
/// reads what another writes with no barrier or warp collective between them.
class Schedule {
 public:
  Schedule() {
    char const* v = std::getenv("QFLASH_EMULATOR_SCHEDULE");  // unset or empty: shuffled
    if (v && *v && !set(v)) fail("QFLASH_EMULATOR_SCHEDULE is '" + std::string(v) + "'; expected " + kForms);
  }
  static constexpr char const* kForms = "shuffled, shuffled:SEED, in-order or reversed";
  /// Takes one of kForms; false (and no change) for anything else.
  bool set(std::string_view s) {
    if (s == "in-order" || s == "reversed") {
      kind_ = s == "in-order" ? kInOrder : kReversed;
      return true;
    }
    std::uint64_t seed = 0;
    if (s != "shuffled") {
      constexpr std::string_view prefix = "shuffled:";
      if (!s.starts_with(prefix) || s.size() == prefix.size()) return false;
      auto const [at, error] = std::from_chars(s.data() + prefix.size(), s.data() + s.size(), seed);
      if (error != std::errc{} || at != s.data() + s.size()) return false;
    }
    kind_ = kShuffled;
    seed_ = seed;
    random_.seed(seed);
    return true;
  }
  /// The form set() takes for this schedule.
  [[nodiscard]] std::string name() const {
    return kind_ == kInOrder ? "in-order" : kind_ == kReversed ? "reversed" : "shuffled:" + std::to_string(seed_);
  }
  /// v, reordered as this schedule says.
  template <class T>
  void arrange(std::vector<T>& v) {
    if (kind_ == kReversed) std::reverse(v.begin(), v.end());
    if (kind_ == kShuffled) std::shuffle(v.begin(), v.end(), random_);
  }
  /// Whether a committed group of cp.async copies lands now, rather than at the wait that
  /// needs it: either is what a GPU may do, and the shuffled schedule takes either at random.
  bool lands_at_commit() { return kind_ == kShuffled && (random_() & 1); }
  /// 0, 1, ... n - 1 in this schedule's order.
  std::vector<int> const& order(int n) {
    order_.resize(static_cast<std::size_t>(n));
    std::iota(order_.begin(), order_.end(), 0);
    arrange(order_);
    return order_;
  }

 private:
  enum Kind { kInOrder, kReversed, kShuffled };
  Kind kind_ = kShuffled;
  std::uint64_t seed_ = 0;
  std::mt19937_64 random_{0};
  std::vector<int> order_;
};
Schedule& schedule() {  // under g_launch_mutex: launches use it one at a time
  static Schedule s;
  return s;
}

constexpr std::size_t kStackBytes = std::size_t{512} << 10;
/// The size of a page, and of a guard page.
std::size_t page_bytes() {
  static std::size_t const bytes = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return bytes;
}
constexpr std::size_t kDefaultSmemLimit = 48 << 10;
// The device it claims: compute capability 8.0 (an A100's limits), so the sm_80 instances run.
// The sm_90a ones differ from them only behind __CUDA_ARCH__, which the emulator does not take.
constexpr int kMajor = 8;
constexpr int kMinor = 0;
constexpr std::size_t kSmemOptInLimit = 163 << 10;
constexpr int kMultiprocessors = 8;
constexpr std::size_t kGlobalBytes = std::size_t{16} << 30;

/// A fiber's stack, with an inaccessible page below it (an overflow faults). Its top lies
/// `offset` bytes into its last page: the stacks' hot tops then fall in different cache sets.
class Stack {
 public:
  explicit Stack(std::size_t offset) : offset_(offset) {
    base_ = mmap(nullptr, kStackBytes + page_bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) fail("cannot map a fiber stack");
    mprotect(base_, page_bytes(), PROT_NONE);
  }
  Stack(Stack const&) = delete;
  Stack& operator=(Stack const&) = delete;
  ~Stack() { munmap(base_, kStackBytes + page_bytes()); }
  /// Whether `at` lies in the guard page, where an overflow faults.
  [[nodiscard]] bool guards(void const* at) const {
    auto const* const p = static_cast<char const*>(at);
    return p >= static_cast<char const*>(base_) && p < static_cast<char const*>(base_) + page_bytes();
  }
  /// Boost.Context's stack allocator interface, over this one stack.
  boost::context::stack_context allocate() {
    boost::context::stack_context s;
    s.size = kStackBytes - offset_;
    s.sp = static_cast<char*>(base_) + page_bytes() + kStackBytes - offset_;
    return s;
  }
  void deallocate(boost::context::stack_context&) {}

 private:
  void* base_;
  std::size_t offset_;
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

/// Static shared memory, which holds 0xff bytes at each block's start as dynamic shared memory
/// does. A kernel's __shared__ variables are its writable function-local statics (emulator.hpp):
/// the objects in the executable's symbol table whose names are local names of the kernel's own
/// (the Itanium ABI's `_ZZ<kernel's encoding>E...`). A __device__ function's own __shared__
/// variables are not found, and a kernel's plain static variables would be taken for shared.
class StaticShared {
 public:
  StaticShared() {
    try {
      file_ = MappedFile("/proc/self/exe");
    } catch (Error const& e) {
      std::fprintf(stderr, "CUDA emulator: %s\n", e.what());
    }
    find_symbols();
    dl_iterate_phdr(
        [](dl_phdr_info* info, std::size_t, void* bias) {
          *static_cast<std::uintptr_t*>(bias) = info->dlpi_addr;  // the executable comes first
          return 1;
        },
        &bias_);
    if (symbols_.empty())
      std::fprintf(stderr,
                   "CUDA emulator: the executable has no symbol table: static __shared__ variables keep what the "
                   "block before wrote\n");
  }

  void begin_launch(void const* kernel) {
    auto [it, added] = kernels_.try_emplace(kernel);
    if (added) it->second = variables_of(reinterpret_cast<std::uintptr_t>(kernel) - bias_, kernel);
    variables_ = &it->second;
  }
  void begin_block() const {
    for (std::span<std::byte> const v : *variables_) std::memset(v.data(), 0xff, v.size());
  }

 private:
  /// Whether [offset, offset + size) lies in the file.
  [[nodiscard]] bool in_file(std::uint64_t offset, std::uint64_t size) const {
    return offset <= file_.size() && size <= file_.size() - offset;
  }
  /// The executable's sections, symbol table and its names.
  void find_symbols() {
    if (file_.size() < sizeof(Elf64_Ehdr)) return;
    auto const* const header = reinterpret_cast<Elf64_Ehdr const*>(file_.data());
    if (std::memcmp(header->e_ident, ELFMAG, SELFMAG) != 0 || header->e_ident[EI_CLASS] != ELFCLASS64 ||
        header->e_shentsize != sizeof(Elf64_Shdr) ||
        !in_file(header->e_shoff, std::uint64_t{header->e_shnum} * sizeof(Elf64_Shdr)))
      return;
    sections_ = {reinterpret_cast<Elf64_Shdr const*>(file_.data() + header->e_shoff), header->e_shnum};
    for (Elf64_Shdr const& table : sections_) {
      if (table.sh_type != SHT_SYMTAB || table.sh_link >= sections_.size()) continue;
      Elf64_Shdr const& names = sections_[table.sh_link];
      if (!in_file(table.sh_offset, table.sh_size) || !in_file(names.sh_offset, names.sh_size)) return;
      symbols_ = {reinterpret_cast<Elf64_Sym const*>(file_.data() + table.sh_offset), table.sh_size / sizeof(Elf64_Sym)};
      names_ = {reinterpret_cast<char const*>(file_.data() + names.sh_offset), names.sh_size};
      return;
    }
  }
  [[nodiscard]] std::string_view name(Elf64_Sym const& s) const {
    if (s.st_name >= names_.size()) return {};
    std::string_view const n = names_.substr(s.st_name);
    return n.substr(0, n.find('\0'));
  }
  /// Whether s is an object defined in a writable section: a static variable, not a constant.
  [[nodiscard]] bool writable_object(Elf64_Sym const& s) const {
    return ELF64_ST_TYPE(s.st_info) == STT_OBJECT && s.st_size > 0 && s.st_shndx != SHN_UNDEF &&
           s.st_shndx < sections_.size() && (sections_[s.st_shndx].sh_flags & SHF_WRITE);
  }

  /// The static variables of `kernel`, at `address` in the executable's image.
  std::vector<std::span<std::byte>> variables_of(std::uintptr_t address, void const* kernel) const {
    std::string_view encoding;  // the kernel's mangled name past its "_Z"
    for (Elf64_Sym const& s : symbols_) {
      std::string_view const n = name(s);  // not an alias such as "<name>.localalias"
      if (ELF64_ST_TYPE(s.st_info) == STT_FUNC && s.st_value == address && n.starts_with("_Z") &&
          n.find('.') == std::string_view::npos) {
        encoding = n.substr(2);
        break;
      }
    }
    std::vector<std::span<std::byte>> variables;
    if (encoding.empty()) {
      if (!symbols_.empty())
        std::fprintf(stderr,
                     "CUDA emulator: the kernel at %p has no C++ name in the symbol table: its static __shared__ "
                     "variables keep what the block before wrote\n",
                     kernel);
      return variables;
    }
    for (Elf64_Sym const& s : symbols_) {
      std::string_view n = name(s);
      if (!n.starts_with("_ZZ") || !writable_object(s)) continue;
      n.remove_prefix(2);
      while (n.starts_with('Z')) n.remove_prefix(1);  // locals of a lambda in the kernel too
      if (n.starts_with(encoding) && n.substr(encoding.size()).starts_with('E'))
        variables.emplace_back(reinterpret_cast<std::byte*>(bias_ + s.st_value), s.st_size);
    }
    return variables;
  }

  MappedFile file_;  // the executable's, for the process's life
  std::span<Elf64_Shdr const> sections_;
  std::span<Elf64_Sym const> symbols_;
  std::string_view names_;
  std::uintptr_t bias_ = 0;  // where the executable is loaded
  std::map<void const*, std::vector<std::span<std::byte>>> kernels_;
  std::vector<std::span<std::byte>> const* variables_ = nullptr;
};

struct Copy {
  void* dst;
  void const* src;
  int bytes;
  int src_bytes;
};

enum class State { kReady, kAtBarrier, kAtWarp, kDone };

struct Fiber {
  boost::context::fiber context;  // the thread's, while it is suspended
  Coordinates at;
  int linear = 0;
  State state = State::kReady;
  std::vector<Copy> uncommitted;
  std::vector<std::vector<Copy>> committed;  // oldest group first
};

/// What a lane hands to a warp collective (a shuffle's value, an mma.sync's fragments).
using Slot = std::array<std::uint32_t, 12>;

struct Warp {
  unsigned arrived = 0;
  unsigned mask = 0;
  std::uintptr_t kind = 0;  // which collective the arrived lanes are at
  // Collectives completed. Deposits and results alternate between two buffers by it, so that
  // the lanes of one collective read its buffer while the next collective fills the other.
  unsigned generation = 0;
  // The lanes yet to read each buffer's last collective: a collective that would write a
  // buffer waits for them (lanes outside a partial mask can move on two collectives first).
  std::array<unsigned, 2> unread{};
  std::array<std::array<Slot, 32>, 2> in{};
  std::array<std::array<Slot, 32>, 2> out{};
  // warp_butterfly's values, then its results, and how many values every lane brings.
  std::array<std::array<std::array<float, kMaxButterflyValues>, 32>, 2> butterfly{};
  std::array<int, 2> butterfly_values{};
};

/// The last lane to arrive at a collective that has one runs it over the warp's deposits in
/// `buffer`.
using Combine = void (*)(Warp& w, int buffer, unsigned mask);

/// The launch being run: its threads, warps, dynamic shared memory, the block they run and the
/// threads ready to run.
struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<std::byte> shared;
  std::function<void()> const* body = nullptr;
  std::deque<Fiber*> ready;
  Fiber* current = nullptr;
  int live = 0;
  int at_barrier = 0;
  dim3 index;          // blockIdx
  bool ended = false;  // the launch's blocks have all run: its threads return

  /// "block (x, y, z)", for messages.
  [[nodiscard]] std::string name() const {
    return "block (" + std::to_string(index.x) + ", " + std::to_string(index.y) + ", " + std::to_string(index.z) + ")";
  }
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

// Threads switch to one another directly (one context switch per suspension, not two through
// the scheduler). A context that switches away names where it is kept (g_keep); the context
// it resumes stores it there first thing.
boost::context::fiber g_scheduler;        // run_launch's context, while threads run
boost::context::fiber* g_keep = nullptr;  // where the context that just switched away goes
boost::context::fiber g_returned;         // a returned thread's (empty) context

void keep(boost::context::fiber&& from) { *g_keep = std::move(from); }

/// Switches to `to`, keeping this context in `self` until something resumes it.
void switch_to(boost::context::fiber& to, boost::context::fiber& self) {
  g_keep = &self;
  keep(std::move(to).resume());
}

/// The next ready thread's context (that thread becomes the current one), or the scheduler's
/// when none is ready.
boost::context::fiber& next_context() {
  Block& b = *g_block;
  if (b.ready.empty()) {
    b.current = nullptr;
    return g_scheduler;
  }
  b.current = b.ready.front();
  b.ready.pop_front();
  return b.current->context;
}

/// Suspends the current thread (its state says why) and runs the next.
void yield() {
  Fiber& f = *g_block->current;
  switch_to(next_context(), f.context);
}

void make_ready(Fiber& f) {
  f.state = State::kReady;
  g_block->ready.push_back(&f);
}

void release_barrier() {
  std::vector<Fiber>& fibers = g_block->fibers;
  for (int i : schedule().order(static_cast<int>(fibers.size())))
    if (fibers[i].state == State::kAtBarrier) make_ready(fibers[i]);
  g_block->at_barrier = 0;
}

/// A thread through a launch: the kernel's body for each block in turn, parked in between
/// (run_block resumes it for the next block), then returns when the launch has ended.
boost::context::fiber fiber_entry(Fiber& f, boost::context::fiber&& from) {
  keep(std::move(from));
  while (!g_block->ended) {
    (*g_block->body)();
    f.state = State::kDone;
    --g_block->live;
    // Threads that have returned no longer hold a barrier back.
    if (g_block->at_barrier > 0 && g_block->at_barrier == g_block->live) release_barrier();
    switch_to(next_context(), f.context);
  }
  g_keep = &g_returned;
  return std::move(next_context());
}

std::string describe_deadlock(Block const& b) {
  std::string s = b.name() + " deadlocked: ";
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

StaticShared& static_shared() {  // under g_launch_mutex
  static StaticShared s;
  return s;
}

void run_block(Block& b) {
  int const n = static_cast<int>(b.fibers.size());
  static_shared().begin_block();
  std::fill(b.shared.begin(), b.shared.end(), std::byte{0xff});
  for (Warp& w : b.warps) w.arrived = 0, w.unread = {};
  b.ready.clear();
  for (int i : schedule().order(n)) {
    Fiber& f = b.fibers[i];
    f.at.block_idx = {b.index.x, b.index.y, b.index.z};
    f.uncommitted.clear();
    f.committed.clear();
    make_ready(f);
  }
  b.live = n;
  b.at_barrier = 0;
  while (b.live > 0) {
    if (b.ready.empty()) fail(describe_deadlock(b));
    switch_to(next_context(), g_scheduler);
  }
}

void run_launch(dim3 grid, dim3 block, std::size_t smem, void const* kernel, std::function<void()> const& body) {
  std::lock_guard lock(g_launch_mutex);
  static_shared().begin_launch(kernel);
  int const n = static_cast<int>(block.x * block.y * block.z);
  Block b;
  b.body = &body;
  b.fibers.resize(n);
  b.warps.resize((n + 31) / 32);
  b.shared.resize(smem);
  while (static_cast<int>(g_stacks.size()) < n) g_stacks.push_back(std::make_unique<Stack>(g_stacks.size() % 64 * 64));
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.at.thread_idx = {i % block.x, i / block.x % block.y, i / (block.x * block.y)};
    f.at.block_dim = block;
    f.at.grid_dim = grid;
    f.context = boost::context::fiber(std::allocator_arg, LentStack(*g_stacks[i]),
                                      [&f](boost::context::fiber&& s) { return fiber_entry(f, std::move(s)); });
  }
  std::vector<std::int64_t> blocks(std::size_t{grid.x} * grid.y * grid.z);
  std::iota(blocks.begin(), blocks.end(), std::int64_t{0});
  schedule().arrange(blocks);
  g_block = &b;
  {
    struct Watch {
      Watch() { watch_faults(true); }
      ~Watch() { watch_faults(false); }
    } const watch;
    for (std::int64_t i : blocks) {
      b.index = dim3(static_cast<unsigned>(i % grid.x), static_cast<unsigned>(i / grid.x % grid.y),
                     static_cast<unsigned>(i / (std::int64_t{grid.x} * grid.y)));
      run_block(b);
    }
  }
  b.ended = true;
  for (Fiber& f : b.fibers) switch_to(f.context, g_scheduler);
  g_block = nullptr;
}

void perform(std::vector<Copy> const& group) {
  for (Copy const& c : group) {
    std::memcpy(c.dst, c.src, static_cast<std::size_t>(c.src_bytes));
    std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, static_cast<std::size_t>(c.bytes - c.src_bytes));
  }
}

/// The current thread at a warp collective: its warp, lane, and the buffer of this collective.
struct Arrival {
  Warp& warp;
  int lane;
  int buffer;
};

/// Checks the current thread's arrival at a collective of `kind` over `mask`; the caller then
/// deposits into warp.in[buffer][lane], calls complete(), reads, and calls consumed().
Arrival arrive(unsigned mask, std::uintptr_t kind) {
  Block& b = *g_block;
  Fiber& f = *b.current;
  int const lane = f.linear % 32;
  Warp& w = b.warps[f.linear / 32];
  while (w.arrived == 0 && w.unread[w.generation & 1]) {  // the readers are ready: run them first
    make_ready(f);
    yield();
  }
  if (!(mask >> lane & 1))
    fail(b.name() + ": lane " + std::to_string(lane) + " calls a warp collective without its own bit in the mask");
  if (w.arrived == 0) {
    w.mask = mask;
    w.kind = kind;
  } else if (w.mask != mask || w.kind != kind) {
    char buf[160];
    std::snprintf(buf, sizeof buf, ": lanes of warp %d meet at different warp collectives (masks 0x%08x and 0x%08x)",
                  f.linear / 32, w.mask, mask);
    fail(b.name() + buf);
  }
  return {w, lane, static_cast<int>(w.generation & 1)};
}

/// The current thread has deposited; the last lane in the mask runs `combine` (if any) and
/// goes on, the others wait for it.
void complete(Arrival const& a, unsigned mask, Combine combine) {
  Warp& w = a.warp;
  w.arrived |= 1u << a.lane;
  if ((w.arrived & mask) != mask) {
    g_block->current->state = State::kAtWarp;
    yield();
    return;
  }
  if (combine) combine(w, a.buffer, mask);
  w.unread[a.buffer] = mask;
  w.arrived = 0;
  ++w.generation;
  Fiber* const lanes = &g_block->fibers[static_cast<std::size_t>(&w - g_block->warps.data()) * 32];
  for (int l : schedule().order(32))
    if (l != a.lane && (mask >> l & 1)) make_ready(lanes[l]);
}

/// The current thread has read its collective's results.
void consumed(Arrival const& a) { a.warp.unread[a.buffer] &= ~(1u << a.lane); }

/// A collective's identity for the check that a warp's lanes meet at the same one.
template <auto kWhich>
std::uintptr_t kind_of() {
  static char const tag = 0;
  return reinterpret_cast<std::uintptr_t>(&tag);
}

template <ButterflyOp kOp>
void butterfly(Warp& w, int buffer, unsigned) {
  auto const op = [](float mine, float other) {
    if constexpr (kOp == kButterflySum) return mine + other;
    if constexpr (kOp == kButterflyMax) return std::fmax(mine, other);
    if constexpr (kOp == kButterflyMin) return std::fmin(mine, other);
  };
  auto& v = w.butterfly[buffer];
  int const n = w.butterfly_values[buffer];
  for (int m = 16; m > 0; m /= 2)
    for (int l = 0; l < 32; ++l)
      if (!(l & m))  // lanes l and l ^ m trade values
        for (int i = 0; i < n; ++i) {
          float const mine = v[l][i], other = v[l ^ m][i];
          v[l][i] = op(mine, other);
          v[l ^ m][i] = op(other, mine);
        }
}

/// A collective that has the last lane run `combine` over every lane's deposit: each lane gets
/// its own result back.
Slot warp_collective(unsigned mask, Combine combine, Slot const& in) {
  Arrival const a = arrive(mask, reinterpret_cast<std::uintptr_t>(combine));
  a.warp.in[a.buffer][a.lane] = in;
  complete(a, mask, combine);
  consumed(a);
  return a.warp.out[a.buffer][a.lane];
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

void sync_warp(unsigned mask) {
  Arrival const a = arrive(mask, kind_of<&sync_warp>());
  complete(a, mask, nullptr);
  consumed(a);
}

void const* shuffle(unsigned mask, void const* v, std::size_t bytes, ShuffleKind kind, int arg, int width) {
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail("shuffle width " + std::to_string(width) + " is not a power of 2 up to 32");
  static char const kinds[4] = {};
  Arrival const a = arrive(mask, reinterpret_cast<std::uintptr_t>(&kinds[kind]));
  std::memcpy(a.warp.in[a.buffer][a.lane].data(), v, bytes);
  complete(a, mask, nullptr);
  int const lane = a.lane, base = lane & ~(width - 1), within = lane - base;
  int src = lane;
  switch (kind) {
    case kShuffleXor: src = base + ((within ^ arg) & (width - 1)); break;
    case kShuffleIndex: src = base + (arg & (width - 1)); break;
    case kShuffleUp: src = within >= arg ? lane - arg : lane; break;
    case kShuffleDown: src = within + arg < width ? lane + arg : lane; break;
  }
  if (!(mask >> src & 1))
    fail(g_block->name() + ": a shuffle reads lane " + std::to_string(src) + ", which is not in its mask");
  consumed(a);
  return a.warp.in[a.buffer][src].data();
}

std::uint32_t reduce_add(unsigned mask, std::uint32_t v) {
  Arrival const a = arrive(mask, kind_of<&reduce_add>());
  a.warp.in[a.buffer][a.lane][0] = v;
  complete(a, mask, nullptr);
  std::uint32_t sum = 0;
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1) sum += a.warp.in[a.buffer][l][0];
  consumed(a);
  return sum;
}

void warp_butterfly(float* v, int n, ButterflyOp op) {
  if (n < 1 || n > kMaxButterflyValues)
    fail("a warp butterfly of " + std::to_string(n) + " values (1 to " + std::to_string(kMaxButterflyValues) + ")");
  Combine const combine = op == kButterflySum   ? butterfly<kButterflySum>
                          : op == kButterflyMax ? butterfly<kButterflyMax>
                                                : butterfly<kButterflyMin>;
  Arrival const a = arrive(0xffffffffu, reinterpret_cast<std::uintptr_t>(combine));
  int& values = a.warp.butterfly_values[a.buffer];
  if (a.warp.arrived == 0)
    values = n;
  else if (values != n)
    fail(g_block->name() + ": lanes of a warp butterfly bring " + std::to_string(values) + " and " +
         std::to_string(n) + " values");
  std::copy_n(v, n, a.warp.butterfly[a.buffer][a.lane].begin());
  complete(a, 0xffffffffu, combine);
  std::copy_n(a.warp.butterfly[a.buffer][a.lane].begin(), n, v);
  consumed(a);
}

float warp_butterfly(float v, ButterflyOp op) {
  warp_butterfly(&v, 1, op);
  return v;
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
  submit(stream, {NodeType::kKernel, 0, [grid, block, smem, kernel, body = std::move(body)] {
                   run_launch(grid, block, smem, kernel, body);
                 }});
}

void async_copy(void* dst, void const* src, int bytes, int src_bytes) {
  auto const misaligned = [&](void const* p) {
    return reinterpret_cast<std::uintptr_t>(p) % static_cast<unsigned>(bytes) != 0;
  };
  if (misaligned(dst) || (src_bytes && misaligned(src)))
    fail(g_block->name() + ": cp.async of " + std::to_string(bytes) + " bytes at a misaligned address");
  g_block->current->uncommitted.push_back({dst, src, bytes, src_bytes});
}
void async_commit() {
  Fiber& f = *g_block->current;
  if (schedule().lands_at_commit()) {
    perform(f.uncommitted);
    f.uncommitted.clear();  // the group stays, empty, for the waits' count
  }
  f.committed.push_back(std::move(f.uncommitted));
  f.uncommitted.clear();
}
void async_wait(int pending) {
  Fiber& f = *g_block->current;
  while (static_cast<int>(f.committed.size()) > pending) {
    perform(f.committed.front());
    f.committed.erase(f.committed.begin());
  }
}

namespace {

/// The last lane to arrive at an mma.sync: every lane's c from every lane's fragments (words 0-3
/// a, 4-5 b, 6-9 c).
template <class FragA, class FragB, auto kEmulate>
void mma_combine(Warp& w, int buffer, unsigned) {
  std::array<test::Acc, 32> acc;
  std::array<FragA, 32> a;
  std::array<FragB, 32> b;
  for (int l = 0; l < 32; ++l) {
    std::memcpy(a[l].data(), &w.in[buffer][l][0], 16);
    std::memcpy(b[l].data(), &w.in[buffer][l][4], 8);
    std::memcpy(acc[l].data(), &w.in[buffer][l][6], 16);
  }
  kEmulate(acc, a, b);
  for (int l = 0; l < 32; ++l) std::memcpy(&w.out[buffer][l][0], acc[l].data(), 16);
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

void set_schedule(char const* spec) {
  std::lock_guard lock(g_launch_mutex);
  if (!schedule().set(spec)) fail("set_schedule('" + std::string(spec) + "'); expected " + Schedule::kForms);
}

std::string current_schedule() {
  std::lock_guard lock(g_launch_mutex);
  return schedule().name();
}

void set_smem_limit(void const* kernel, int bytes) {
  std::lock_guard lock(g_limits_mutex);
  smem_limits()[kernel] = bytes;
}

}  // namespace qflash::emulator

// ---- The CUDA runtime calls qflash makes, on host memory. ------------------------------------

namespace {

using qflash::emulator::g_last_error;

/// Where an address lies, as a memcpy node's operands have it (host memory, pinned or not, or
/// the device's), which an update may not change.
enum Memory { kHost, kDevice };
/// Device and pinned allocations: each at the end of a mapping of its own, 256-byte aligned
/// (as cudaMalloc's), between two inaccessible pages, so that a kernel's access past its end
/// (or far enough before its start) faults and is reported as the kernel's (watch_faults).
/// The bytes between the guard pages and the allocation (up to 255 after it, up to a page
/// before) hold 0xff: reads give NaN, and writes are found at release.
struct Allocation {
  std::size_t bytes;
  Memory memory;
  char* map;  // the mapping: guard page, body, guard page
  std::size_t map_bytes;
  [[nodiscard]] std::size_t span() const { return (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256; }
};

std::mutex g_memory_mutex;
std::map<char const*, Allocation>& allocations() {  // under g_memory_mutex
  static std::map<char const*, Allocation> a;
  return a;
}
std::size_t g_allocated = 0;

cudaError_t record(cudaError_t e) {
  if (e != cudaSuccess) g_last_error = e;
  return e;
}

cudaError_t allocate(void** p, std::size_t size, Memory memory) {
  if (!p) return record(cudaErrorInvalidValue);
  std::lock_guard lock(g_memory_mutex);
  if (size > qflash::emulator::kGlobalBytes - g_allocated) return record(cudaErrorMemoryAllocation);
  std::size_t const page = qflash::emulator::page_bytes();
  Allocation a{size, memory, nullptr, 0};
  std::size_t const body = (a.span() + page - 1) / page * page;
  a.map_bytes = body + 2 * page;
  void* const map = mmap(nullptr, a.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return record(cudaErrorMemoryAllocation);
  a.map = static_cast<char*>(map);
  if (mprotect(a.map, page, PROT_NONE) || mprotect(a.map + page + body, page, PROT_NONE)) {
    munmap(map, a.map_bytes);
    return record(cudaErrorMemoryAllocation);
  }
  char* const start = a.map + page + body - a.span();
  std::memset(a.map + page, 0xff, body);  // uninitialized device memory reads as NaN
  allocations()[start] = a;
  g_allocated += size;
  *p = start;
  return cudaSuccess;
}

cudaError_t release(void* p) {
  if (!p) return cudaSuccess;
  std::lock_guard lock(g_memory_mutex);
  auto const it = allocations().find(static_cast<char const*>(p));
  if (it == allocations().end()) return record(cudaErrorInvalidValue);
  Allocation const a = it->second;
  auto const* const start = static_cast<unsigned char const*>(p);
  auto const* const body = reinterpret_cast<unsigned char const*>(a.map) + qflash::emulator::page_bytes();
  auto const written = [&](std::ptrdiff_t offset) {
    qflash::emulator::fail("freeing an allocation of " + std::to_string(a.bytes) + " bytes: its offset " +
                           std::to_string(offset) + " was written, " +
                           (offset < 0 ? "before its start" : "past its end"));
  };
  for (auto const* b = start - 1; b >= body; --b)
    if (*b != 0xff) written(b - start);
  for (std::size_t i = a.bytes; i < a.span(); ++i)
    if (start[i] != 0xff) written(static_cast<std::ptrdiff_t>(i));
  g_allocated -= a.bytes;
  allocations().erase(it);
  munmap(a.map, a.map_bytes);
  return cudaSuccess;
}

struct sigaction g_fault_action_before;  // while a launch runs: the SIGSEGV action it replaced
pthread_t g_launching_thread;            // the host thread running it

/// What a fault at `at` hit: an allocation's guard page, as "offset N of an allocation of M
/// bytes, past its end", or a CUDA thread's stack guard; empty for anything else.
std::string fault_site(char const* at) {
  using namespace qflash::emulator;
  for (auto const& stack : g_stacks)  // the launching thread holds g_launch_mutex: they stay
    if (stack->guards(at)) return "beyond its stack of " + std::to_string(kStackBytes >> 10) + " KiB";
  bool locked = false;  // another host thread may hold it for a moment; this one never faults under it
  for (int i = 0; i < 1000 && !(locked = g_memory_mutex.try_lock()); ++i) sched_yield();
  if (!locked) return "address " + std::to_string(reinterpret_cast<std::uintptr_t>(at)) + " (memory map busy)";
  std::string site;
  auto const& all = allocations();
  auto const describe = [&](char const* start, Allocation const& a) {
    return "offset " + std::to_string(at - start) + " of an allocation of " + std::to_string(a.bytes) + " bytes, " +
           (at < start ? "before its start" : "past its end");
  };
  auto const after = all.upper_bound(at);  // the allocation whose leading guard page `at` may be in
  if (after != all.end() && at >= after->second.map) site = describe(after->first, after->second);
  if (after != all.begin()) {
    auto const& [start, a] = *std::prev(after);
    if (at >= start + a.bytes && at < a.map + a.map_bytes) site = describe(start, a);
  }
  g_memory_mutex.unlock();
  return site;
}

/// SIGSEGV while a launch runs (on an alternate stack: the fault may be a fiber's overflow).
/// Not async-signal-safe, and need not be: the faults it reports are the kernel's own
/// accesses, and it aborts.
void on_fault(int, siginfo_t* info, void*) {
  using qflash::emulator::g_block;
  std::string const site = pthread_equal(pthread_self(), g_launching_thread)
                               ? fault_site(static_cast<char const*>(info->si_addr))
                               : std::string();
  if (site.empty()) {
    sigaction(SIGSEGV, &g_fault_action_before, nullptr);  // returns to fault again under it
    return;
  }
  std::string who = "a kernel";
  if (g_block && g_block->current) {
    uint3 const t = g_block->current->at.thread_idx;
    who = g_block->name() + ", thread (" + std::to_string(t.x) + ", " + std::to_string(t.y) + ", " +
          std::to_string(t.z) + ")";
  }
  qflash::emulator::fail(who + " accesses " + site);
}

}  // namespace

namespace qflash::emulator {
void watch_faults(bool on) {
  if (!on) {
    sigaction(SIGSEGV, &g_fault_action_before, nullptr);
    return;
  }
  stack_t current{};
  sigaltstack(nullptr, &current);
  if (current.ss_flags & SS_DISABLE) {  // this host thread's first launch, without one of its own
    thread_local std::vector<char> alternate(std::size_t{256} << 10);
    stack_t const s{alternate.data(), 0, alternate.size()};
    sigaltstack(&s, nullptr);
  }
  g_launching_thread = pthread_self();
  struct sigaction a{};
  a.sa_sigaction = on_fault;
  a.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&a.sa_mask);
  struct sigaction before{};
  sigaction(SIGSEGV, &a, &before);
  if (!((before.sa_flags & SA_SIGINFO) && before.sa_sigaction == on_fault)) g_fault_action_before = before;
}
}  // namespace qflash::emulator

namespace {

Memory memory_of(void const* p) {
  std::lock_guard lock(g_memory_mutex);
  auto const c = static_cast<char const*>(p);
  auto it = allocations().upper_bound(c);
  if (it == allocations().begin()) return kHost;
  --it;
  return c < it->first + std::max<std::size_t>(it->second.bytes, 1) ? it->second.memory : kHost;
}

// Streams being captured, on every host thread.
std::mutex g_capture_mutex;
std::set<cudaStream_t>& capturing() {  // under g_capture_mutex
  static std::set<cudaStream_t> s;
  return s;
}

/// A use of the legacy stream. While a blocking stream is being captured it is invalid, and
/// breaks that capture (CUDA's cudaErrorStreamCaptureImplicit); asking whether the legacy
/// stream is being captured fails the same way but breaks nothing.
cudaError_t use_legacy_stream(bool breaks = true) {
  std::lock_guard lock(g_capture_mutex);
  bool invalid = false;
  for (cudaStream_t s : capturing())
    if (s->blocking) {
      invalid = true;
      if (breaks) s->invalidated = true;
    }
  return invalid ? record(cudaErrorStreamCaptureImplicit) : cudaSuccess;
}

/// A call that may not be made on a stream being captured (a synchronization): it breaks the
/// capture and fails.
cudaError_t forbidden_in_capture(cudaStream_t s) {
  std::lock_guard lock(g_capture_mutex);
  s->invalidated = true;
  return record(cudaErrorStreamCaptureUnsupported);
}

/// cudaMallocAsync and cudaFreeAsync make memory nodes in a capture, which are not emulated
/// (qflash's steps allocate nothing: kernels/common/stream_workspace.cuh).
cudaError_t stream_ordered_memory(cudaStream_t stream) {
  if (stream && stream->capture)
    qflash::emulator::fail("cudaMallocAsync or cudaFreeAsync on a stream being captured");
  return stream ? cudaSuccess : use_legacy_stream();
}

}  // namespace

cudaError_t qflash::emulator::submit(cudaStream_t stream, Node node) {
  if (!stream) {
    if (cudaError_t const e = use_legacy_stream(); e != cudaSuccess) return e;
  } else if (stream->capture) {
    if (stream->invalidated) return record(cudaErrorStreamCaptureInvalidated);
    stream->capture->push_back(std::move(node));
    return cudaSuccess;
  }
  node.run();
  return cudaSuccess;
}

extern "C" {

cudaError_t cudaMalloc(void** p, std::size_t size) { return allocate(p, size, kDevice); }
cudaError_t cudaMallocManaged(void** p, std::size_t size, unsigned) { return allocate(p, size, kDevice); }
cudaError_t cudaMallocHost(void** p, std::size_t size) { return allocate(p, size, kHost); }
cudaError_t cudaHostAlloc(void** p, std::size_t size, unsigned) { return allocate(p, size, kHost); }
cudaError_t cudaMallocAsync(void** p, std::size_t size, cudaStream_t stream) {
  if (cudaError_t const e = stream_ordered_memory(stream); e != cudaSuccess) return e;
  return allocate(p, size, kDevice);
}
cudaError_t cudaFree(void* p) { return release(p); }
cudaError_t cudaFreeHost(void* p) { return release(p); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  if (cudaError_t const e = stream_ordered_memory(stream); e != cudaSuccess) return e;
  return release(p);
}

cudaError_t cudaMemGetInfo(std::size_t* free, std::size_t* total) {
  std::lock_guard lock(g_memory_mutex);
  *total = qflash::emulator::kGlobalBytes;
  *free = *total - g_allocated;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, void const* src, std::size_t n, cudaMemcpyKind) {
  if (cudaError_t const e = use_legacy_stream(); e != cudaSuccess) return e;
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, void const* src, std::size_t n, cudaMemcpyKind, cudaStream_t stream) {
  int const operands = memory_of(src) * 2 + memory_of(dst);
  return qflash::emulator::submit(stream, {qflash::emulator::NodeType::kMemcpy, operands, [=] {
                                             if (n) std::memmove(dst, src, n);
                                           }});
}
cudaError_t cudaMemset(void* p, int value, std::size_t n) {
  if (cudaError_t const e = use_legacy_stream(); e != cudaSuccess) return e;
  std::memset(p, value, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t n, cudaStream_t stream) {
  return qflash::emulator::submit(stream, {qflash::emulator::NodeType::kMemset, 0, [=] { std::memset(p, value, n); }});
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
cudaError_t cudaDeviceSynchronize() {
  std::lock_guard lock(g_capture_mutex);
  for (cudaStream_t s : capturing()) s->invalidated = true;
  return capturing().empty() ? cudaSuccess : record(cudaErrorStreamCaptureUnsupported);
}

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
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorGraphExecUpdateFailure: return "cudaErrorGraphExecUpdateFailure";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    default: return "cudaError (emulated)";
  }
}
char const* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new CUstream_st;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  *s = new CUstream_st;
  (*s)->blocking = !(flags & cudaStreamNonBlocking);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s && s->capture) return record(cudaErrorStreamCaptureUnsupported);
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (!s) return use_legacy_stream();
  return s->capture ? forbidden_in_capture(s) : cudaSuccess;
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
/// Recorded into a capture, an event only orders the captured work (no node, no time).
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  if (stream && stream->capture) {
    if (stream->invalidated) return record(cudaErrorStreamCaptureInvalidated);
    e->captured_on = stream;
    e->capture_id = stream->capture_id;
    return cudaSuccess;
  }
  if (!stream)
    if (cudaError_t const err = use_legacy_stream(); err != cudaSuccess) return err;
  e->captured_on = nullptr;
  e->at = std::chrono::steady_clock::now();  // the stream's work before it is done
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  bool in_capture = false;
  {
    std::lock_guard lock(g_capture_mutex);
    in_capture = capturing().contains(e->captured_on) && e->captured_on->capture_id == e->capture_id;
  }
  return in_capture ? forbidden_in_capture(e->captured_on) : cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (!s || s->capture) return record(cudaErrorStreamCaptureUnsupported);
  std::lock_guard lock(g_capture_mutex);
  static std::uint64_t captures = 0;  // under g_capture_mutex
  s->capture = new std::vector<qflash::emulator::Node>;
  s->capture_id = ++captures;
  s->invalidated = false;
  capturing().insert(s);
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  if (!s) {
    if (cudaError_t const e = use_legacy_stream(false); e != cudaSuccess) return e;
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
  }
  *status = !s->capture       ? cudaStreamCaptureStatusNone
            : s->invalidated ? cudaStreamCaptureStatusInvalidated
                             : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  if (!s || !s->capture) return record(cudaErrorIllegalState);
  std::lock_guard lock(g_capture_mutex);
  capturing().erase(s);
  std::unique_ptr<std::vector<qflash::emulator::Node>> const nodes(std::exchange(s->capture, nullptr));
  if (s->invalidated) {
    *graph = nullptr;
    return record(cudaErrorStreamCaptureInvalidated);
  }
  *graph = new CUgraph_st{std::move(*nodes)};
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  *exec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}
/// Takes graph's parameters when its nodes are of the same types in the same order as exec's
/// (and each memcpy's operands of the same memory types); else fails and leaves exec as it was.
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo* info) {
  cudaGraphExecUpdateResultInfo result{};
  result.result = cudaGraphExecUpdateSuccess;
  if (exec->nodes.size() != graph->nodes.size()) result.result = cudaGraphExecUpdateErrorTopologyChanged;
  for (std::size_t i = 0; i < exec->nodes.size() && result.result == cudaGraphExecUpdateSuccess; ++i) {
    if (exec->nodes[i].type != graph->nodes[i].type)
      result.result = cudaGraphExecUpdateErrorNodeTypeChanged;
    else if (exec->nodes[i].operands != graph->nodes[i].operands)
      result.result = cudaGraphExecUpdateErrorParametersChanged;
  }
  if (info) *info = result;
  if (result.result != cudaGraphExecUpdateSuccess) return record(cudaErrorGraphExecUpdateFailure);
  exec->nodes = graph->nodes;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (stream && stream->capture) qflash::emulator::fail("a graph launched into a stream being captured");
  if (!stream)
    if (cudaError_t const e = use_legacy_stream(); e != cudaSuccess) return e;
  for (auto const& node : exec->nodes) node.run();
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
