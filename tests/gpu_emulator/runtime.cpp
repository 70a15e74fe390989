// The emulated GPU's engine (device.h) and CUDA runtime API (cuda_runtime.h).
//
// One device thread runs the operations of every stream. An operation is eligible a seeded random
// delay after it was enqueued (at once while a host thread waits for the device); among the
// streams whose head is eligible, the device thread takes one at random. The legacy stream 0 waits
// for all earlier work of the blocking streams and they for it; non-blocking streams order only
// through events.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "capture.h"
#include "device.h"
#include "emu.h"
#include "cuda_profiler_api.h"
#include "launch_log.h"

namespace amp::emu {

namespace {

using Clock = std::chrono::steady_clock;

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0') {
    std::fprintf(stderr, "emulated GPU: %s=%s is not an integer; using %ld\n", name, v, fallback);
    return fallback;
  }
  return x;
}

struct Pending {
  Op op;
  uint64_t seq;              // global enqueue order, for the legacy stream's implicit waits
  Clock::time_point eligible;
};

struct Stream {
  bool blocking = true;      // created without cudaStreamNonBlocking: orders against stream 0
  int priority = 0;          // as asked, clamped to cudaDeviceGetStreamPriorityRange's (not scheduled by)
  bool destroyed = false;    // released once its queue drains
  std::deque<Pending> queue;
};

// Records are numbered 1, 2, ...; each completes on its own (they may sit on different streams).
struct Event {
  uint64_t recorded = 0;    // records enqueued
  uint64_t done_upto = 0;   // every record up to this one has run
  std::set<uint64_t> done;  // records past done_upto that have run
  bool destroyed = false;   // kept (a queued record may still refer to it), but unusable
  bool is_done(uint64_t record) const { return record <= done_upto || done.count(record) > 0; }
  void complete(uint64_t record) {
    done.insert(record);
    while (done.count(done_upto + 1) > 0) done.erase(++done_upto);
  }
};

class Engine {
 public:
  // The seed mixes in the MPI rank, so that the ranks of one job do not schedule in lockstep.
  Engine()
      : rng_(static_cast<uint64_t>(env_long("AMP_EMU_SEED", 1)) * 0x9e3779b97f4a7c15ull +
             static_cast<uint64_t>(env_long("OMPI_COMM_WORLD_RANK", env_long("PMI_RANK", 0)))) {
    device_ = std::thread([this] { run(); });
    device_.detach();  // never joined: the engine lives for the whole process, like a driver
  }

  std::mutex m;
  std::condition_variable device_cv, host_cv;
  std::unordered_map<Stream*, std::unique_ptr<Stream>> streams;  // created streams
  Stream legacy;                                                  // stream 0
  int host_waiters = 0;
  bool paused = false;
  uint64_t next_seq = 0;
  cudaError_t sticky = cudaSuccess;
  std::atomic<cudaError_t> sticky_atomic{cudaSuccess};  // the same, readable without m
  std::string sticky_message;
  std::mt19937_64 rng_;

  Stream* find(cudaStream_t s) {  // with m held
    if (s == nullptr) return &legacy;
    auto it = streams.find(reinterpret_cast<Stream*>(s));
    return it == streams.end() || it->second->destroyed ? nullptr : it->second.get();
  }

  bool all_idle() const {  // with m held
    if (!legacy.queue.empty()) return false;
    for (const auto& [p, st] : streams)
      if (!st->queue.empty()) return false;
    return true;
  }

  cudaError_t enqueue(cudaStream_t s, Op op) {
    std::lock_guard<std::mutex> lock(m);
    if (sticky != cudaSuccess) return sticky;
    Stream* st = find(s);
    if (st == nullptr) return cudaErrorInvalidResourceHandle;
    // Up to 200 us before anything may start: the host runs ahead, as it does with a real device.
    const auto delay = std::chrono::microseconds(static_cast<int64_t>(rng_() % 200));
    st->queue.push_back(Pending{std::move(op), next_seq++, Clock::now() + delay});
    device_cv.notify_one();
    return cudaSuccess;
  }

