// The emulated GPU's NCCL (see nccl.h for what it checks): the ranks of one node meet in a POSIX
// shared-memory segment; collectives are pollable operations on the emulated device's streams.
//
// The segment (named by the unique id, the same fixed size for every rank) holds a header and one
// data slot of kSlotBytes per rank. Every rank registers its pid (a rank taken twice, or a
// different nranks, is an invalid argument) and counts itself in `joined`; the last rank to join
// unlinks the name, the mapping lives on. A collective moves through the slots in chunks. Chunks
// are numbered 1, 2, ... per communicator (seq), the same on every rank because every rank runs the
// same collectives in the same order. Per rank, two lock-free counters in shared memory:
//   arrive = the last chunk the rank has written into its slot (with its description, `desc`),
//   depart = the last chunk the rank has finished reading from all slots.
// For chunk seq a rank (1) waits until every depart >= seq - 1 (nobody still reads its slot), writes
// its part and its desc, publishes arrive = seq; (2) waits until every arrive >= seq, checks that all
// descs agree, computes its output from the slots (reductions in rank order, so every rank gets the
// same bits), publishes depart = seq. Waiting is step() returning false: the device thread polls
// again later and runs other streams meanwhile. A peer that never arrives keeps the op pending.
#include "nccl.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "capture.h"
#include "device.h"
#include "emu.h"
#include "launch_log.h"
#include "runtime/core/half.h"

namespace amp::emu {
namespace {

constexpr uint64_t kMagic = 0x6c63636e2d706d61ull;  // "amp-nccl"
constexpr int kMaxRanks = 16;
constexpr size_t kSlotBytes = size_t{4} << 20;
constexpr char kPrefix[] = "/amp_nccl_";

enum Kind : uint64_t { kAllReduce = 1, kBroadcast = 2, kAllGather = 3, kAllToAll = 4 };

// What a rank runs in a chunk; all ranks' must be equal. An all-to-all's count is per peer; its
// chunk is n elements for each peer, laid out peer by peer in the slot.
struct Desc {
  uint64_t kind = 0, op = 0, dtype = 0, count = 0, root = 0;
  bool operator==(const Desc&) const = default;
};

struct alignas(64) RankArea {
  uint64_t pid;     // 0 until the rank registers
  uint64_t arrive;  // the last chunk this rank has written into its slot
  uint64_t depart;  // the last chunk this rank has finished reading
  Desc desc;        // the collective of chunk `arrive`
};
struct Header {
  uint64_t magic, nranks, joined;
  uint64_t connected;  // ranks that have issued their first collective (lazy connection, NCCL >= 2.22)
  RankArea rank[kMaxRanks];
};
constexpr size_t kDataOffset = (sizeof(Header) + 4095) / 4096 * 4096;
constexpr size_t kSegmentBytes = kDataOffset + kMaxRanks * kSlotBytes;  // sparse: untouched slots cost nothing

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
uint64_t load(uint64_t& v) { return std::atomic_ref<uint64_t>(v).load(std::memory_order_acquire); }
void store(uint64_t& v, uint64_t x) { std::atomic_ref<uint64_t>(v).store(x, std::memory_order_release); }
uint64_t cas(uint64_t& v, uint64_t expected, uint64_t desired) {  // returns the value found
  std::atomic_ref<uint64_t>(v).compare_exchange_strong(expected, desired, std::memory_order_acq_rel);
  return expected;
}

std::mutex g_error_mutex;
std::string g_last_error;

ncclResult_t fail(ncclResult_t r, const std::string& text) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  g_last_error = text;
  return r;
}

// --- element types: storage S, arithmetic in Acc, converted once at the end

template <class T>
struct Plain {
  using S = T;
  using Acc = T;
  static Acc in(S s) { return s; }
  static S out(Acc a) { return a; }
};
template <float (*In)(uint16_t), uint16_t (*Out)(float)>
struct Narrow {  // fp16 and bf16: float arithmetic, the project's bit-exact conversions
  using S = uint16_t;
  using Acc = float;
  static float in(uint16_t b) { return In(b); }
  static uint16_t out(float f) { return Out(f); }
};
using F16 = Narrow<f16_bits_to_f32, f32_to_f16_bits>;
using BF16 = Narrow<bf16_bits_to_f32, f32_to_bf16_bits>;

// Calls f(traits) for dtype; returns false for an unsupported one.
template <class F>
bool with_type(uint64_t dtype, F&& f) {
  switch (dtype) {
    case ncclInt8: f(Plain<int8_t>{}); return true;
    case ncclUint8: f(Plain<uint8_t>{}); return true;
    case ncclInt32: f(Plain<int32_t>{}); return true;
    case ncclUint32: f(Plain<uint32_t>{}); return true;
    case ncclInt64: f(Plain<int64_t>{}); return true;
    case ncclUint64: f(Plain<uint64_t>{}); return true;
    case ncclFloat16: f(F16{}); return true;
    case ncclFloat32: f(Plain<float>{}); return true;
    case ncclFloat64: f(Plain<double>{}); return true;
    case ncclBfloat16: f(BF16{}); return true;
    default: return false;
  }
}

size_t elem_size(uint64_t dtype) {
  size_t n = 0;
  with_type(dtype, [&](auto t) { n = sizeof(typename decltype(t)::S); });
  return n;
}

// Integers wrap (computed unsigned); floats take NaN through max and min.
template <class A>
A add(A a, A b) {
  if constexpr (std::is_integral_v<A>) return static_cast<A>(std::make_unsigned_t<A>(a) + std::make_unsigned_t<A>(b));
  else return a + b;
}
template <class A>
A mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) return static_cast<A>(std::make_unsigned_t<A>(a) * std::make_unsigned_t<A>(b));
  else return a * b;
}
template <class A>
A max_nan(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) if (std::isnan(a) || std::isnan(b)) return a + b;
  return a < b ? b : a;
}
template <class A>
A min_nan(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) if (std::isnan(a) || std::isnan(b)) return a + b;
  return b < a ? b : a;
}

