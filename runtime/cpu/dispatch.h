// CPU loop helpers: the dtype dispatch shared with the CUDA backend, and the parallel grain.
#pragma once
#include "runtime/dtype_dispatch.h"

namespace amp::cpu {

using amp::dispatch_float;

// Below this many elements a loop runs on one thread: the fork/join would cost more.
inline constexpr long kParallelGrain = 1 << 15;

}  // namespace amp::cpu
