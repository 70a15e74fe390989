#include "runtime/backend.h"

#include <array>
#include <stdexcept>

#include "runtime/cpu/cpu_backend.h"

namespace amp {

namespace {
std::array<Backend*, 2>& registry() {
  static std::array<Backend*, 2> r{};
  return r;
}
}  // namespace

void Backend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  broadcast_to(bias, y);
  gemm(false, true, 1.0f, x, w, 1.0f, y);
}

void register_backend(DeviceType t, Backend* b) { registry()[static_cast<size_t>(t)] = b; }

bool backend_available(DeviceType t) { return t == DeviceType::cpu || registry()[static_cast<size_t>(t)] != nullptr; }

Backend& backend_for(Device d) {
  if (d.is_cpu()) return cpu_backend();
  Backend* b = registry()[static_cast<size_t>(d.type)];
  if (b == nullptr)
    throw std::runtime_error("no backend for device " + d.str() +
                             (d.is_cuda() ? ": this build has no CUDA backend (configure with AMP_WITH_CUDA=ON)" : ""));
  return *b;
}

}  // namespace amp