// out[i] = src[0][i] (+) src[1][i] (+) ... in rank order; avg then scales like the project's CPU
// communicator: the float sum times (Acc)(1.0 / nranks) (integers divide).
template <class T, class Combine>
void fold(const std::vector<const char*>& src, size_t n, char* out, Combine combine, bool avg) {
  using S = typename T::S;
  using A = typename T::Acc;
  const auto get = [](const char* p, size_t i) {
    S s;
    std::memcpy(&s, p + i * sizeof(S), sizeof(S));
    return T::in(s);
  };
  const A scale = std::is_integral_v<A> ? A(1) : static_cast<A>(1.0 / static_cast<double>(src.size()));
  for (size_t i = 0; i < n; ++i) {
    A acc = get(src[0], i);
    for (size_t r = 1; r < src.size(); ++r) acc = combine(acc, get(src[r], i));
    if (avg) {
      if constexpr (std::is_integral_v<A>) acc = static_cast<A>(acc / static_cast<A>(src.size()));
      else acc = acc * scale;
    }
    const S s = T::out(acc);
    std::memcpy(out + i * sizeof(S), &s, sizeof(S));
  }
}

void reduce(const Desc& d, const std::vector<const char*>& src, size_t n, char* out) {
  with_type(d.dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename T::Acc;
    switch (d.op) {
      case ncclSum: return fold<T>(src, n, out, add<A>, false);
      case ncclAvg: return fold<T>(src, n, out, add<A>, true);
      case ncclProd: return fold<T>(src, n, out, mul<A>, false);
      case ncclMax: return fold<T>(src, n, out, max_nan<A>, false);
      default: return fold<T>(src, n, out, min_nan<A>, false);
    }
  });
}

std::string describe(const Desc& d) {
  static const char* const types[] = {"i8", "u8", "i32", "u32", "i64", "u64", "f16", "f32", "f64", "bf16"};
  static const char* const ops[] = {"sum", "prod", "max", "min", "avg"};
  std::string s = d.kind == kAllReduce ? std::string("all_reduce(") + (d.op < 5 ? ops[d.op] : "?") + ")"
                  : d.kind == kBroadcast ? "broadcast(root " + std::to_string(d.root) + ")"
                  : d.kind == kAllGather ? std::string("all_gather")
                                         : std::string("all_to_all");
  return s + " " + std::to_string(d.count) + " x " + (d.dtype < 10 ? types[d.dtype] : "?");
}

}  // namespace
}  // namespace amp::emu

using namespace amp::emu;

