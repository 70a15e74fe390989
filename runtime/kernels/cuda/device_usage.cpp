#include "runtime/kernels/cuda/device_usage.h"

#include <cuda_runtime.h>

namespace amp::cuda {

void DeviceUsage::start() {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // no figure: peak_bytes() stays 0
  }
  start_free_ = free;
  least_free_ = free;
  started_ = true;
}

void DeviceUsage::sample() {
  if (!started_) return;
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  size_t least = least_free_.load();
  while (free < least && !least_free_.compare_exchange_weak(least, free)) {
  }
}

size_t DeviceUsage::peak_bytes() const {
  if (!started_) return 0;
  const size_t start = start_free_.load(), least = least_free_.load();
  return start > least ? start - least : 0;
}

DeviceUsage& device_usage() {
  static DeviceUsage* u = new DeviceUsage;  // never destroyed, like the context
  return *u;
}

}  // namespace amp::cuda
