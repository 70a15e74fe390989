// The emulated GPU's step observer (launch/training/step_observer.h), linked into the training
// library by preset cuda-emu: each step's counts from the emulator's counters (emu.h), the step's
// marks and its device memory peak in the launch log (AMP_EMU_LAUNCH_LOG), and the run's totals (with
// the emulator's own count of the most device memory the process held).
#include <cstdio>

#include "emu.h"
#include "launch/training/step_observer.h"
#include "runtime/core/device_memory.h"

namespace amp::launch {
namespace {

DeviceCounts now() {
  const emu::Counters c = emu::counters();
  return {c.launches, c.host_syncs, c.d2h_copies, c.graph_launches, c.graph_ops, c.allocations};
}

class EmulatedGpuObserver final : public StepObserver {
 public:
  explicit EmulatedGpuObserver(Device device) : device_(device) {}
  void step_begin(int64_t step) override {
    memory_for(device_).reset_peak_bytes();  // the step's own peak, for the launch log
    emu::log_step_begin(step);
    from_ = now();
  }
  DeviceCounts step_end(int64_t step) override {
    const DeviceCounts to = now();
    const DeviceCounts d{to.launches - from_.launches,           to.host_syncs - from_.host_syncs,
                         to.d2h_copies - from_.d2h_copies,       to.graph_launches - from_.graph_launches,
                         to.graph_ops - from_.graph_ops,         to.allocations - from_.allocations};
    total_.launches += d.launches, total_.host_syncs += d.host_syncs, total_.d2h_copies += d.d2h_copies;
    total_.graph_launches += d.graph_launches, total_.graph_ops += d.graph_ops, total_.allocations += d.allocations;
    ++steps_;
    emu::log_step(step, memory_for(device_).peak_bytes());
    return d;
  }
  void run_end(int rank) override {
    // Every rank, not only rank 0 (whose figures the metrics hold): a sync on one rank is a sync.
    std::printf("amp_train: rank %d: emulated GPU: %lld host syncs, %lld kernel launches, %lld D2H copies, %lld "
                "CUDA graph launches (%lld operations) in %lld training steps; at most %zu bytes in cudaMalloc "
                "allocations\n",
                rank, static_cast<long long>(total_.host_syncs), static_cast<long long>(total_.launches),
                static_cast<long long>(total_.d2h_copies), static_cast<long long>(total_.graph_launches),
                static_cast<long long>(total_.graph_ops), static_cast<long long>(steps_), emu::device_bytes_high_water());
    std::fflush(stdout);
  }

 private:
  Device device_;
  DeviceCounts from_, total_;
  int64_t steps_ = 0;  // this process's, from 0 in a resumed run
};

}  // namespace

std::unique_ptr<StepObserver> make_step_observer(Device device) {
  if (!device.is_cuda()) return nullptr;
  return std::make_unique<EmulatedGpuObserver>(device);
}

}  // namespace amp::launch
