// A module's parameters as named tensors, and loading them back with full validation: the names,
// shapes and dtypes must match exactly, and errors name the source, the tensor and both shapes. A
// parameter with padding rows (Module::saved_rows) is saved and loaded without them.
#pragma once
#include <string>

#include "runtime/nn/module.h"
#include "runtime/core/safetensors.h"

namespace amp::nn {

safetensors::NamedTensors state_dict(const Module& m);  // shares storage with the parameters
void load_state_dict(Module& m, const safetensors::NamedTensors& tensors, const std::string& source);

// The first `rows` rows of t (a view: shares storage), and the inverse: `saved` in the first rows of a
// new tensor of shape `full` on its device, the rest zero (for state that has a parameter's shape,
// as an optimizer's moments).
Tensor first_rows(const Tensor& t, int64_t rows);
Tensor zero_padded_rows(const Tensor& saved, const Shape& full);

}  // namespace amp::nn