// The communicator. The user's handle is the raw pointer; operations hold a shared_ptr, so an
// aborted or destroyed communicator's memory stays valid until its last operation has finished.
struct ncclComm {
  std::string name;  // of the shared-memory segment
  int nranks = 0, rank = 0;
  bool blocking = true;
  char* base = nullptr;  // the mapping
  Header* hdr = nullptr;
  std::atomic<bool> aborted{false}, finalizing{false};
  std::atomic<int> error{ncclSuccess};  // the asynchronous error
  std::atomic<int> unfinished{0};       // enqueued operations not finished yet
  std::atomic<int> busy_polls{0};       // ncclInProgress answers owed after a call that returned it
  std::mutex mutex;                     // guards issued
  uint64_t issued = 0;                  // operations enqueued so far: the next one's index
  std::atomic<uint64_t> running{0};     // operations run one at a time, in call order
  bool connecting = false;              // this rank's first collective has been issued
  uint64_t seq = 0;                     // the last chunk done (device thread only)

  ~ncclComm() { munmap(base, kSegmentBytes); }
  char* slot(int r) const { return base + kDataOffset + static_cast<size_t>(r) * kSlotBytes; }
  bool joined() const { return load(hdr->joined) >= static_cast<uint64_t>(nranks); }
  // As NCCL >= 2.22 does, the ranks connect on their first collective: until every rank has issued
  // one, a nonblocking communicator reports ncclInProgress (a blocking one waits in the call).
  bool connected() const { return load(hdr->connected) >= static_cast<uint64_t>(nranks); }
  void unlink() const { (void)shm_unlink(name.c_str()); }  // ENOENT (already unlinked) is fine
  void set_async(ncclResult_t r, const std::string& text) {
    int expected = ncclSuccess;
    if (!error.compare_exchange_strong(expected, r)) return;
    fail(r, text);
    std::fprintf(stderr, "NCCL WARN rank %d: %s\n", rank, text.c_str());
  }
};

namespace {

std::mutex g_comms_mutex;
std::map<ncclComm*, std::shared_ptr<ncclComm>> g_comms;  // the live handles

std::shared_ptr<ncclComm> find(ncclComm_t c) {
  std::lock_guard<std::mutex> lock(g_comms_mutex);
  const auto it = g_comms.find(c);
  return it == g_comms.end() ? nullptr : it->second;
}

// One collective: the state machine of the protocol above.
struct Coll {
  std::shared_ptr<ncclComm> comm;
  Desc desc;
  const char* send = nullptr;
  char* recv = nullptr;
  size_t send_bytes = 0, recv_bytes = 0;  // checked again when the op starts (freed meanwhile?)
  uint64_t index = 0;
  size_t esize = 1, per_chunk = 1, nchunks = 1, chunk = 0;
  bool published = false;  // my slot holds the current chunk
  bool launched = false;   // enqueued: its end lets the next op of the comm run

  // The end of a launched op, finished or dropped by the engine (after a device fault, the engine
  // drops queued work without running it).
  ~Coll() {
    if (!launched) return;
    comm->running.fetch_add(1);
    comm->unfinished.fetch_sub(1);
  }
  Coll() = default;
  Coll(const Coll&) = default;
  Coll& operator=(const Coll&) = default;