 private:
  std::thread device_;

  // Whether the head of st may run now, by the legacy stream's implicit ordering (m held).
  bool ordered(const Stream* st) const {
    const uint64_t seq = st->queue.front().seq;
    if (st == &legacy) {
      for (const auto& [p, other] : streams)
        if (other->blocking && !other->queue.empty() && other->queue.front().seq < seq) return false;
      return true;
    }
    return !st->blocking || legacy.queue.empty() || legacy.queue.front().seq > seq;
  }

  void run() {
    std::unique_lock<std::mutex> lock(m);
    for (;;) {
      const auto now = Clock::now();
      std::vector<Stream*> ready;
      Clock::time_point next = Clock::time_point::max();
      auto consider = [&](Stream* st) {
        if (st->queue.empty() || !ordered(st)) return;
        const auto when = st->queue.front().eligible;
        if (host_waiters > 0 || when <= now) ready.push_back(st);
        else next = std::min(next, when);
      };
      if (!paused) {
        consider(&legacy);
        for (auto& [p, st] : streams) consider(st.get());
      }
      if (ready.empty()) {
        if (next == Clock::time_point::max()) device_cv.wait(lock);
        else device_cv.wait_until(lock, next);
        reap();
        continue;
      }
      Stream* st = ready[rng_() % ready.size()];
      Pending& head = st->queue.front();
      bool done = true;
      if (sticky == cudaSuccess) {
        Op& op = head.op;
        lock.unlock();
        try {
          done = op.step();
        } catch (const std::exception& e) {
          fault(op.name + ": " + e.what());
        } catch (...) {
          fault(op.name + ": an exception that is not a std::exception");
        }
        lock.lock();
      }
      if (done) {
        st->queue.pop_front();
        host_cv.notify_all();
      } else {
        // Waiting on peers or an event: poll again shortly, let the other streams go first.
        head.eligible = Clock::now() + std::chrono::microseconds(20);
        if (host_waiters > 0) {
          lock.unlock();
          std::this_thread::sleep_for(std::chrono::microseconds(20));
          lock.lock();
        }
      }
      reap();
    }
  }

  void reap() {  // with m held: streams destroyed by the program go once they drain
    if (host_waiters > 0) return;  // a waiter may still be looking at one
    for (auto it = streams.begin(); it != streams.end();) {
      if (it->second->destroyed && it->second->queue.empty()) it = streams.erase(it);
      else ++it;
    }
  }
};

Engine& engine() {
  static Engine* e = new Engine;  // never destroyed: work may still be in flight at exit
  return *e;
}

// Device and pinned allocations: base -> size.
struct Memory {
  std::mutex m;
  std::map<uintptr_t, size_t> device, pinned;
  size_t device_bytes = 0, high_water = 0;
  size_t limit = static_cast<size_t>(env_long("AMP_EMU_MEMORY_MB", dry_run() ? 81920 : 8192)) << 20;
};
Memory& memory() {
  static Memory* mem = new Memory;
  return *mem;
}

