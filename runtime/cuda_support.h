// The seam between device-independent code and the CUDA backend. runtime/cuda/cuda_support.cpp
// implements it when the backend is built; runtime/cuda_stub.cpp otherwise. CMake picks the file.
#pragma once
#include <string>

namespace amp {

bool cuda_built();
// Whether a usable device exists. If not, *reason says why (no device, driver too old, not built).
bool cuda_usable(std::string* reason);
// Selects device local_rank % device_count and registers the CUDA backend. Throws std::runtime_error
// with a clear message when CUDA is not usable.
void cuda_init(int local_rank);

}  // namespace amp
