// The CPU backend's one instance. Its kernels, one file per op family: cpu_elementwise.cpp (casts,
// unary and binary maps, broadcast_to and sum_to), cpu_softmax.cpp, cpu_loss.cpp, cpu_random.cpp,
// cpu_embedding.cpp, cpu_layer_norm.cpp, cpu_permute.cpp, cpu_gemm.cpp, cpu_fused.cpp (the AMP
// and optimizer passes, norms, clipping). Its memory is runtime/core/host_memory.cpp.
#include "runtime/kernels/cpu/cpu_backend.h"

namespace amp {

Backend& cpu_backend() {
  static CpuBackend b;
  return b;
}

}  // namespace amp