bool in_map(const std::map<uintptr_t, size_t>& map, const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = map.upper_bound(a);
  if (it == map.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second && a + bytes >= a;
}

std::atomic<int64_t> g_launches{0}, g_host_syncs{0}, g_d2h{0}, g_graph_launches{0}, g_graph_ops{0},
    g_allocations{0};
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;

// The node's emulated GPUs are AMP_EMU_DEVICES (8 by default); a process sees those that
// CUDA_VISIBLE_DEVICES lists, as the driver reads it: indices or UUIDs (a prefix of one is enough),
// separated by commas, up to the first entry that names no device (or one already listed), in the
// order given; unset, all of them. Physical GPU p's UUID is the same in every process, so that two
// processes given the same GPU can tell.
cudaUUID_t physical_uuid(int p) {
  cudaUUID_t u{};
  const unsigned char pattern[16] = {0xe4, 0x1a, 0x7e, 0xd0, 0x00, 0x00, 0x4e, 0x3a, 0x8c, 0x6d, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  std::memcpy(u.bytes, pattern, sizeof pattern);
  u.bytes[15] = static_cast<char>(p);
  return u;
}

std::string uuid_text(const cudaUUID_t& u) {
  char buf[48];
  const auto* b = reinterpret_cast<const unsigned char*>(u.bytes);
  std::snprintf(buf, sizeof buf, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
                b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return buf;
}

std::vector<int> visible_devices() {
  const int physical = static_cast<int>(std::clamp(env_long("AMP_EMU_DEVICES", 8), 0L, 64L));
  std::vector<int> visible;
  const char* list = std::getenv("CUDA_VISIBLE_DEVICES");
  if (list == nullptr) {
    for (int p = 0; p < physical; ++p) visible.push_back(p);
    return visible;
  }
  const std::string text = list;
  for (size_t at = 0; at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    std::string entry = text.substr(at, comma - at);
    entry.erase(0, entry.find_first_not_of(' '));
    entry.erase(entry.find_last_not_of(' ') + 1);
    int found = -1;
    if (!entry.empty() && entry.find_first_not_of("0123456789") == std::string::npos && entry.size() < 4) {
      found = std::stoi(entry);
      if (found >= physical) found = -1;
    } else if (entry.rfind("GPU-", 0) == 0) {
      for (int p = 0; p < physical && found < 0; ++p)
        if (uuid_text(physical_uuid(p)).rfind(entry, 0) == 0) found = p;
    }
    if (found < 0 || std::find(visible.begin(), visible.end(), found) != visible.end()) break;
    visible.push_back(found);
    at = comma + 1;
  }
  return visible;
}

int device_count() { return static_cast<int>(visible_devices().size()); }

// Every API call starts here: a sticky fault is returned by everything after it.
cudaError_t result(cudaError_t err) {
  if (err == cudaSuccess) {
    const cudaError_t s = sticky_error();
    return s == cudaSuccess ? s : set_last_error(s);
  }
  return set_last_error(err);
}

}  // namespace

cudaError_t enqueue(cudaStream_t s, Op op) {
  if (capture_on())  // a capture records the work (capture.cpp)
    if (const auto captured = capture_enqueue(s, op.name, [op] { return op; })) return *captured;
  return engine().enqueue(s, std::move(op));
}

std::optional<bool> stream_is_blocking(cudaStream_t s) {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  const Stream* st = e.find(s);
  if (st == nullptr) return std::nullopt;
  return st->blocking;
}

cudaError_t host_wait(const char*, const std::function<bool()>& pred) {
  Engine& e = engine();
  g_host_syncs.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::mutex> lock(e.m);
  ++e.host_waiters;
  e.device_cv.notify_one();
  e.host_cv.wait(lock, [&] { return e.sticky != cudaSuccess || pred(); });
  --e.host_waiters;
  return e.sticky;
}

void fault(const std::string& message, cudaError_t code) {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  if (e.sticky != cudaSuccess) return;
  e.sticky = code;
  e.sticky_atomic = code;
  e.sticky_message = message;
  std::fprintf(stderr, "emulated GPU: device fault: %s\n", message.c_str());
  std::fflush(stderr);
  e.host_cv.notify_all();
}

cudaError_t sticky_error() { return engine().sticky_atomic.load(); }

bool is_device_range(const void* p, size_t bytes) {
  Memory& mem = memory();
  std::lock_guard<std::mutex> lock(mem.m);
  return in_map(mem.device, p, bytes);
}

bool is_pinned_range(const void* p, size_t bytes) {
  Memory& mem = memory();
  std::lock_guard<std::mutex> lock(mem.m);
  return in_map(mem.pinned, p, bytes);
}

void count_launch(cudaStream_t s) {
  if (!capturing(s)) g_launches.fetch_add(1, std::memory_order_relaxed);  // captured: launched with its graph
}
void count_graph_launch(int64_t ops) {
  g_graph_launches.fetch_add(1, std::memory_order_relaxed);
  g_graph_ops.fetch_add(ops, std::memory_order_relaxed);
}
void count_d2h() { g_d2h.fetch_add(1, std::memory_order_relaxed); }

uint64_t random_u64() {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  return e.rng_();
}

cudaError_t set_last_error(cudaError_t err) {
  t_last_error = err;
  return err;
}

Counters counters() {
  return Counters{g_launches.load(), g_host_syncs.load(), g_d2h.load(), g_graph_launches.load(), g_graph_ops.load(),
                  g_allocations.load()};
}

size_t device_bytes_high_water() {
  Memory& mem = memory();
  std::lock_guard<std::mutex> lock(mem.m);
  return mem.high_water;
}

std::string last_fault() {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  return e.sticky_message;
}

void clear_fault_for_testing() {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  e.sticky = cudaSuccess;
  e.sticky_atomic = cudaSuccess;
  e.sticky_message.clear();
  t_last_error = cudaSuccess;
}

void pause_for_testing(bool paused) {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  e.paused = paused;
  e.device_cv.notify_one();
}

void drain_for_testing() {
  Engine& e = engine();
  std::unique_lock<std::mutex> lock(e.m);
  ++e.host_waiters;
  e.device_cv.notify_one();
  e.host_cv.wait(lock, [&] { return e.all_idle(); });
  --e.host_waiters;
}

}  // namespace amp::emu

using namespace amp::emu;

// --- devices and errors

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return result(cudaErrorInvalidValue);
  // AMP_EMU_DEVICE_ERROR=N: the driver's answer is error N (46: the GPUs taken in exclusive-process
  // mode; 35: no driver), as a node whose GPUs cannot be used answers.
  if (const long err = env_long("AMP_EMU_DEVICE_ERROR", 0); err != 0) {
    *count = 0;
    return result(static_cast<cudaError_t>(err));
  }
  *count = device_count();
  return result(cudaSuccess);
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return result(cudaErrorInvalidDevice);
  t_device = device;
  return result(cudaSuccess);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return result(cudaErrorInvalidValue);
  const std::vector<int> visible = visible_devices();
  if (device < 0 || device >= static_cast<int>(visible.size())) return result(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "Emulated GPU %d", visible[static_cast<size_t>(device)]);
  prop->uuid = physical_uuid(visible[static_cast<size_t>(device)]);
  prop->multiProcessorCount = static_cast<int>(std::max(1L, env_long("AMP_EMU_SMS", 2)));
  return result(cudaSuccess);
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return result(cudaErrorInvalidValue);
  *device = t_device;
  return result(cudaSuccess);
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return result(cudaErrorInvalidValue);
  if (device < 0 || device >= device_count()) return result(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = static_cast<int>(std::max(1L, env_long("AMP_EMU_SMS", 2))); break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    default: return result(cudaErrorInvalidValue);
  }
  return result(cudaSuccess);
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return result(cudaSuccess);
}

cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t err = capture_check_device_sync(); err != cudaSuccess) return result(err);
  Engine& e = engine();
  return result(host_wait("cudaDeviceSynchronize", [&] { return e.all_idle(); }));
}

cudaError_t cudaProfilerStart() {
  if (amp::emu::launch_log_on()) amp::emu::log_line("profiler_start", "", nullptr, false);
  return cudaSuccess;
}

cudaError_t cudaProfilerStop() {
  if (amp::emu::launch_log_on()) amp::emu::log_line("profiler_stop", "", nullptr, false);
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t err = t_last_error;
  t_last_error = cudaSuccess;
  const cudaError_t s = sticky_error();
  return s != cudaSuccess ? s : err;
}

cudaError_t cudaPeekAtLastError() {
  const cudaError_t s = sticky_error();
  return s != cudaSuccess ? s : t_last_error;
}

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorDevicesUnavailable: return "cudaErrorDevicesUnavailable";
    case cudaErrorSystemNotReady: return "cudaErrorSystemNotReady";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureMerge: return "cudaErrorStreamCaptureMerge";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorUnknown: return "cudaErrorUnknown";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorDevicesUnavailable: return "CUDA-capable device(s) is/are busy or unavailable";
    case cudaErrorSystemNotReady: return "system not yet initialized";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureMerge: return "operation would result in a merge of separate capture sequences";
    case cudaErrorStreamCaptureUnmatched: return "capture was not ended in the same stream as it began";
    case cudaErrorStreamCaptureUnjoined: return "capturing stream has unjoined work";
    case cudaErrorStreamCaptureIsolation: return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorUnknown: return "unknown error";
  }
  return "unknown error";
}

