#include "runtime/kernels/cuda/caching_allocator.h"

#include <cstdio>
#include <stdexcept>
#include <string>

#include "runtime/kernels/cuda/cuda_check.h"

namespace amp::cuda {

size_t CachingAllocator::round_size(size_t bytes) {
  const size_t unit = bytes < kSmallLimit ? kSmallUnit : kLargeUnit;
  return (bytes + unit - 1) / unit * unit;
}

CachingAllocator::~CachingAllocator() {
  // The memory itself is the driver's to reclaim at exit (the context is never destroyed); only the
  // bookkeeping goes.
  for (Block* b : large_free_) delete b;
  for (auto& [p, b] : large_live_) delete b;
}

void* CachingAllocator::malloc_locked(size_t rounded) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, rounded);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // out of memory is not sticky, but clear it before retrying
    release_free_segments_locked();
    err = cudaMalloc(&p, rounded);
  }
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw std::runtime_error("CUDA out of memory: tried to allocate " + std::to_string(rounded) + " bytes with " +
                             std::to_string(current_) + " bytes in use and " + std::to_string(reserved_) +
                             " reserved");
  }
  AMP_CUDA_CHECK(err);
  reserved_ += rounded;
  return p;
}

void* CachingAllocator::allocate_large_locked(size_t rounded) {
  Block key{nullptr, rounded, true, nullptr, nullptr};
  auto it = large_free_.lower_bound(&key);  // best fit: the smallest block that is large enough
  Block* b;
  if (it != large_free_.end()) {
    b = *it;
    large_free_.erase(it);
    if (b->size - rounded >= kLargeUnit) {  // split: the rest stays cached
      Block* rest = new Block{b->ptr + rounded, b->size - rounded, true, b, b->next};
      if (b->next) b->next->prev = rest;
      b->next = rest;
      b->size = rounded;
      large_free_.insert(rest);
    }
  } else {
    b = new Block{static_cast<char*>(malloc_locked(rounded)), rounded, true, nullptr, nullptr};
  }
  b->free = false;
  large_live_.emplace(b->ptr, b);
  return b->ptr;
}

void* CachingAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t rounded = round_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  void* p;
  if (rounded < kSmallLimit) {
    auto it = small_free_.find(rounded);
    if (it != small_free_.end()) {
      p = it->second;
      small_free_.erase(it);
    } else {
      p = malloc_locked(rounded);
    }
    small_live_.emplace(p, rounded);
  } else {
    p = allocate_large_locked(rounded);
  }
  current_ += bytes;
  if (current_ > peak_) peak_ = current_;
  return p;
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
    small_free_.emplace(size, p);
    small_live_.erase(it);
  } else if (auto jt = large_live_.find(p); jt != large_live_.end()) {
    Block* b = jt->second;
    large_live_.erase(jt);
    size = b->size;
    b->free = true;
    // Merge with free neighbours of the same segment.
    if (b->next && b->next->free) {
      large_free_.erase(b->next);
      absorb_next(b);
    }
    if (b->prev && b->prev->free) {
      b = b->prev;
      large_free_.erase(b);
      absorb_next(b);
    }
    large_free_.insert(b);
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
  for (auto& [size, p] : small_free_) {
    AMP_CUDA_CHECK_NOTHROW(cudaFree(p));
    reserved_ -= size;
  }
  small_free_.clear();
  for (auto it = large_free_.begin(); it != large_free_.end();) {
    Block* b = *it;
    if (b->prev == nullptr && b->next == nullptr) {  // a whole segment
      AMP_CUDA_CHECK_NOTHROW(cudaFree(b->ptr));
      reserved_ -= b->size;
      delete b;
      it = large_free_.erase(it);
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
