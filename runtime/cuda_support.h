// The seam between device-independent code and the CUDA backend. runtime/cuda/cuda_support.cpp
// implements it when the backend is built; runtime/cuda_stub.cpp otherwise. CMake picks the file.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace amp {

bool cuda_built();
// Whether a usable device exists. If not, *reason says why (no device, driver too old, not built).
bool cuda_usable(std::string* reason);
// Selects device local_rank % device_count and registers the CUDA backend. Throws std::runtime_error
// with a clear message when CUDA is not usable.
void cuda_init(int local_rank);

// What the emulated GPU (preset cuda-emu) has counted since the process started: kernels launched
// (a GEMM and a collective count one each), host synchronisations (calls that made the host wait
// for device work) and device-to-host copies. nullopt on a real GPU and in builds without CUDA.
struct DeviceCounters {
  int64_t launches = 0, host_syncs = 0, d2h_copies = 0;
  DeviceCounters operator-(const DeviceCounters& o) const {
    return {launches - o.launches, host_syncs - o.host_syncs, d2h_copies - o.d2h_copies};
  }
  DeviceCounters& operator+=(const DeviceCounters& o) {
    launches += o.launches, host_syncs += o.host_syncs, d2h_copies += o.d2h_copies;
    return *this;
  }
};
std::optional<DeviceCounters> emulated_device_counters();

}  // namespace amp