// --- memory

cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (p == nullptr) return result(cudaErrorInvalidValue);
  *p = nullptr;
  if (const cudaError_t err = capture_check_unsafe(); err != cudaSuccess) return result(err);
  if (bytes == 0) return result(cudaSuccess);
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  Memory& mem = memory();
  const size_t rounded = (bytes + 255) / 256 * 256;
  {
    std::lock_guard<std::mutex> lock(mem.m);
    if (mem.device_bytes + rounded > mem.limit) return result(cudaErrorMemoryAllocation);
  }
  void* q = dry_run() ? reserve_device_memory(rounded) : std::aligned_alloc(256, rounded);
  if (q == nullptr) return result(cudaErrorMemoryAllocation);
  if (!dry_run()) std::memset(q, 0xff, rounded);  // NaN in every float type: uninitialised reads show
  std::lock_guard<std::mutex> lock(mem.m);
  mem.device.emplace(reinterpret_cast<uintptr_t>(q), bytes);
  mem.device_bytes += rounded;
  mem.high_water = std::max(mem.high_water, mem.device_bytes);
  *p = q;
  return result(cudaSuccess);
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  if (free == nullptr || total == nullptr) return result(cudaErrorInvalidValue);
  Memory& mem = memory();
  std::lock_guard<std::mutex> lock(mem.m);
  *free = mem.limit - std::min(mem.limit, mem.device_bytes);
  *total = mem.limit;
  return result(cudaSuccess);
}

namespace {

// cudaFree and cudaFreeHost: an allocation of `map` is released once the whole device is idle (both
// calls synchronise the device, as the real ones do), poisoned first, then given back to the heap.
cudaError_t free_after_device(std::map<uintptr_t, size_t> Memory::*map, void* p, const char* what, bool device) {
  if (p == nullptr) return result(cudaSuccess);
  if (const cudaError_t err = capture_check_unsafe(); err != cudaSuccess) return result(err);
  Memory& mem = memory();
  {
    std::lock_guard<std::mutex> lock(mem.m);
    if ((mem.*map).find(reinterpret_cast<uintptr_t>(p)) == (mem.*map).end()) return result(cudaErrorInvalidValue);
  }
  Engine& e = engine();
  host_wait(what, [&] { return e.all_idle(); });
  std::lock_guard<std::mutex> lock(mem.m);
  auto it = (mem.*map).find(reinterpret_cast<uintptr_t>(p));
  const size_t rounded = (it->second + 255) / 256 * 256;
  if (device) mem.device_bytes -= rounded;
  if (device && dry_run()) {
    (mem.*map).erase(it);
    release_device_memory(p, rounded);
    return result(cudaSuccess);
  }
  std::memset(p, 0xff, it->second);
  (mem.*map).erase(it);
  std::free(p);
  return result(cudaSuccess);
}

}  // namespace

