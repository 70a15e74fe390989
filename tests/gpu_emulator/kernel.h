// The emulated GPU's kernels: CUDA's execution model for .cu files compiled as host C++.
//
// A launch runs every block of its real grid. The threads of a block are fibers (Boost.Context) run
// by a cooperative scheduler, so __syncthreads is a real block barrier and a warp shuffle exchanges
// values among the 32 lanes of a warp. The scheduler reports, as a device fault naming the kernel
// and the block: a barrier that not every thread of the block reaches (or that threads reach at
// different call sites), a shuffle whose mask names lanes that never arrive or do not exist, and a
// kernel that throws. Static __shared__ memory is per block, poisoned with NaN bytes (0xff) at the
// start of every block, so a read before any write shows up in the results.
//
// Included by cuda_runtime.h; a launch is written AMP_LAUNCH(grid, block, shmem, stream, kernel)(args)
// (runtime/kernels/cuda/launch.cuh), which here calls launch() below.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <math.h>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "cuda_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace amp::emu {

// The built-in variables of the thread running now.
struct ThreadContext {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
  uint64_t block_serial;  // distinct for every block ever run: __shared__ poisoning
};
ThreadContext& current_thread();

void syncthreads(std::source_location where);
// The shuffles exchange 8-byte slots; narrower types travel in the low bytes.
uint64_t shfl_down_bits(uint32_t mask, uint64_t bits, unsigned delta, int width, std::source_location where);
uint64_t shfl_xor_bits(uint32_t mask, uint64_t bits, int lane_mask, int width, std::source_location where);
uint64_t shfl_idx_bits(uint32_t mask, uint64_t bits, int src_lane, int width, std::source_location where);
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d += A (16 x 16) B (16 x 8), the fragments laid out
// across the full warp as the PTX ISA gives them ("Matrix Fragments for mma.m16n8k16 with floating point
// type"); the products exact in fp32, summed in k's order. Every lane of the warp must call it.
void mma_m16n8k16(bool bf16, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], std::source_location where);
// ldmatrix.sync.aligned.m8n8.x4.b16: lanes 8i .. 8i + 7 name the rows (16 bytes each) of matrix i; lane
// l receives word l % 4 of row l / 4 of each matrix i in r[i]. Every lane of the warp must call it.
void ldmatrix_x4(uint32_t (&r)[4], const uint32_t* row, std::source_location where);
// ldmatrix.sync.aligned.m8n8.x4.trans.b16: the same rows, each matrix transposed: lane l receives in
// r[i] the elements (row 2 (l % 4), column l / 4) and (row 2 (l % 4) + 1, column l / 4) of matrix i,
// the first in the low 16 bits.
void ldmatrix_x4_trans(uint32_t (&r)[4], const uint32_t* row, std::source_location where);
// cp.async.cg.shared.global, 16 bytes (cp.async.commit_group, cp.async.wait_group N): the copy joins
// the thread's open group, src_bytes of it read (0 or 16: the rest zero). On a GPU a group lands at
// any time between its issue and the wait that retires it; here each group lands at one of the two
// ends, chosen at random (seeded, as the threads' order): at its commit, so a destination that other
// threads still read (a buffer refilled without a barrier) is overwritten under them, or at its wait,
// so a destination read before its wait (or, by another thread, before the barrier after it) sees the
// bytes it held before. A thread that finishes with copies not waited for is a fault, as are addresses
// off their 16-byte boundary and a source outside device memory.
void cp_async_16(void* dst, const void* src, int src_bytes, std::source_location where);
void cp_async_commit();
void cp_async_wait(int pending, std::source_location where);
// Where groups land from now on (tests): at random (the default), always at the commit, or always at
// the wait.
enum class CpAsyncLanding { random, at_commit, at_wait };
void set_cp_async_landing_for_testing(CpAsyncLanding landing);

// v through a shuffle of its bits: exchange(bits) is shfl_down_bits or shfl_xor_bits.
template <class T, class Exchange>
T shuffle_value(T v, Exchange&& exchange) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "__shfl_*_sync: at most 8-byte values");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = exchange(bits);
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// Static shared memory: one instance per device thread (blocks run one at a time on it), refilled
// with 0xff bytes the first time each new block touches it.
template <class T>
class SharedVar {
 public:
  T& get() {
    const uint64_t serial = current_thread().block_serial;
    if (serial != serial_) {
      std::memset(static_cast<void*>(&value_), 0xff, sizeof(T));
      serial_ = serial;
    }
    return value_;
  }