  bool step() {
    ncclComm& c = *comm;
    if (c.aborted.load()) return true;  // finishes without touching memory
    if (c.running.load() != index) return false;
    if (c.error.load() != ncclSuccess) return true;
    Header& h = *c.hdr;
    const int me = c.rank;
    if (chunk == 0 && !published && ((send_bytes && !is_device_range(send, send_bytes)) ||
                                     (recv_bytes && !is_device_range(recv, recv_bytes)))) {
      fault("NCCL " + describe(desc) + ": a buffer was freed before the collective ran", cudaErrorIllegalAddress);
      c.set_async(ncclUnhandledCudaError, "rank " + std::to_string(me) + ": " + describe(desc) + ": buffer freed");
      return true;
    }
    while (chunk < nchunks) {
      const uint64_t seq = c.seq + 1;
      const size_t first = chunk * per_chunk, n = std::min<size_t>(per_chunk, desc.count - first);
      if (!published) {  // (1) my slot is free once everybody has read the previous chunk
        for (int r = 0; r < c.nranks; ++r)
          if (load(h.rank[r].depart) < seq - 1) return false;
        if (desc.kind == kAllToAll && !dry_run()) {
          for (int r = 0; r < c.nranks; ++r)
            std::memcpy(c.slot(me) + r * n * esize, send + (r * desc.count + first) * esize, n * esize);
        } else if ((desc.kind != kBroadcast || me == static_cast<int>(desc.root)) && !dry_run()) {
          std::memcpy(c.slot(me), send + first * esize, n * esize);
        }
        h.rank[me].desc = desc;
        store(h.rank[me].arrive, seq);
        published = true;
      }
      for (int r = 0; r < c.nranks; ++r)  // (2) everybody's part is there
        if (load(h.rank[r].arrive) < seq) return false;
      bool same = true;
      for (int r = 0; r < c.nranks; ++r) same = same && h.rank[r].desc == desc;
      if (!same) {
        std::string text = "ranks called different collectives:";
        for (int r = 0; r < c.nranks; ++r)
          text += std::string(r ? "," : "") + " rank " + std::to_string(r) + " " + describe(h.rank[r].desc);
        c.set_async(ncclInvalidUsage, text);
      } else if (dry_run()) {
        // The ranks met and agreed; no data moves (emu.h).
      } else if (desc.kind == kAllReduce) {
        std::vector<const char*> src;
        for (int r = 0; r < c.nranks; ++r) src.push_back(c.slot(r));
        reduce(desc, src, n, recv + first * esize);
      } else if (desc.kind == kBroadcast) {
        std::memcpy(recv + first * esize, c.slot(static_cast<int>(desc.root)), n * esize);
      } else if (desc.kind == kAllGather) {
        for (int r = 0; r < c.nranks; ++r)
          std::memcpy(recv + (r * desc.count + first) * esize, c.slot(r), n * esize);
      } else {
        for (int r = 0; r < c.nranks; ++r)
          std::memcpy(recv + (r * desc.count + first) * esize, c.slot(r) + me * n * esize, n * esize);
      }
      store(h.rank[me].depart, seq);
      c.seq = seq;
      published = false;
      ++chunk;
      if (!same) return true;
    }
    return true;
  }
};

struct Pending {
  cudaStream_t stream;
  const char* name;
  Coll coll;
};
thread_local int t_depth = 0;
thread_local std::vector<Pending> t_grouped;

// Enqueues one collective on its stream; its index fixes its place in the communicator's order.
ncclResult_t launch(Pending p) {
  ncclComm& c = *p.coll.comm;
  if (capturing(p.stream)) {
    // Recorded into the graph, as NCCL records its kernels: each replay numbers a fresh copy of the
    // collective in the communicator's order when the graph is launched.
    const Coll proto = p.coll;
    const char* name = p.name;
    const auto make = [proto, name] {
      auto state = std::make_shared<Coll>(proto);
      ncclComm& comm = *state->comm;
      std::lock_guard<std::mutex> lock(comm.mutex);
      state->index = comm.issued++;
      comm.unfinished.fetch_add(1);
      state->launched = true;
      return Op{name, [state] { return state->step(); }};
    };
    const auto r = capture_enqueue(p.stream, p.name, make);
    if (r && *r != cudaSuccess)
      return fail(ncclUnhandledCudaError, std::string(p.name) + ": capture failed: " + cudaGetErrorString(*r));
    return ncclSuccess;
  }
  std::lock_guard<std::mutex> lock(c.mutex);
  p.coll.index = c.issued;
  auto state = std::make_shared<Coll>(std::move(p.coll));
  c.unfinished.fetch_add(1);
  const cudaError_t e = enqueue(p.stream, Op{p.name, [state] { return state->step(); }});
  if (e != cudaSuccess) {
    c.unfinished.fetch_sub(1);
    return fail(ncclUnhandledCudaError, std::string(p.name) + ": enqueue failed: " + cudaGetErrorString(e));
  }
  state->launched = true;  // before `state` is released below: the last owner's ~Coll sees it
  ++c.issued;
  count_launch(p.stream);
  if (launch_log_on()) {
    const Desc& d = state->desc;
    static const char* const ops[] = {"sum", "prod", "max", "min", "avg"};
    const char* kind = d.kind == kAllReduce   ? "all_reduce"
                       : d.kind == kBroadcast ? "broadcast"
                       : d.kind == kAllGather ? "all_gather"
                                              : "all_to_all";
    // bytes: the buffer this rank contributes (an all-to-all's whole send buffer).
    const size_t bytes = d.count * state->esize * (d.kind == kAllToAll ? static_cast<size_t>(c.nranks) : 1);
    log_line(kind, std::string(",\"redop\":\"") + (d.kind == kAllReduce && d.op < 5 ? ops[d.op] : "none") +
                       "\",\"bytes\":" + std::to_string(bytes) + ",\"ranks\":" +
                       std::to_string(c.nranks), p.stream);
  }
  return ncclSuccess;
}

// A failure injected by a test (nccl_fail_next_call_for_testing), taken by the next collective call.
std::atomic<int> g_injected{ncclSuccess};
ncclResult_t take_injected_failure(const std::string& where) {
  const int r = g_injected.exchange(ncclSuccess);
  if (r == ncclSuccess) return ncclSuccess;
  return fail(static_cast<ncclResult_t>(r), where + "failure injected by the test");
}

void owe_polls(ncclComm& c) { c.busy_polls.store(1 + static_cast<int>(random_u64() % 3)); }

// Checks a collective's arguments, then runs it now or records it for ncclGroupEnd.
ncclResult_t collective(const char* fn, ncclComm_t handle, const Desc& d, const void* send, void* recv,
                        cudaStream_t stream) {
  const std::string where = std::string(fn) + ": ";
  const auto comm = find(handle);
  if (!comm) return fail(ncclInvalidArgument, where + "invalid communicator (null, destroyed or aborted)");
  if (!comm->joined()) return fail(ncclInvalidUsage, where + "the communicator's initialization is still in progress");
  if (const int e = comm->error.load(); e != ncclSuccess)
    return fail(static_cast<ncclResult_t>(e), where + "the communicator has an asynchronous error");
  const size_t es = elem_size(d.dtype);
  if (es == 0) return fail(ncclInvalidArgument, where + "unsupported datatype " + std::to_string(d.dtype));
  if (d.kind == kAllReduce && d.op >= ncclNumOps) return fail(ncclInvalidArgument, where + "invalid reduction op");
  if (d.kind == kBroadcast && d.root >= static_cast<uint64_t>(comm->nranks))
    return fail(ncclInvalidArgument, where + "root " + std::to_string(d.root) + " is not a rank");
  if (d.count > SIZE_MAX / es / kMaxRanks) return fail(ncclInvalidArgument, where + "count too large");
  const size_t bytes = d.count * es;
  const size_t send_bytes = d.kind == kBroadcast && d.root != static_cast<uint64_t>(comm->rank) ? 0
                            : d.kind == kAllToAll ? bytes * static_cast<size_t>(comm->nranks)
                                                  : bytes;
  const size_t spread = d.kind == kAllToAll ? static_cast<size_t>(comm->nranks) : 1;  // sent: count per peer
  const size_t recv_bytes = d.kind == kAllGather || d.kind == kAllToAll ? bytes * static_cast<size_t>(comm->nranks) : bytes;
  const auto check = [&](const void* p, size_t n, const char* what) {
    if (n == 0 || is_device_range(p, n)) return true;
    char text[256];
    std::snprintf(text, sizeof text, "%s%s %p (%zu bytes, %s) is not inside one device allocation", where.c_str(),
                  what, p, n, describe(d).c_str());
    fail(ncclInvalidArgument, text);
    return false;
  };
  if (!check(send, send_bytes, "sendbuff") || !check(recv, recv_bytes, "recvbuff")) return ncclInvalidArgument;

  Coll coll;
  coll.comm = comm;
  coll.desc = d;
  coll.send = static_cast<const char*>(send);
  coll.recv = static_cast<char*>(recv);
  coll.send_bytes = send_bytes;
  coll.recv_bytes = recv_bytes;
  coll.esize = es;
  coll.per_chunk = kSlotBytes / es / spread;
  coll.nchunks = std::max<size_t>(1, (d.count + coll.per_chunk - 1) / coll.per_chunk);  // 1 even when empty
  if (!comm->connecting) {
    comm->connecting = true;
    std::atomic_ref<uint64_t>(comm->hdr->connected).fetch_add(1);
    if (comm->blocking)
      while (!comm->connected()) std::this_thread::sleep_for(std::chrono::microseconds(200));  // no timeout, as NCCL
  }
  if (const ncclResult_t r = take_injected_failure(where); r != ncclSuccess) return r;
  Pending p{stream, fn, std::move(coll)};
  if (t_depth > 0) {
    t_grouped.push_back(std::move(p));
    return ncclSuccess;
  }
  if (const ncclResult_t r = launch(std::move(p)); r != ncclSuccess) return r;
  if (comm->blocking || random_u64() % 4 != 0) return ncclSuccess;
  owe_polls(*comm);
  return ncclInProgress;
}

ncclResult_t init(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, bool blocking) {
  if (out == nullptr) return fail(ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
  *out = nullptr;
  if (nranks < 1 || nranks > kMaxRanks)
    return fail(ncclInvalidArgument, "ncclCommInitRank: nranks = " + std::to_string(nranks) +
                                         " (the emulator supports 1 to " + std::to_string(kMaxRanks) + ")");
  if (rank < 0 || rank >= nranks)
    return fail(ncclInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) + " is not in [0, nranks)");
  if (std::memchr(id.internal, 0, sizeof id.internal) == nullptr ||
      std::strncmp(id.internal, kPrefix, sizeof kPrefix - 1) != 0)
    return fail(ncclInvalidArgument, "ncclCommInitRank: the unique id does not come from ncclGetUniqueId");

  auto c = std::make_shared<ncclComm>();
  c->name = id.internal;
  const int fd = shm_open(c->name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) return fail(ncclSystemError, "shm_open(" + c->name + "): " + std::strerror(errno));
  void* base = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(kSegmentBytes)) == 0)
    base = mmap(nullptr, kSegmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (base == MAP_FAILED) return fail(ncclSystemError, "mapping " + c->name + ": " + std::strerror(err));
  c->base = static_cast<char*>(base);
  c->hdr = reinterpret_cast<Header*>(base);
  c->nranks = nranks;
  c->rank = rank;
  c->blocking = blocking;
  Header& h = *c->hdr;
  const uint64_t magic = cas(h.magic, 0, kMagic);
  if (magic != 0 && magic != kMagic) return fail(ncclInvalidArgument, c->name + " is not an emulated NCCL segment");
  const uint64_t n = cas(h.nranks, 0, static_cast<uint64_t>(nranks));
  if (n != 0 && n != static_cast<uint64_t>(nranks))
    return fail(ncclInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) + " has nranks = " +
                                         std::to_string(nranks) + ", another rank has " + std::to_string(n));
  const uint64_t pid = cas(h.rank[rank].pid, 0, static_cast<uint64_t>(getpid()));
  if (pid != 0)
    return fail(ncclInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) + " already joined (pid " +
                                         std::to_string(pid) + ")");
  if (std::atomic_ref<uint64_t>(h.joined).fetch_add(1) + 1 == static_cast<uint64_t>(nranks)) c->unlink();
  {
    std::lock_guard<std::mutex> lock(g_comms_mutex);
    g_comms[c.get()] = c;
  }
  *out = c.get();
  if (!blocking) return ncclInProgress;
  while (!c->joined()) std::this_thread::sleep_for(std::chrono::microseconds(200));  // no timeout, as NCCL
  return ncclSuccess;
}

