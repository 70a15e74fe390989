#include "runtime/kernels/cuda/caching_allocator.h"

#include <cstdio>
#include <stdexcept>
#include <string>

#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/device_usage.h"

namespace amp::cuda {

size_t CachingAllocator::round_size(size_t bytes, bool packed) {
  const size_t unit = packed || bytes < kSmallLimit ? kUnit : kSegmentUnit;
  return (bytes + unit - 1) / unit * unit;
}

size_t CachingAllocator::segment_size(size_t rounded, bool packed) {
  const size_t own = (rounded + kSegmentUnit - 1) / kSegmentUnit * kSegmentUnit;
  return packed && rounded < kSharedBelow ? kSharedSegment : own;
}

CachingAllocator::~CachingAllocator() {
  // The memory itself is the driver's to reclaim at exit (the context is never destroyed); only the
  // bookkeeping goes.
  for (auto& [id, pool] : pools_)
    for (Block* b : pool.large_free) delete b;
  for (auto& [p, b] : large_live_) delete b;
}

void CachingAllocator::out_of_memory_locked(size_t requested, size_t segment) const {
  throw OutOfMemory("CUDA out of memory: tried to allocate " + std::to_string(requested) + " bytes (a segment of " +
                    std::to_string(segment) + ") with " + std::to_string(current_) + " bytes in use and " +
                    std::to_string(reserved_) + " reserved");
}

void* CachingAllocator::try_malloc_locked(size_t rounded) {
  void* p = nullptr;
  cudaError_t err;
  if (active_pool_ != 0) {
    // A private pool is in use during a capture: the relaxed mode allows cudaMalloc there, and
    // nothing is released to retry (cudaFree synchronises, which a capture forbids).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    AMP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    err = cudaMalloc(&p, rounded);
    if (err == cudaSuccess) device_usage().sample();  // (in the relaxed mode too: the query is not captured)
    AMP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  } else {
    err = cudaMalloc(&p, rounded);
    if (err == cudaSuccess) device_usage().sample();  // the process's device memory may be at its most now
  }
  if (err == cudaErrorMemoryAllocation && active_pool_ == 0) {
    (void)cudaGetLastError();  // out of memory is not sticky, but clear it before retrying
    release_free_segments_locked();
    err = cudaMalloc(&p, rounded);
    if (err == cudaSuccess) device_usage().sample();
  }
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  AMP_CUDA_CHECK(err);
  reserved_ += rounded;
  return p;
}

void* CachingAllocator::allocate_large_locked(size_t rounded) {
  Block key{nullptr, rounded, true, nullptr, nullptr};
  Block* b = nullptr;
  // Best fit, from the pool in use, then (warm-up) from the global cache.
  for (const int from : {active_pool_, 0}) {
    std::set<Block*, BySize>& free = pools_[from].large_free;
    auto it = free.lower_bound(&key);  // best fit: the smallest block that is large enough
    if (it == free.end()) continue;
    b = *it;
    free.erase(it);
    break;
  }
  const bool fresh = b == nullptr;
  if (fresh) {
    // A shared segment; where the driver has no room for one, a segment of the request's own.
    size_t size = segment_size(rounded, packed_);
    const size_t own = segment_size(rounded, false);
    void* p = try_malloc_locked(size);
    if (p == nullptr && own < size) p = try_malloc_locked(size = own);
    if (p == nullptr) out_of_memory_locked(rounded, size);
    b = new Block{static_cast<char*>(p), size, true, nullptr, nullptr, active_pool_};
  }
  // Split: the rest stays cached in its pool; a new segment's rest goes to the global cache (a
  // capture that needs it takes it from there, and eager work may use it while the graph lives).
  if (b->size - rounded >= kSmallLimit) {
    Block* rest = new Block{b->ptr + rounded, b->size - rounded, true, b, b->next, fresh ? 0 : b->pool};
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = rounded;
    pools_[rest->pool].large_free.insert(rest);
  }
  b->pool = active_pool_;
  b->free = false;
  large_live_.emplace(b->ptr, b);
  return b->ptr;
}

void* CachingAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t rounded = round_size(bytes, packed_);
  void* p;
  if (rounded < kSmallLimit) {
    if (!take_small_locked(active_pool_, rounded, &p) && !take_small_locked(0, rounded, &p)) {
      p = try_malloc_locked(rounded);
      if (p == nullptr) out_of_memory_locked(bytes, rounded);
    }
    if (active_pool_ != 0) small_pool_[p] = active_pool_;
    small_live_.emplace(p, rounded);
  } else {
    p = allocate_large_locked(rounded);
  }
  current_ += bytes;
  if (current_ > peak_) peak_ = current_;
  return p;
}