 private:
  T value_;
  uint64_t serial_ = 0;
};

// What the next launch of the calling thread reads and writes (bytes) and computes (FLOPs), as its
// call site declares it from the tensors' sizes (amp::cuda::declare_launch_cost): the launch log
// (AMP_EMU_LAUNCH_LOG, launch_log.h) records it with the launch, which takes it back to zero.
void declare_cost(int64_t bytes_read, int64_t bytes_written, int64_t flops);

// Type-erased launch: validates the configuration (errors go to the last-error slot, as a real
// launch's do) and enqueues a kernel operation that runs body once per thread of the grid.
// pointers: the pointer-typed arguments, checked against device and pinned memory when it runs.
// signature: the kernel's type, whose parameter types tell a template's instances apart in the log.
void launch_erased(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream, const char* name,
                   const std::type_info& signature, std::function<void()> body,
                   std::vector<std::pair<int, const void*>> pointers);

template <class... P>
class Launcher {
 public:
  Launcher(dim3 g, dim3 b, size_t shmem, cudaStream_t s, const char* name, void (*k)(P...))
      : g_(g), b_(b), shmem_(shmem), s_(s), name_(name), k_(k) {}
  template <class... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong number of arguments");
    static_assert((sizeof(std::decay_t<P>) + ... + 0) <= 4096, "kernel parameters exceed CUDA's 4 KB limit");
    std::tuple<std::decay_t<P>...> params(static_cast<P>(std::forward<A>(args))...);
    std::vector<std::pair<int, const void*>> pointers;
    collect(params, pointers, std::index_sequence_for<P...>{});
    auto k = k_;
    launch_erased(g_, b_, shmem_, s_, name_, typeid(k), [k, params]() { std::apply(k, params); }, std::move(pointers));
  }

 private:
  template <class Tuple, size_t... I>
  static void collect(const Tuple& t, std::vector<std::pair<int, const void*>>& out, std::index_sequence<I...>) {
    (add_pointer(static_cast<int>(I), std::get<I>(t), out), ...);
  }
  template <class V>
  static void add_pointer(int index, const V& v, std::vector<std::pair<int, const void*>>& out) {
    if constexpr (std::is_pointer_v<V>)
      if (v != nullptr) out.emplace_back(index, static_cast<const void*>(v));
  }
  dim3 g_, b_;
  size_t shmem_;
  cudaStream_t s_;
  const char* name_;
  void (*k_)(P...);
};

template <class... P>
Launcher<P...> launch(dim3 g, dim3 b, size_t shmem, cudaStream_t s, const char* name, void (*k)(P...)) {
  return Launcher<P...>(g, b, shmem, s, name, k);
}

}  // namespace amp::emu

#define threadIdx (::amp::emu::current_thread().thread_idx)
#define blockIdx (::amp::emu::current_thread().block_idx)
#define blockDim (::amp::emu::current_thread().block_dim)
#define gridDim (::amp::emu::current_thread().grid_dim)
#define warpSize 32

inline void __syncthreads(std::source_location where = std::source_location::current()) {
  ::amp::emu::syncthreads(where);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                   std::source_location where = std::source_location::current()) {
  return ::amp::emu::shuffle_value(v, [&](uint64_t b) { return ::amp::emu::shfl_down_bits(mask, b, delta, width, where); });
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32, std::source_location where = std::source_location::current()) {
  return ::amp::emu::shuffle_value(v, [&](uint64_t b) { return ::amp::emu::shfl_idx_bits(mask, b, src_lane, width, where); });
}
// A barrier for the lanes of mask: an exchange that every one of them must reach.
inline void __syncwarp(unsigned mask = 0xffffffffu, std::source_location where = std::source_location::current()) {
  (void)::amp::emu::shfl_xor_bits(mask, 0, 0, 32, where);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                  std::source_location where = std::source_location::current()) {
  return ::amp::emu::shuffle_value(v, [&](uint64_t b) { return ::amp::emu::shfl_xor_bits(mask, b, lane_mask, width, where); });
}
