// A module's parameters as named tensors, and loading them back with full validation: the names,
// shapes and dtypes must match exactly, and errors name the source, the tensor and both shapes.
#pragma once
#include <string>

#include "runtime/nn/module.h"
#include "runtime/core/safetensors.h"

namespace amp::nn {

safetensors::NamedTensors state_dict(const Module& m);  // shares storage with the parameters
void load_state_dict(Module& m, const safetensors::NamedTensors& tensors, const std::string& source);

}  // namespace amp::nn
