// DeviceMemory: what a device must provide for tensors to exist on it: memory, copies, fills and
// read-backs. The CPU's is in this folder (host_memory.cpp); a GPU backend registers its own
// (runtime/kernels/cuda/cuda_support.cpp). The kernels are the other half of a device, in
// runtime/kernels/backend.h.
#pragma once
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <vector>

#include "runtime/core/tensor.h"

namespace amp {

// A device had no room for an allocation. A GPU's allocator throws its own kind of it
// (cuda::OutOfMemory); the ops above the backends catch this one to fall back to kernels that need
// less, and let every other failure through.
struct DeviceOutOfMemory : std::runtime_error {
  explicit DeviceOutOfMemory(const std::string& what) : std::runtime_error(what) {}
};

// Small device values on their way to the host: a copy that completes in the background, so that
// logging can read a step's figures one step late without stalling the device.
class Readback {
 public:
  virtual ~Readback() = default;
  virtual bool ready() = 0;                  // the copy has landed (never blocks)
  virtual std::vector<double> values() = 0;  // waits for the copy if needed
};

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  // Bytes held by tensors now, and at most since the last reset (cached blocks not counted).
  virtual size_t peak_bytes() const = 0;
  virtual size_t current_bytes() const = 0;
  virtual void reset_peak_bytes() = 0;
  // The device memory this process has held at most beyond its context, as the device's driver
  // counts it (the allocator's caches and the libraries' workspaces included; on CUDA,
  // runtime/kernels/cuda/device_usage.h), looked at now too. 0 where the device keeps no such count
  // (the CPU, whose resident memory the operating system reports).
  virtual size_t device_peak_bytes() { return 0; }
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Every element of t set to value, rounded to t's dtype as a cast rounds (an int64 truncates).
  virtual void fill(Tensor& t, double value) = 0;
  virtual void synchronize() = 0;
  // Starts copying the first element of each 1-element f32 tensor to the host.
  virtual std::unique_ptr<Readback> start_readback(const std::vector<Tensor>& scalars) = 0;
};

// The memory of a device. Throws a clear error for a device that is not built or not initialised.
DeviceMemory& memory_for(Device d);
void register_memory(DeviceType t, DeviceMemory* m);  // a GPU backend's initialisation calls it
DeviceMemory& host_memory();

}  // namespace amp
