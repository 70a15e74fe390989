// Several one-element tensors reduced in one collective: a step's small figures (found_inf, the
// loss, the stop flag) share one message instead of paying one latency each.
#pragma once
#include <vector>

#include "comm/communicator.h"

namespace amp::comm {

// In place. Every tensor holds one float32 on the same device; the ranks pass the same count.
void all_reduce_scalars(Communicator& c, const std::vector<Tensor>& scalars, ReduceOp op);

}  // namespace amp::comm