cudaError_t cudaFree(void* p) { return free_after_device(&Memory::device, p, "cudaFree", true); }

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  if (p == nullptr) return result(cudaErrorInvalidValue);
  if (const cudaError_t err = capture_check_unsafe(); err != cudaSuccess) return result(err);
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  void* q = std::malloc(bytes > 0 ? bytes : 1);
  if (q == nullptr) return result(cudaErrorMemoryAllocation);
  Memory& mem = memory();
  std::lock_guard<std::mutex> lock(mem.m);
  mem.pinned.emplace(reinterpret_cast<uintptr_t>(q), bytes);
  *p = q;
  return result(cudaSuccess);
}

cudaError_t cudaFreeHost(void* p) { return free_after_device(&Memory::pinned, p, "cudaFreeHost", false); }

namespace {

// Resolves cudaMemcpyDefault and checks that each side is where kind says.
cudaError_t check_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind& kind) {
  const bool dst_dev = is_device_range(dst, bytes), src_dev = is_device_range(src, bytes);
  if (kind == cudaMemcpyDefault)
    kind = src_dev ? (dst_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                   : (dst_dev ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
  const bool want_dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool want_src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind > cudaMemcpyDefault) return cudaErrorInvalidMemcpyDirection;
  if (dst_dev != want_dst_dev || src_dev != want_src_dev) {
    std::fprintf(stderr, "emulated GPU: cudaMemcpy of %zu bytes: %s %p is %s, %s %p is %s\n", bytes, "dst", dst,
                 dst_dev ? "device memory" : "not device memory", "src", src,
                 src_dev ? "device memory" : "not device memory");
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  if (bytes == 0) return result(cudaSuccess);
  if (dst == nullptr || src == nullptr) return result(cudaErrorInvalidValue);
  if (const cudaError_t err = check_copy(dst, src, bytes, kind); err != cudaSuccess) return result(err);
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (d < s + bytes && s < d + bytes) {  // (a pageable source cannot overlap device memory)
    std::fprintf(stderr, "emulated GPU: cudaMemcpyAsync: source and destination overlap (undefined on a GPU)\n");
    return result(cudaErrorInvalidValue);
  }
  Op op;
  op.name = "cudaMemcpyAsync";
  const bool pinned = is_pinned_range(kind == cudaMemcpyDeviceToHost ? dst : src, bytes);
  static const char* const kinds[] = {"h2h", "h2d", "d2h", "d2d"};
  log_line("memcpy", std::string(",\"kind\":\"") + kinds[kind] + "\",\"pinned\":" + (pinned ? "true" : "false") +
                         ",\"bytes\":" + std::to_string(bytes), stream);
  if (dry_run()) {
    // Nothing moves; what the host reads back is zeros (emu.h), there from the call on.
    if (kind == cudaMemcpyDeviceToHost) std::memset(dst, 0, bytes);
    op.step = [] { return true; };
  } else if (kind == cudaMemcpyHostToDevice && !is_pinned_range(src, bytes) && !capturing(stream)) {
    // From pageable memory the source is staged before the call returns (a captured copy reads the
    // host memory when the graph runs, as a graph's copy node does).
    auto staged = std::make_shared<std::vector<unsigned char>>(static_cast<const unsigned char*>(src),
                                                                static_cast<const unsigned char*>(src) + bytes);
    op.step = [dst, staged] {
      std::memcpy(dst, staged->data(), staged->size());
      return true;
    };
  } else {
    op.step = [dst, src, bytes] {
      std::memcpy(dst, src, bytes);
      return true;
    };
  }
  // Into pinned memory, the old contents are gone at once: a host read before the copy's event
  // sees NaN bytes, not a plausible stale value.
  if (kind == cudaMemcpyDeviceToHost && is_pinned_range(dst, bytes) && !dry_run() && !capturing(stream))
    std::memset(dst, 0xff, bytes);
  if (kind == cudaMemcpyDeviceToHost) count_d2h();
  // From pageable memory, "the driver may synchronize with the stream and stage the copy into pinned
  // memory" (CUDA's API synchronization behavior): counted as a host synchronisation, so that a
  // training step's pageable uploads show (the runtime stages them through pinned memory).
  if (kind == cudaMemcpyHostToDevice && !pinned) g_host_syncs.fetch_add(1, std::memory_order_relaxed);
  if (const cudaError_t err = enqueue(stream, std::move(op)); err != cudaSuccess) return result(err);
  if (kind == cudaMemcpyDeviceToHost && !is_pinned_range(dst, bytes))
    return cudaStreamSynchronize(stream);  // into pageable memory the host waits for the copy
  return result(cudaSuccess);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t unsafe = capture_check_unsafe(); unsafe != cudaSuccess) return result(unsafe);
  const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(nullptr);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return result(cudaSuccess);
  if (!is_device_range(p, bytes)) return result(cudaErrorInvalidValue);
  log_line("memset", ",\"bytes\":" + std::to_string(bytes), stream);
  const bool dry = dry_run();
  return result(enqueue(stream, Op{"cudaMemsetAsync", [p, value, bytes, dry] {
                                     if (!dry) std::memset(p, value, bytes);
                                     return true;
                                   }}));
}

cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (const cudaError_t unsafe = capture_check_unsafe(); unsafe != cudaSuccess) return result(unsafe);
  const cudaError_t err = cudaMemsetAsync(p, value, bytes, nullptr);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(nullptr);
}

