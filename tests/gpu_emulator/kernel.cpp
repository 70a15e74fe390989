// The emulated GPU's kernel executor (kernel.h): every block of the grid, its threads as fibers.
//
// A block's threads run on one device thread under a round-robin scheduler. A thread runs until it
// finishes or waits: at __syncthreads (released when every thread of the block has arrived at the
// same call site) or at a shuffle (released when every lane its mask names has arrived at its own
// shuffle of the same sequence number). When no thread can run and some have not finished, the
// kernel is wrong: the fault names the kernel, the block and what each thread waits for.
// Debian's Boost.Context is built for fcontext, which does not tell AddressSanitizer about stack
// switches (its ucontext variant does, but needs a library built for it). Under ASan the fiber
// stacks are therefore unknown to it: it still checks every heap access (device memory), which is
// what the emulated GPU needs it for.
#include <boost/context/fiber.hpp>
#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <deque>
#include <mutex>

#include "device.h"
#include "emu.h"
#include "kernel.h"
#include "launch_log.h"
#include "runtime/core/half.h"

namespace amp::emu {

namespace {

namespace bctx = boost::context;

constexpr size_t kStackBytes = size_t{256} << 10;

// Fiber stacks, reused from block to block (a grid has thousands of threads).
class StackPool {
 public:
  bctx::stack_context allocate() {
    void* base;
    if (!free_.empty()) {
      base = free_.back();
      free_.pop_back();
    } else {
      base = std::malloc(kStackBytes);
      if (base == nullptr) throw std::bad_alloc();
    }
    bctx::stack_context sc;
    sc.size = kStackBytes;
    sc.sp = static_cast<char*>(base) + kStackBytes;
    return sc;
  }
  void deallocate(bctx::stack_context& sc) { free_.push_back(static_cast<char*>(sc.sp) - sc.size); }

