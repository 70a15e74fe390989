// What a stand-in for the device counts in each training step, for the metrics. The emulated GPU of
// preset cuda-emu counts the kernels launched, the host synchronisations, the device-to-host copies,
// the CUDA graphs replayed and the allocations; its observer (tests/emulated_gpu_observer.cpp) is
// the file that preset links into the training library. Every other build links
// no_step_observer.cpp: no observer, and the metrics carry no device counts.
#pragma once
#include <cstdint>
#include <memory>

#include "runtime/core/device.h"

namespace amp::launch {

struct DeviceCounts {
  int64_t launches = 0, host_syncs = 0, d2h_copies = 0;
  int64_t graph_launches = 0, graph_ops = 0;  // CUDA graphs replayed, and the operations they ran
  int64_t allocations = 0;                    // cudaMalloc and cudaMallocHost calls
};

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // Before any of step's work is issued.
  virtual void step_begin(int64_t step) = 0;
  // After all of step's work is issued: what the step issued.
  virtual DeviceCounts step_end(int64_t step) = 0;
  // After the last step: this rank's totals over the steps this process ran (a resumed run's own,
  // not its checkpoint's), said on stdout.
  virtual void run_end(int rank) = 0;
};

// The observer of training steps on `device`, or null where nothing counts.
std::unique_ptr<StepObserver> make_step_observer(Device device);

}  // namespace amp::launch
