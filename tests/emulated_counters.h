// What the emulated GPU (preset cuda-emu, tests/gpu_emulator/emu.h) has counted since the process
// started, for tests that run on either GPU: nullopt on a real GPU and in builds without CUDA.
#pragma once
#include <cstdint>
#include <optional>

#if defined(AMP_CUDA_EMU)
#include "emu.h"
#endif

namespace amp {

struct DeviceCounters {
  int64_t launches = 0, host_syncs = 0, d2h_copies = 0;
  int64_t graph_launches = 0, graph_ops = 0;  // CUDA graphs replayed, and the operations they ran
  int64_t allocations = 0;                    // cudaMalloc and cudaMallocHost calls
  DeviceCounters operator-(const DeviceCounters& o) const {
    return {launches - o.launches,           host_syncs - o.host_syncs, d2h_copies - o.d2h_copies,
            graph_launches - o.graph_launches, graph_ops - o.graph_ops,  allocations - o.allocations};
  }
};

inline std::optional<DeviceCounters> emulated_device_counters() {
#if defined(AMP_CUDA_EMU)
  const emu::Counters c = emu::counters();
  return DeviceCounters{c.launches, c.host_syncs, c.d2h_copies, c.graph_launches, c.graph_ops, c.allocations};
#else
  return std::nullopt;
#endif
}

}  // namespace amp