 private:
  std::vector<void*> free_;
};

// The allocator handed to Boost.Context: a handle on this device thread's pool.
struct PoolAllocator {
  StackPool* pool;
  bctx::stack_context allocate() { return pool->allocate(); }
  void deallocate(bctx::stack_context& sc) { pool->deallocate(sc); }
};

enum class Wait { none, barrier, shuffle, done };

struct Thread {
  ThreadContext ctx;
  bctx::fiber fiber;     // the thread, while suspended
  bctx::fiber back;      // the scheduler, while the thread runs
  Wait wait = Wait::none;
  std::source_location where;  // of the barrier or shuffle it waits at
  uint32_t mask = 0;           // of the shuffle it waits at
  int64_t shuffles = 0;        // shuffles this lane has arrived at
  struct Copy {                // a cp.async in flight
    void* dst;
    const void* src;
    int src_bytes;
  };
  std::vector<Copy> open_group;                // not yet committed
  std::deque<std::vector<Copy>> copy_groups;   // committed, oldest first
  std::exception_ptr error;    // thrown by the kernel body: re-thrown by the scheduler
};

struct Warp {
  uint64_t slot[2][32] = {};  // values of shuffle n in slot[n % 2]
};

struct Block {
  std::mt19937_64* rng = nullptr;  // the launch's seeded generator
  uint64_t coin() { return (*rng)(); }
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  Thread* running = nullptr;
  int arrived = 0;  // at the barrier
  std::string kernel;
};

thread_local Block* t_block = nullptr;
thread_local uint64_t t_block_serial = 0;
thread_local StackPool t_pool;

Thread& self() {
  if (t_block == nullptr || t_block->running == nullptr)
    throw std::logic_error("a device function (__syncthreads, __shfl_*_sync, threadIdx) was called outside a kernel");
  return *t_block->running;
}

void suspend(Thread& t) { t.back = std::move(t.back).resume(); }

std::string site(const std::source_location& w) {
  return std::string(w.file_name()) + ":" + std::to_string(w.line());
}

std::string block_name(const Block& b) {
  const uint3 i = b.threads.front().ctx.block_idx;
  return "kernel " + b.kernel + ", block (" + std::to_string(i.x) + "," + std::to_string(i.y) + "," +
         std::to_string(i.z) + ")";
}

[[noreturn]] void kernel_error(const Block& b, const std::string& what) {
  throw std::runtime_error(block_name(b) + ": " + what);
}


// Whether every lane that t's shuffle names has arrived at a shuffle of the same number.
bool shuffle_ready(const Thread& t, const Block& b) {
  const size_t warp_base = static_cast<size_t>(&t - b.threads.data()) / 32 * 32;
  for (int lane = 0; lane < 32; ++lane) {
    if (!(t.mask >> lane & 1u)) continue;
    const Thread& other = b.threads[warp_base + static_cast<size_t>(lane)];
    if (other.shuffles < t.shuffles) return false;
  }
  return true;
}

// Explains why no thread of b can run: a barrier or shuffle that not everyone reaches.
std::string deadlock_report(const Block& b) {
  std::ostringstream os;
  int done = 0, at_barrier = 0;
  for (const Thread& t : b.threads) {
    done += t.wait == Wait::done;
    at_barrier += t.wait == Wait::barrier;
  }
  if (at_barrier > 0)
    os << "__syncthreads reached by " << at_barrier << " of " << b.threads.size() << " threads (" << done
       << " finished without it)";
  for (const Thread& t : b.threads) {
    if (t.wait != Wait::shuffle) continue;
    const size_t base = static_cast<size_t>(&t - b.threads.data()) / 32 * 32;
    for (int lane = 0; lane < 32; ++lane) {
      if (!(t.mask >> lane & 1u)) continue;
      const Thread& other = b.threads[base + static_cast<size_t>(lane)];
      if (other.shuffles < t.shuffles) {
        if (at_barrier > 0) os << "; ";
        os << "a shuffle at " << site(t.where) << " (thread " << (&t - b.threads.data()) << ", mask 0x" << std::hex
           << t.mask << std::dec << ") waits for lane " << lane << ", which "
           << (other.wait == Wait::done ? "has finished" : "waits elsewhere");
        return os.str();
      }
    }
  }
  return os.str();
}

// The threads run in a seeded random order, reshuffled on every pass, and blocks in a random order:
// code that relies on thread 0 (or block 0) running first, without a barrier, breaks here as it may
// on a GPU (independent thread scheduling since Volta). And one warp, drawn at random at the start and
// after each barrier, lags: it runs only when no other thread can, so the others reach the next
// barrier (or the end) before it has left the last one. Code that refills shared memory other warps
// may still read, without a barrier between, breaks here as it may on a GPU where warps drift apart.
void run_block(Block& b, const std::function<void()>& body, std::mt19937_64& rng) {
  b.rng = &rng;
  const size_t warps = (b.threads.size() + 31) / 32;
  auto draw_laggard = [&] { return warps > 1 ? static_cast<int64_t>(rng() % warps) : int64_t{-1}; };
  int64_t laggard = draw_laggard();
  for (Thread& t : b.threads) {
    t.fiber = bctx::fiber(std::allocator_arg, PoolAllocator{&t_pool}, [&t, &body](bctx::fiber&& back) {
      t.back = std::move(back);
      try {
        body();
      } catch (const bctx::detail::forced_unwind&) {
        throw;  // the block is being torn down
      } catch (...) {
        t.error = std::current_exception();  // exceptions must not cross the fiber's boundary
      }
      if (!t.error && (!t.open_group.empty() || !t.copy_groups.empty()))
        t.error = std::make_exception_ptr(std::runtime_error("a thread finished with cp.async copies it never waited for"));
      t.wait = Wait::done;
      return std::move(t.back);
    });
  }
  const size_t n = b.threads.size();
  size_t finished = 0;
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  while (finished < n) {
    bool progressed = false;
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t i : order) {
      Thread& t = b.threads[i];
      if (t.wait == Wait::done || t.wait == Wait::barrier) continue;
      if (static_cast<int64_t>(i / 32) == laggard) continue;
      if (t.wait == Wait::shuffle && !shuffle_ready(t, b)) continue;
      t.wait = Wait::none;
      b.running = &t;
      t.fiber = std::move(t.fiber).resume();
      b.running = nullptr;
      if (t.error) std::rethrow_exception(t.error);
      progressed = true;
      if (t.wait == Wait::done) ++finished;
    }
    if (b.arrived > 0 && static_cast<size_t>(b.arrived) == n) {
      // Everyone is at a barrier: the same one, or the kernel diverged.
      const std::source_location first = b.threads.front().where;
      for (const Thread& t : b.threads)
        if (t.where.line() != first.line() || std::string(t.where.file_name()) != first.file_name())
          kernel_error(b, "threads wait at different __syncthreads: " + site(first) + " and " + site(t.where));
      for (Thread& t : b.threads) t.wait = Wait::none;
      b.arrived = 0;
      progressed = true;
      laggard = draw_laggard();
    }
    if (!progressed && laggard >= 0) {  // no one else can run: the laggard's turn, until the next barrier
      laggard = -1;
      continue;
    }
    if (!progressed && finished < n) kernel_error(b, deadlock_report(b));
  }
}

}  // namespace

ThreadContext& current_thread() { return self().ctx; }