bool CachingAllocator::take_small_locked(int pool, size_t rounded, void** p) {
  auto& free = pools_[pool].small_free;
  auto it = free.find(rounded);
  if (it == free.end()) return false;
  *p = it->second;
  free.erase(it);
  if (pool == 0) small_pool_.erase(*p);
  return true;
}

void CachingAllocator::free_large_locked(Block* b) {
  b->free = true;
  std::set<Block*, BySize>& free = pools_[b->pool].large_free;
  // Merge with free neighbours of the same segment and pool.
  if (b->next && b->next->free && b->next->pool == b->pool) {
    free.erase(b->next);
    absorb_next(b);
  }
  if (b->prev && b->prev->free && b->prev->pool == b->pool) {
    b = b->prev;
    free.erase(b);
    absorb_next(b);
  }
  free.insert(b);
}

int CachingAllocator::create_pool() {
  std::lock_guard<std::mutex> lock(mutex_);
  const int id = next_pool_++;
  pools_[id];
  return id;
}

void CachingAllocator::use_pool(int pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (pool != 0 && pools_.count(pool) == 0) throw std::invalid_argument("CachingAllocator::use_pool: no such pool");
  active_pool_ = pool;
}

void CachingAllocator::release_pool(int pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pools_.find(pool);
  if (pool == 0 || it == pools_.end()) return;
  if (active_pool_ == pool) active_pool_ = 0;
  Pool freed = std::move(it->second);
  pools_.erase(it);
  for (auto& [size, p] : freed.small_free) {
    small_pool_.erase(p);
    pools_[0].small_free.emplace(size, p);
  }
  for (Block* b : freed.large_free) b->pool = -1;  // not yet in any free set: merged below
  for (Block* b : freed.large_free) {
    if (b->pool != -1) continue;  // absorbed by a neighbour already moved
    b->pool = 0;
    free_large_locked(b);
  }
  // Live blocks go to the global cache when they are freed.
  for (auto& [p, id] : small_pool_)
    if (id == pool) id = 0;
  for (auto& [p, b] : large_live_)
    if (b->pool == pool) b->pool = 0;
}

size_t CachingAllocator::pool_bytes(int pool) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pools_.find(pool);
  if (pool == 0 || it == pools_.end()) return 0;
  size_t bytes = 0;
  for (const auto& [size, p] : it->second.small_free) bytes += size;
  for (const Block* b : it->second.large_free) bytes += b->size;
  for (const auto& [p, id] : small_pool_)
    if (id == pool && small_live_.count(p) > 0) bytes += small_live_.at(p);
  for (const auto& [p, b] : large_live_)
    if (b->pool == pool) bytes += b->size;
  return bytes;
}

// b takes over the block after it, which goes.
void CachingAllocator::absorb_next(Block* b) {
  Block* n = b->next;
  b->size += n->size;
  b->next = n->next;
  if (n->next) n->next->prev = b;
  delete n;
}

void CachingAllocator::deallocate(void* p, size_t bytes) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  size_t size;
  if (auto it = small_live_.find(p); it != small_live_.end()) {
    size = it->second;
    const auto owner = small_pool_.find(p);
    const int pool = owner == small_pool_.end() ? 0 : owner->second;
    if (pool == 0 && owner != small_pool_.end()) small_pool_.erase(owner);
    pools_[pool].small_free.emplace(size, p);
    small_live_.erase(it);
  } else if (auto jt = large_live_.find(p); jt != large_live_.end()) {
    Block* b = jt->second;
    large_live_.erase(jt);
    size = b->size;
    free_large_locked(b);
  } else {
    std::fprintf(stderr, "CachingAllocator: freeing unknown pointer %p (ignored)\n", p);
    return;
  }
  current_ -= bytes;
  // In stream order; never throws: this runs in destructors, and after a device fault it must not
  // turn the fault into std::terminate.
  if (poison_) AMP_CUDA_CHECK_NOTHROW(cudaMemsetAsync(p, 0xff, size, poison_stream_));
}

void CachingAllocator::release_free_segments_locked() {
  Pool& global = pools_[0];  // a private pool's blocks stay while its graph lives
  for (auto& [size, p] : global.small_free) {
    AMP_CUDA_CHECK_NOTHROW(cudaFree(p));
    reserved_ -= size;
  }
  global.small_free.clear();
  for (auto it = global.large_free.begin(); it != global.large_free.end();) {
    Block* b = *it;
    if (b->prev == nullptr && b->next == nullptr) {  // a whole segment
      AMP_CUDA_CHECK_NOTHROW(cudaFree(b->ptr));
      reserved_ -= b->size;
      delete b;
      it = global.large_free.erase(it);
    } else {
      ++it;
    }
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_free_segments_locked();
}

size_t CachingAllocator::current_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_;
}
size_t CachingAllocator::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}
size_t CachingAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}
void CachingAllocator::reset_peak_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = current_;
}

}  // namespace amp::cuda