// Removes a handle; the communicator lives on while operations hold it.
std::shared_ptr<ncclComm> release(ncclComm_t handle) {
  std::lock_guard<std::mutex> lock(g_comms_mutex);
  const auto it = g_comms.find(handle);
  if (it == g_comms.end()) return nullptr;
  auto c = it->second;
  g_comms.erase(it);
  return c;
}

}  // namespace

int amp::emu::nccl_group_depth() { return t_depth; }
void amp::emu::nccl_fail_next_call_for_testing(ncclResult_t r) { g_injected.store(r); }

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return fail(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
  static std::atomic<uint64_t> counter{0};
  std::memset(id->internal, 0, sizeof id->internal);
  std::snprintf(id->internal, sizeof id->internal, "%s%ld_%llu_%016llx", kPrefix, static_cast<long>(getpid()),
                static_cast<unsigned long long>(counter.fetch_add(1)), static_cast<unsigned long long>(random_u64()));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return init(comm, nranks, commId, rank, true);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config) {
  if (config != nullptr && (config->magic != 0xcafebeef || config->size != sizeof(ncclConfig_t)))
    return fail(ncclInvalidArgument, "ncclCommInitRankConfig: config not set from NCCL_CONFIG_INITIALIZER");
  const int b = config == nullptr || config->blocking == NCCL_CONFIG_UNDEF_INT ? 1 : config->blocking;
  if (b != 0 && b != 1) return fail(ncclInvalidArgument, "ncclCommInitRankConfig: blocking must be 0 or 1");
  return init(comm, nranks, commId, rank, b == 1);
}

