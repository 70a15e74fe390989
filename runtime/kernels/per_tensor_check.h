// The per-tensor flags of unscale_and_check and check_finite, checked alike by every backend:
// undefined (not asked for), or one float32 element per tensor on the tensors' device.
#pragma once
#include <stdexcept>
#include <string>

#include "runtime/core/tensor.h"

namespace amp {

inline void check_per_tensor(const Tensor& per_tensor, size_t tensors) {
  if (!per_tensor.defined()) return;
  if (per_tensor.dtype() != DType::f32 || per_tensor.numel() != static_cast<int64_t>(tensors))
    throw std::invalid_argument("per-tensor non-finite flags: expected a float32 tensor of " + std::to_string(tensors) +
                                " elements, got " + shape_str(per_tensor.shape()) + " " + dtype_name(per_tensor.dtype()));
}

}  // namespace amp
