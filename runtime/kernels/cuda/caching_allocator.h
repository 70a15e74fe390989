// A caching device allocator: freed blocks are kept and handed out again, so a training loop stops
// calling cudaMalloc (slow) and cudaFree (which synchronises the device) after its first step.
//
// - Every request rounds up to 512 bytes.
// - Small requests (under 1 MiB) reuse a cached block of exactly that size.
// - Large requests take the smallest cached block that is large enough; what is left over, if 1 MiB
//   or more, is split off and stays cached. Freed neighbours within one cudaMalloc segment merge
//   again. So shapes that vary from step to step reuse memory instead of piling up new segments.
// - A large request that finds no block takes a new segment (segment_size): one of 32 MiB that later
//   requests share, for a request under 10 MiB (its own, rounded up to 2 MiB, where the driver has
//   no room for 32); otherwise its own, rounded up to 2 MiB. Each request in a segment of its own
//   rounded up to 2 MiB left a 768-wide model's weights and optimizer states (2.25, 6.75, 9 MiB) a
//   quarter of a GiB of padding on GPT-2 small (docs/GPU.md).
// - With poisoning on (set_poison_freed: a checking run) blocks are not packed (set_packed(false)):
//   each large request rounds up to 2 MiB in a segment of its own, so a read past a tensor's end meets
//   poisoned padding, and the emulated GPU's and compute-sanitizer's checks, which know allocations by
//   their cudaMalloc, see where it ends.
// - When cudaMalloc fails, the segments that are entirely free go back to the driver (this waits for
//   the device, as cudaFree does) and the request is tried once more.
//
// Blocks are reused in the order of the compute stream: a freed block may be handed to a kernel that
// is queued after the last kernel that used it. Work on other streams (NCCL) must be joined to the
// compute stream before its tensors are released; comm/nccl_communicator does so with events.
// Graph-private pools: while a pool is in use (use_pool, around a stream capture), allocations come
// from it and blocks freed return to it, so memory a captured graph uses is never handed to eager
// work while the graph lives (its replays write it again). A pool starts from the blocks that eager
// steps left in the global cache (warm-up), so a capture needs no cudaMalloc; a miss calls cudaMalloc
// in the relaxed capture mode (allowed during a capture: the allocation itself is not captured); the
// pool takes the block asked for, and the rest of a new segment goes to the global cache.
// release_pool (the graph is destroyed) gives its free blocks back to the global cache, and its live
// ones when they are freed. Pieces of different pools never merge.
//
// With poisoning on (the emulated GPU turns it on), a freed block is filled with 0xff bytes, NaN in
// every float type, in stream order: a kernel that reads memory it never wrote shows it.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "runtime/core/device_memory.h"

namespace amp::cuda {

// The driver had no room for a segment, even after the cache's free segments went back to it.
struct OutOfMemory : DeviceOutOfMemory {
  explicit OutOfMemory(const std::string& what) : DeviceOutOfMemory(what) {}
};

class CachingAllocator {
 public:
  CachingAllocator() = default;
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  void* allocate(size_t bytes);
  void deallocate(void* p, size_t bytes);
  // Returns every entirely free segment of the global cache to the driver.
  void empty_cache();

  // A new graph-private pool's id (never 0, the global cache's).
  int create_pool();
  // Where allocations go from now on: a private pool, or 0 for the global cache.
  void use_pool(int pool);
  // The graph of `pool` is gone: its blocks return to the global cache (live ones once freed).
  void release_pool(int pool);
  // Bytes of the pool's blocks, live and free (0 once released).
  size_t pool_bytes(int pool) const;
  void set_poison_freed(bool on, cudaStream_t stream) {
    poison_ = on;
    poison_stream_ = stream;
    packed_ = !on;
  }
  // Large blocks packed into shared segments (the default), or each in its own (poisoning's checks).
  void set_packed(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    packed_ = on;
  }
  bool packed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return packed_;
  }

  size_t current_bytes() const;   // bytes requested by live allocations
  size_t peak_bytes() const;      // the maximum of current_bytes since the last reset
  size_t reserved_bytes() const;  // bytes obtained from cudaMalloc, live and cached
  void reset_peak_bytes();

  static constexpr size_t kSmallLimit = size_t{1} << 20, kUnit = 512, kSegmentUnit = size_t{2} << 20,
                          kSharedSegment = size_t{32} << 20, kSharedBelow = size_t{10} << 20;
  // A block's size: bytes rounded up to kUnit (not packed: a large one up to kSegmentUnit).
  static size_t round_size(size_t bytes, bool packed = true);
  // The cudaMalloc a large block that finds none takes.
  static size_t segment_size(size_t rounded, bool packed = true);

 private:
  // A piece of a large segment; pieces of one segment form a list in address order.
  struct Block {
    char* ptr;
    size_t size;
    bool free;
    Block *prev, *next;
    int pool = 0;
  };
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };

  struct Pool {
    std::multimap<size_t, void*> small_free;  // rounded size -> free small block
    std::set<Block*, BySize> large_free;
  };
  void* allocate_large_locked(size_t rounded);
  bool take_small_locked(int pool, size_t rounded, void** p);
  void free_large_locked(Block* b);     // into its pool's free set, merged with free neighbours of that pool
  // cudaMalloc, retried once after releasing free segments: null if out of memory.
  void* try_malloc_locked(size_t rounded);
  [[noreturn]] void out_of_memory_locked(size_t requested, size_t segment) const;  // throws OutOfMemory
  void release_free_segments_locked();
  static void absorb_next(Block* b);

  mutable std::mutex mutex_;
  std::map<int, Pool> pools_;                     // 0: the global cache; then the live private pools
  std::unordered_map<void*, size_t> small_live_;  // live small block -> rounded size
  std::unordered_map<void*, int> small_pool_;     // small block (live or free) of a private pool -> its pool
  std::unordered_map<void*, Block*> large_live_;
  int active_pool_ = 0, next_pool_ = 1;
  size_t current_ = 0, peak_ = 0, reserved_ = 0;
  bool poison_ = false, packed_ = true;
  cudaStream_t poison_stream_ = nullptr;
};

}  // namespace amp::cuda