void syncthreads(std::source_location where) {
  Thread& t = self();
  t.wait = Wait::barrier;
  t.where = where;
  ++t_block->arrived;
  suspend(t);
}

namespace {

uint64_t shuffle(uint32_t mask, uint64_t bits, int src_lane_in_segment, int width, std::source_location where) {
  Thread& t = self();
  Block& b = *t_block;
  const int tid = static_cast<int>(&t - b.threads.data());
  const int lane = tid % 32;
  const int warp_size = std::min<int>(32, static_cast<int>(b.threads.size()) - tid / 32 * 32);
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    kernel_error(b, "shuffle at " + site(where) + ": width " + std::to_string(width) + " is not a power of 2 up to 32");
  if (warp_size < 32 && (mask >> warp_size) != 0)
    kernel_error(b, "shuffle at " + site(where) + ": mask names lanes past the block's last thread");
  if (!(mask >> lane & 1u)) kernel_error(b, "shuffle at " + site(where) + ": the calling lane is not in its mask");
  Warp& w = b.warps[static_cast<size_t>(tid / 32)];
  const int64_t n = t.shuffles;
  w.slot[n % 2][lane] = bits;
  t.shuffles = n + 1;
  t.mask = mask;
  t.where = where;
  t.wait = Wait::shuffle;
  suspend(t);  // resumed once every lane of the mask has deposited shuffle n
  const int segment = lane / width * width;
  const int src = segment + src_lane_in_segment;
  if (src_lane_in_segment < 0 || src_lane_in_segment >= width) return bits;  // CUDA: the lane keeps its value
  const Thread& other = b.threads[static_cast<size_t>(tid - lane + src)];
  if (!(mask >> src & 1u)) return ~uint64_t{0};  // undefined on the GPU: poison (NaN) here
  if (other.mask != mask)
    kernel_error(b, "shuffle at " + site(where) + ": lanes " + std::to_string(lane) + " and " + std::to_string(src) +
                        " name different masks");
  return w.slot[n % 2][src];
}

}  // namespace

namespace {
int linear_lane() { return static_cast<int>(&self() - t_block->threads.data()) % 32; }
}  // namespace

uint64_t shfl_down_bits(uint32_t mask, uint64_t bits, unsigned delta, int width, std::source_location where) {
  const int in_segment = linear_lane() % std::max(width, 1);
  return shuffle(mask, bits, in_segment + static_cast<int>(delta), width, where);
}

uint64_t shfl_idx_bits(uint32_t mask, uint64_t bits, int src_lane, int width, std::source_location where) {
  // CUDA: the source lane is taken modulo the width, within the caller's segment.
  return shuffle(mask, bits, ((src_lane % std::max(width, 1)) + std::max(width, 1)) % std::max(width, 1), width, where);
}

uint64_t shfl_xor_bits(uint32_t mask, uint64_t bits, int lane_mask, int width, std::source_location where) {
  const int in_segment = linear_lane() % std::max(width, 1);
  return shuffle(mask, bits, in_segment ^ lane_mask, width, where);
}

namespace {
// Every lane's 8 bytes, for a full warp: one deposit and one wait, as a shuffle.
void gather(uint64_t bits, uint64_t (&all)[32], std::source_location where) {
  Thread& t = self();
  Block& b = *t_block;
  const int tid = static_cast<int>(&t - b.threads.data());
  if (static_cast<int>(b.threads.size()) - tid / 32 * 32 < 32) kernel_error(b, "mma at " + site(where) + ": needs a full warp");
  Warp& w = b.warps[static_cast<size_t>(tid / 32)];
  const int64_t n = t.shuffles;
  w.slot[n % 2][tid % 32] = bits;
  t.shuffles = n + 1;
  t.mask = 0xffffffffu;
  t.where = where;
  t.wait = Wait::shuffle;
  suspend(t);
  for (int l = 0; l < 32; ++l) all[l] = w.slot[n % 2][l];
}
}  // namespace

