// Gradient clipping, as torch.nn.utils: clip_grad_norm_ and clip_grad_value_.
#pragma once
#include <vector>

#include "runtime/tensor.h"

namespace amp {

// Scales the gradients of params so that their total norm is at most max_norm, and returns that
// total norm (before clipping) as a 0-d f32 tensor on the device. norm_type may be inf.
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);
// Clamps every gradient element into [-clip_value, clip_value].
void clip_grad_value_(const std::vector<Tensor>& params, double clip_value);

}  // namespace amp
