// Kernel launches and static shared memory, written once for nvcc and for the emulated GPU
// (runtime/gpu_emulator, preset cuda-emu), which compiles the .cu files as host C++:
//   AMP_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...);
//   AMP_SHARED(T[32], name);   // a block's static __shared__ array or variable
// The kernel comes last so that a template's commas need no parentheses.
//
// Before a launch, its call site declares what the kernel moves and computes, from the tensors'
// sizes: declare_launch_cost(bytes_read, bytes_written, flops). The emulated GPU writes it to its
// launch log (AMP_EMU_LAUNCH_LOG) for the cost model (launch/bench/cost_model.py); on a GPU it is nothing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace amp::cuda {
#if defined(AMP_CUDA_EMU)
inline void declare_launch_cost(int64_t bytes_read, int64_t bytes_written, int64_t flops = 0) {
  ::amp::emu::declare_cost(bytes_read, bytes_written, flops);
}
#else
inline void declare_launch_cost(int64_t, int64_t, int64_t = 0) {}
#endif
}  // namespace amp::cuda

#if defined(AMP_CUDA_EMU)
#define AMP_LAUNCH(grid, block, shmem, stream, ...) \
  ::amp::emu::launch((grid), (block), (shmem), (stream), #__VA_ARGS__, __VA_ARGS__)
#define AMP_SHARED(type, name)                                         \
  static thread_local ::amp::emu::SharedVar<type> name##_emu_shared_; \
  auto& name = name##_emu_shared_.get()
#else
#define AMP_LAUNCH(grid, block, shmem, stream, ...) __VA_ARGS__<<<(grid), (block), (shmem), (stream)>>>
#define AMP_SHARED(type, name) __shared__ std::type_identity_t<type> name
#endif
