// The output of norm_accumulate_each, checked alike by every backend: one f32 element per tensor,
// on the tensors' device.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"

namespace amp {

inline void check_norms_output(const std::vector<Tensor>& xs, const Tensor& out) {
  if (out.dtype() != DType::f32 || out.numel() != static_cast<int64_t>(xs.size()))
    throw std::invalid_argument("norm_accumulate_each: the output must be a float32 tensor of " +
                                std::to_string(xs.size()) + " elements (one per tensor)");
  for (const Tensor& x : xs)
    if (x.device() != out.device())
      throw std::invalid_argument("norm_accumulate_each: every tensor must be on the output's device");
}

}  // namespace amp