// --- streams

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  if (s == nullptr) return result(cudaErrorInvalidValue);
  Engine& e = engine();
  auto st = std::make_unique<Stream>();
  st->blocking = (flags & cudaStreamNonBlocking) == 0;
  std::lock_guard<std::mutex> lock(e.m);
  *s = reinterpret_cast<cudaStream_t>(st.get());
  e.streams.emplace(st.get(), std::move(st));
  return result(cudaSuccess);
}

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int priority) {
  const cudaError_t err = cudaStreamCreateWithFlags(s, flags);
  if (err != cudaSuccess) return err;
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  e.find(*s)->priority = std::clamp(priority, greatest, least);  // CUDA clamps to the range too
  return result(cudaSuccess);
}

cudaError_t cudaStreamGetPriority(cudaStream_t s, int* priority) {
  if (priority == nullptr) return result(cudaErrorInvalidValue);
  if (s == nullptr) {
    *priority = 0;
    return result(cudaSuccess);
  }
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  const Stream* st = e.find(s);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  *priority = st->priority;
  return result(cudaSuccess);
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  if (s == nullptr) return result(cudaErrorInvalidResourceHandle);
  Stream* st = e.find(s);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  st->destroyed = true;  // its queued work still runs; the device thread frees it afterwards
  e.device_cv.notify_one();
  return result(cudaSuccess);
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (const cudaError_t err = capture_check_stream_sync(s); err != cudaSuccess) return result(err);
  Engine& e = engine();
  Stream* st;
  {
    std::lock_guard<std::mutex> lock(e.m);
    st = e.find(s);
  }
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  return result(host_wait("cudaStreamSynchronize", [st] { return st->queue.empty(); }));
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (const cudaError_t err = capture_check_stream_sync(s); err != cudaSuccess) return set_last_error(err);
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  Stream* st = e.find(s);
  if (st == nullptr) return set_last_error(cudaErrorInvalidResourceHandle);
  if (e.sticky != cudaSuccess) return set_last_error(e.sticky);
  return st->queue.empty() ? cudaSuccess : set_last_error(cudaErrorNotReady);
}

// --- events

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* ev, unsigned int) {
  if (ev == nullptr) return result(cudaErrorInvalidValue);
  *ev = reinterpret_cast<cudaEvent_t>(new Event);
  return result(cudaSuccess);
}

cudaError_t cudaEventCreate(cudaEvent_t* ev) { return cudaEventCreateWithFlags(ev, cudaEventDefault); }