void mma_m16n8k16(bool bf16, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], std::source_location where) {
  uint64_t as01[32], as23[32], bs[32];
  gather(a[0] | uint64_t{a[1]} << 32, as01, where);
  gather(a[2] | uint64_t{a[3]} << 32, as23, where);
  gather(b[0] | uint64_t{b[1]} << 32, bs, where);
  auto elem = [bf16](uint64_t word, int half) {  // half: 0..3, the 16-bit element of a pair of registers
    const auto bits = static_cast<uint16_t>(word >> (16 * half));
    return bf16 ? bf16_bits_to_f32(bits) : f16_bits_to_f32(bits);
  };
  // A: register r of lane (g, t) holds row g + 8 (r & 1), cols 8 (r >> 1) + 2 t, + 1.
  // B: register r of lane (g, t) holds rows 8 r + 2 t, + 1 of col g.   C, D: rows g, g + 8, cols 2 t, + 1.
  auto A = [&](int row, int k) {
    const int lane = (row % 8) * 4 + (k % 8) / 2, reg = (row / 8) + 2 * (k / 8);
    return elem(reg < 2 ? as01[lane] : as23[lane], 2 * (reg % 2) + k % 2);
  };
  auto B = [&](int k, int col) { return elem(bs[col * 4 + (k % 8) / 2], 2 * (k / 8) + k % 2); };
  const int lane = static_cast<int>(&self() - t_block->threads.data()) % 32, g = lane / 4, tq = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * tq + e % 2;
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc = std::fma(A(row, k), B(k, col), acc);
    d[e] = acc;
  }
}

void ldmatrix_x4(uint32_t (&r)[4], const uint32_t* row, std::source_location where) {
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
    kernel_error(*t_block, "ldmatrix at " + site(where) + ": a row address is not 16-byte aligned");
  uint64_t rows[32];
  gather(reinterpret_cast<uintptr_t>(row), rows, where);
  const int lane = static_cast<int>(&self() - t_block->threads.data()) % 32;
  for (int i = 0; i < 4; ++i) r[i] = reinterpret_cast<const uint32_t*>(static_cast<uintptr_t>(rows[8 * i + lane / 4]))[lane % 4];
}

void ldmatrix_x4_trans(uint32_t (&r)[4], const uint32_t* row, std::source_location where) {
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
    kernel_error(*t_block, "ldmatrix at " + site(where) + ": a row address is not 16-byte aligned");
  uint64_t rows[32];
  gather(reinterpret_cast<uintptr_t>(row), rows, where);
  const int lane = static_cast<int>(&self() - t_block->threads.data()) % 32, g = lane / 4, t = lane % 4;
  auto element = [&](int matrix, int row_in) {  // element (row_in, g) of the matrix
    return uint32_t{reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(rows[8 * matrix + row_in]))[g]};
  };
  for (int i = 0; i < 4; ++i) r[i] = element(i, 2 * t) | element(i, 2 * t + 1) << 16;
}

void cp_async_16(void* dst, const void* src, int src_bytes, std::source_location where) {
  Thread& t = self();
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    kernel_error(*t_block, "cp.async at " + site(where) + ": an address is not 16-byte aligned");
  if (src_bytes != 0 && src_bytes != 16)
    kernel_error(*t_block, "cp.async at " + site(where) + ": reads 0 or 16 bytes, not " + std::to_string(src_bytes));
  if (src_bytes > 0 && !is_device_range(src, 16))
    kernel_error(*t_block, "cp.async at " + site(where) + ": the source is not device memory");
  t.open_group.push_back({dst, src, src_bytes});
}

namespace {
std::atomic<CpAsyncLanding> g_landing{CpAsyncLanding::random};

void land(const std::vector<Thread::Copy>& group) {
  for (const Thread::Copy& c : group) {
    std::memset(c.dst, 0, 16);
    std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
  }
}
}  // namespace

void set_cp_async_landing_for_testing(CpAsyncLanding landing) { g_landing = landing; }

void cp_async_commit() {
  Thread& t = self();
  const CpAsyncLanding landing = g_landing;
  const bool early = landing == CpAsyncLanding::at_commit ||
                     (landing == CpAsyncLanding::random && (t_block->coin() & 1u) != 0);
  if (early) land(t.open_group);
  t.copy_groups.push_back(early ? std::vector<Thread::Copy>{} : std::move(t.open_group));  // an empty group: landed
  t.open_group.clear();
}

void cp_async_wait(int pending, std::source_location where) {
  Thread& t = self();
  if (pending < 0) kernel_error(*t_block, "cp.async.wait_group at " + site(where) + ": a negative count");
  while (t.copy_groups.size() > static_cast<size_t>(pending)) {
    land(t.copy_groups.front());
    t.copy_groups.pop_front();
  }
}

namespace {
std::mutex g_launches_mutex;
std::deque<LaunchRecord> g_launches;  // the last 256
}  // namespace

std::vector<LaunchRecord> recent_launches() {
  std::lock_guard<std::mutex> lock(g_launches_mutex);
  return std::vector<LaunchRecord>(g_launches.begin(), g_launches.end());
}

