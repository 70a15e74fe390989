// A caching device allocator: freed blocks are kept and handed out again for the same rounded size,
// so a training loop that allocates the same shapes every step stops calling cudaMalloc (which
// synchronises the device) after its first step.
//
// Blocks are reused in the order of the compute stream: a freed block may be handed to a kernel that
// is queued after the last kernel that used it. Work on other streams (NCCL) must be joined to the
// compute stream before its tensors are released; comm/nccl_communicator does so with events.
#pragma once
#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>

namespace amp::cuda {

class CachingAllocator {
 public:
  void* allocate(size_t bytes);
  void deallocate(void* p, size_t bytes);
  // Returns every cached block to the driver.
  void empty_cache();

  size_t current_bytes() const;   // bytes requested by live allocations
  size_t peak_bytes() const;      // the maximum of current_bytes since the last reset
  size_t reserved_bytes() const;  // bytes obtained from cudaMalloc, live and cached
  void reset_peak_bytes();

  // Below 1 MiB sizes round up to 512 bytes, above to 2 MiB: few distinct sizes, little waste.
  static size_t round_size(size_t bytes);

 private:
  void free_cached_locked();

  mutable std::mutex mutex_;
  std::multimap<size_t, void*> cached_;      // rounded size -> free block
  std::unordered_map<void*, size_t> live_;   // live block -> rounded size
  size_t current_ = 0, peak_ = 0, reserved_ = 0;
};

}  // namespace amp::cuda
