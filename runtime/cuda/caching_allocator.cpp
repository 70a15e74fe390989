#include "runtime/cuda/caching_allocator.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "runtime/cuda/cuda_check.h"

namespace amp::cuda {

size_t CachingAllocator::round_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20, kLimit = size_t{1} << 20;
  const size_t unit = bytes < kLimit ? kSmall : kLarge;
  return (bytes + unit - 1) / unit * unit;
}

void* CachingAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t rounded = round_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  void* p = nullptr;
  auto it = cached_.find(rounded);
  if (it != cached_.end()) {
    p = it->second;
    cached_.erase(it);
  } else {
    cudaError_t err = cudaMalloc(&p, rounded);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // out of memory is not sticky, but clear it before retrying
      free_cached_locked();
      err = cudaMalloc(&p, rounded);
    }
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw std::runtime_error("CUDA out of memory: tried to allocate " + std::to_string(bytes) + " bytes with " +
                               std::to_string(current_) + " bytes in use and " + std::to_string(reserved_) +
                               " reserved");
    }
    AMP_CUDA_CHECK(err);
    reserved_ += rounded;
  }
  live_.emplace(p, rounded);
  current_ += bytes;
  if (current_ > peak_) peak_ = current_;
  return p;
}

void CachingAllocator::deallocate(void* p, size_t bytes) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(p);
  if (it == live_.end()) {
    std::fprintf(stderr, "CachingAllocator: freeing unknown pointer %p (ignored)\n", p);
    return;
  }
  cached_.emplace(it->second, p);
  live_.erase(it);
  current_ -= bytes;
}

void CachingAllocator::free_cached_locked() {
  for (auto& [size, p] : cached_) {
    AMP_CUDA_CHECK_NOTHROW(cudaFree(p));
    reserved_ -= size;
  }
  cached_.clear();
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  free_cached_locked();
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