ncclResult_t ncclCommFinalize(ncclComm_t handle) {
  const auto c = find(handle);
  if (!c) return fail(ncclInvalidArgument, "ncclCommFinalize: invalid communicator");
  c->finalizing.store(true);
  if (!c->blocking) return ncclInProgress;  // ncclCommGetAsyncError says when the ops have drained
  while (c->unfinished.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t handle) {
  const auto c = release(handle);
  if (!c) return fail(ncclInvalidArgument, "ncclCommDestroy: invalid communicator");
  c->unlink();
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t handle) {
  const auto c = release(handle);
  if (!c) return fail(ncclInvalidArgument, "ncclCommAbort: invalid communicator");
  c->aborted.store(true);  // pending and queued operations finish without touching memory
  c->unlink();
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t handle, ncclResult_t* asyncError) {
  const auto c = find(handle);
  if (!c || asyncError == nullptr) return fail(ncclInvalidArgument, "ncclCommGetAsyncError: invalid argument");
  int owed = c->busy_polls.load();
  while (owed > 0 && !c->busy_polls.compare_exchange_weak(owed, owed - 1)) {
  }
  if (const int e = c->error.load(); e != ncclSuccess) *asyncError = static_cast<ncclResult_t>(e);
  else if (!c->joined() || (c->connecting && !c->connected()) || owed > 0 ||
           (c->finalizing.load() && c->unfinished.load() > 0))
    *asyncError = ncclInProgress;
  else *asyncError = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t handle, int* count) {
  const auto c = find(handle);
  if (!c || count == nullptr) return fail(ncclInvalidArgument, "ncclCommCount: invalid argument");
  *count = c->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t handle, int* rank) {
  const auto c = find(handle);
  if (!c || rank == nullptr) return fail(ncclInvalidArgument, "ncclCommUserRank: invalid argument");
  *rank = c->rank;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t) {
  thread_local std::string copy;  // stable for the caller while other threads set new errors
  std::lock_guard<std::mutex> lock(g_error_mutex);
  copy = g_last_error;
  return copy.c_str();
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const Desc d{kAllReduce, static_cast<uint64_t>(op), static_cast<uint64_t>(datatype), count, 0};
  return collective("ncclAllReduce", comm, d, sendbuff, recvbuff, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  if (root < 0) return fail(ncclInvalidArgument, "ncclBroadcast: root " + std::to_string(root) + " is not a rank");
  return collective("ncclBroadcast", comm,
                    Desc{kBroadcast, 0, static_cast<uint64_t>(datatype), count, static_cast<uint64_t>(root)}, sendbuff,
                    recvbuff, stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclAllGather", comm, Desc{kAllGather, 0, static_cast<uint64_t>(datatype), sendcount, 0}, sendbuff,
                    recvbuff, stream);
}

ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                          ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclAlltoAll", comm, Desc{kAllToAll, 0, static_cast<uint64_t>(datatype), count, 0}, sendbuff,
                    recvbuff, stream);
}

ncclResult_t ncclGroupStart() {
  ++t_depth;
  return ncclSuccess;
}

// The outermost ncclGroupEnd enqueues the recorded calls in order.
ncclResult_t ncclGroupEnd() {
  if (t_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: no matching ncclGroupStart");
  if (--t_depth > 0) return ncclSuccess;
  std::vector<Pending> calls = std::move(t_grouped);
  t_grouped.clear();
  ncclResult_t result = ncclSuccess;
  bool nonblocking = false;
  for (Pending& p : calls) {
    const auto comm = p.coll.comm;
    if (result == ncclSuccess) result = launch(std::move(p));
    if (!comm->blocking) {
      nonblocking = true;
      owe_polls(*comm);
    }
  }
  return result == ncclSuccess && nonblocking ? ncclInProgress : result;
}
