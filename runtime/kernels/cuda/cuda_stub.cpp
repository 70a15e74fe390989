// CUDA seam for builds without the CUDA backend (AMP_WITH_CUDA=OFF).
#include <stdexcept>

#include "runtime/kernels/cuda/cuda_support.h"

namespace amp {

bool cuda_built() { return false; }

bool cuda_usable(std::string* reason, bool* failing) {
  if (reason) *reason = "this build has no CUDA backend (configure with -DAMP_WITH_CUDA=ON)";
  if (failing) *failing = false;
  return false;
}

void cuda_set_allow_tf32(bool) {}
void cuda_profiler_start() {}
void cuda_profiler_stop() {}
std::unique_ptr<DeviceGraph> capture_device_graph(const std::function<void()>&) {
  throw std::runtime_error("CUDA graphs: this build has no CUDA backend (configure with -DAMP_WITH_CUDA=ON)");
}

bool cuda_select_device_before_mpi(int, int) { return false; }
std::string cuda_device_uuid() { return {}; }
std::string cudnn_attention_unavailable(DType, int64_t) { return "this build has no CUDA backend"; }
std::string cudnn_describe() { return "no cuDNN: this build has no CUDA backend"; }

void cuda_init(int, int) {
  throw std::invalid_argument("--device cuda: this build has no CUDA backend (configure with -DAMP_WITH_CUDA=ON)");
}

}  // namespace amp