namespace {
// The kernel's parameter types, demangled, without the project's namespaces:
// "(float const*, float*, long)".
std::string parameter_types(const std::type_info& signature) {
  int status = 0;
  char* d = abi::__cxa_demangle(signature.name(), nullptr, nullptr, &status);
  std::string s = status == 0 && d != nullptr ? d : signature.name();
  std::free(d);
  for (const std::string cut : {"(anonymous namespace)::", "amp::cuda::", "amp::math::", "amp::"})
    for (size_t at; (at = s.find(cut)) != std::string::npos;) s.erase(at, cut.size());
  const size_t open = s.find("(*)");  // "void (*)(...)": keep the parameter list
  return open == std::string::npos ? s : s.substr(open + 3);
}

// s as the inside of a JSON string.
std::string json_escaped(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}
}  // namespace

void launch_erased(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream, const char* name,
                   const std::type_info& signature, std::function<void()> body,
                   std::vector<std::pair<int, const void*>> pointers) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 || shmem > 48 * 1024) {
    set_last_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (const cudaError_t s = sticky_error(); s != cudaSuccess) {
    set_last_error(s);
    return;
  }
  count_launch(stream);
  std::string kernel = name;
  const DeclaredCost cost = take_declared_cost();
  if (launch_log_on()) {
    const auto triple = [](unsigned x, unsigned y, unsigned z) {
      return "[" + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + "]";
    };
    log_line("kernel", ",\"name\":\"" + json_escaped(kernel) + "\",\"params\":\"" +
                           json_escaped(parameter_types(signature)) + "\",\"grid\":" + triple(grid.x, grid.y, grid.z) +
                           ",\"block\":" + triple(block.x, block.y, block.z) + ",\"shmem\":" + std::to_string(shmem) +
                           ",\"read\":" + std::to_string(cost.read) + ",\"written\":" + std::to_string(cost.written) +
                           ",\"flops\":" + std::to_string(cost.flops) +
                           ",\"declared\":" + (cost.declared ? "true" : "false"),
             stream);
  }
  {
    std::lock_guard<std::mutex> lock(g_launches_mutex);
    g_launches.push_back(LaunchRecord{kernel, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                                      cost.declared ? cost.read : -1, cost.declared ? cost.written : -1,
                                      cost.declared ? cost.flops : -1});
    if (g_launches.size() > 256) g_launches.pop_front();
  }
  Op op;
  op.name = "kernel " + kernel;
  if (dry_run()) {  // recorded, not run (emu.h)
    op.step = [] { return true; };
    if (const cudaError_t err = enqueue(stream, std::move(op)); err != cudaSuccess) set_last_error(err);
    return;
  }
  const uint64_t seed = random_u64();
  op.step = [grid, block, kernel, seed, body = std::move(body), pointers = std::move(pointers)] {
    for (const auto& [index, p] : pointers)
      if (!is_device_range(p, 0) && !is_pinned_range(p, 0)) {
        fault("kernel " + kernel + ": argument " + std::to_string(index) +
                  " is a pointer to neither device nor pinned memory (a host pointer handed to a kernel?)",
              cudaErrorIllegalAddress);
        return true;
      }
    Block b;
    b.kernel = kernel;
    const size_t n = static_cast<size_t>(block.x) * block.y * block.z;
    std::mt19937_64 rng(seed);
    const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
    std::vector<uint64_t> block_order(blocks);
    for (uint64_t i = 0; i < blocks; ++i) block_order[i] = i;
    std::shuffle(block_order.begin(), block_order.end(), rng);
    for (const uint64_t linear : block_order) {
      const auto bx = static_cast<unsigned>(linear % grid.x);
      const auto by = static_cast<unsigned>(linear / grid.x % grid.y);
      const auto bz = static_cast<unsigned>(linear / grid.x / grid.y);
      {
          b.threads.clear();
          b.threads.resize(n);
          b.warps.assign((n + 31) / 32, Warp{});
          b.arrived = 0;
          const uint64_t serial = ++t_block_serial;
          size_t i = 0;
          for (unsigned tz = 0; tz < block.z; ++tz)
            for (unsigned ty = 0; ty < block.y; ++ty)
              for (unsigned tx = 0; tx < block.x; ++tx)
                b.threads[i++].ctx = ThreadContext{uint3{tx, ty, tz}, uint3{bx, by, bz}, block, grid, serial};
          Block* outer = t_block;
          t_block = &b;
          try {
            run_block(b, body, rng);
          } catch (...) {
            t_block = outer;
            b.threads.clear();  // unwinds the suspended fibers
            throw;
          }
          t_block = outer;
        }
    }
    return true;
  };
  if (const cudaError_t err = enqueue(stream, std::move(op)); err != cudaSuccess) set_last_error(err);
}

}  // namespace amp::emu