namespace {
// The event behind a handle, or nullptr for a null or destroyed one (m held).
Event* live_event(cudaEvent_t ev) {
  auto* event = reinterpret_cast<Event*>(ev);
  return event == nullptr || event->destroyed ? nullptr : event;
}

// A live event and its latest record number (0: never recorded), read under the engine's lock.
struct LatestRecord {
  Event* event;
  uint64_t record;
};
std::optional<LatestRecord> latest_record(cudaEvent_t ev) {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  Event* event = live_event(ev);
  if (event == nullptr) return std::nullopt;
  return LatestRecord{event, event->recorded};
}
}  // namespace

cudaError_t cudaEventDestroy(cudaEvent_t ev) {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  Event* event = live_event(ev);
  if (event == nullptr) return set_last_error(cudaErrorInvalidResourceHandle);
  event->destroyed = true;  // never freed: a record still queued refers to it (events are small)
  // Kept reachable, so that LeakSanitizer (preset cuda-emu-asan) does not report it as lost.
  static std::vector<Event*>* const destroyed = new std::vector<Event*>;
  destroyed->push_back(event);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t s) {
  Engine& e = engine();
  const auto latest = latest_record(ev);
  if (!latest) return set_last_error(cudaErrorInvalidResourceHandle);
  if (const auto captured = capture_event_record(ev, s)) return result(*captured);  // a capture's join point
  Event* event = latest->event;
  const uint64_t target = latest->record + 1;
  const cudaError_t err = enqueue(s, Op{"cudaEventRecord", [&e, event, target] {
                                         std::lock_guard<std::mutex> lock(e.m);
                                         event->complete(target);
                                         return true;
                                       }});
  if (err != cudaSuccess) return result(err);  // not recorded: the event keeps its last record
  std::lock_guard<std::mutex> lock(e.m);
  event->recorded = std::max(event->recorded, target);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t ev) {
  if (const cudaError_t err = capture_check_event_use(ev); err != cudaSuccess) return set_last_error(err);
  // A potentially unsafe call under a capture's mode, as on a GPU: another thread's query during a
  // global-mode capture invalidates it (the NCCL watchdog's polls, pytorch/pytorch#104487).
  if (const cudaError_t err = capture_check_unsafe(); err != cudaSuccess) return set_last_error(err);
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.m);
  Event* event = live_event(ev);
  if (event == nullptr) return set_last_error(cudaErrorInvalidResourceHandle);
  if (e.sticky != cudaSuccess) return set_last_error(e.sticky);
  // As with the real runtime, NotReady also lands in the calling thread's last-error slot.
  return event->is_done(event->recorded) ? cudaSuccess : set_last_error(cudaErrorNotReady);
}

cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
  const auto latest = latest_record(ev);
  if (!latest) return set_last_error(cudaErrorInvalidResourceHandle);
  if (const cudaError_t err = capture_check_event_use(ev); err != cudaSuccess) return set_last_error(err);
  Event* event = latest->event;
  const uint64_t target = latest->record;
  // Counted even when the event is already complete: on a real device the call is a sync point.
  return result(host_wait("cudaEventSynchronize", [event, target] { return event->is_done(target); }));
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned int) {
  Engine& e = engine();
  const auto latest = latest_record(ev);  // the most recent record at the call; 0: nothing to wait for
  if (!latest) return set_last_error(cudaErrorInvalidResourceHandle);
  const bool blocking = stream_is_blocking(s).value_or(false);
  if (const auto captured = capture_stream_wait(s, ev, latest->record > 0, blocking)) return result(*captured);
  Event* event = latest->event;
  const uint64_t target = latest->record;
  return result(enqueue(s, Op{"cudaStreamWaitEvent", [&e, event, target] {
                               std::lock_guard<std::mutex> lock(e.m);
                               return event->is_done(target);
                             }}));
}
