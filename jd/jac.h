// TorchJD's .jac: the Jacobian of m losses with respect to a leaf, [m, *shape], which mtl_backward
// writes and jac_to_grad / aggregate_into_grads read. Kept here, in a table keyed by the leaf, rather
// than on the tensor: Jacobian descent is this layer's concept, not the tensor core's.
#pragma once
#include "runtime/core/tensor.h"

namespace amp::jd {

Tensor jac(const Tensor& leaf);                   // undefined when none is set
void set_jac(const Tensor& leaf, const Tensor& j);  // an undefined j clears it
}  // namespace amp::jd
