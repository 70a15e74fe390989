// Overflow attribution: which parameters have non-finite gradients. Run it only after a step was
// skipped (it reads every gradient on the host), never on the hot path.
#pragma once
#include <string>
#include <vector>

#include "runtime/nn/module.h"

namespace amp {

std::vector<std::string> nonfinite_gradients(const std::vector<nn::NamedTensor>& named_params);

}  // namespace amp
