// Gradient clipping, as torch.nn.utils (2.x): get_total_norm, clip_grads_with_norm_, clip_grad_norm_
// and clip_grad_value_. Arguments are taken as PyTorch takes them: a negative max_norm flips the
// gradients, any norm_type is a vector norm (0 counts nonzeros, inf and -inf are max and min).
#pragma once
#include <vector>

#include "runtime/core/tensor.h"

namespace amp {

// Each tensor's vector norm of order p (torch._foreach_norm), as a float32 tensor of one element per
// tensor on `out`: one pass over the tensors of each device.
Tensor tensor_norms(const std::vector<Tensor>& tensors, double p, Device out);
// The norm of the per-tensor norms (torch.nn.utils.get_total_norm): each tensor's vector norm, then
// the vector norm of those, as a 0-d float32 tensor on the first tensor's device (a CPU 0 when
// tensors is empty). Never read on the host unless error_if_nonfinite.
Tensor get_total_norm(const std::vector<Tensor>& tensors, double norm_type = 2.0, bool error_if_nonfinite = false);
// Multiplies the gradients of params by min(1, (total_norm + 1e-6).reciprocal() * max_norm).
void clip_grads_with_norm_(const std::vector<Tensor>& params, double max_norm, const Tensor& total_norm);
// Both of the above on params' gradients; returns the total norm before clipping.
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);
// Clamps every gradient element into [-clip_value, clip_value] (a negative clip_value sets every
// element to clip_value, as torch.clamp does when min > max).
void clip_grad_value_(const std::vector<Tensor>& params, double clip_value);

}  // namespace amp
