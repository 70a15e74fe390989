// Host-to-device copies through pinned memory. A copy from pageable memory may make the host wait for
// the stream (CUDA's API synchronization behavior: the driver stages it into pinned memory itself),
// which would stall a step that issues its next micro-batch's data while the device still runs the
// last one. So the bytes are first copied into a pinned slot on the host, then sent with
// cudaMemcpyAsync, and the slot is reused once its copy's event has completed (polled, never
// waited for); a copy that finds no free slot large enough gets a new one. A copy larger than
// kMaxStagedBytes (a data file's tensors, a checkpoint's, moved once before training) goes directly
// from its pageable source instead: pinning that much for the rest of the run would cost more.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/kernels/cuda/cuda_context.h"

namespace amp::cuda {

class HostStaging {
 public:
  HostStaging() = default;
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Copies bytes from src (any host memory, reusable as soon as this returns) to device dst on
  // stream s. Throws std::logic_error while s captures a CUDA graph: a replay would copy the slot's
  // later contents, not src's.
  void copy(void* dst, const void* src, size_t bytes, cudaStream_t s);
  static constexpr size_t kMaxStagedBytes = size_t{16} << 20;

  size_t slots() const;  // pinned slots made so far (for tests)

 private:
  struct Slot {
    void* host = nullptr;
    size_t bytes = 0;
    std::unique_ptr<Event> done;  // recorded after the slot's last copy
  };
  mutable std::mutex mutex_;
  std::vector<Slot> slots_;
};

}  // namespace amp::cuda
