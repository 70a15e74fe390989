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
// A 64-bit integer division or remainder (a kernel's index arithmetic: a strided or broadcast index
// costs two per dim per element), in the FLOPs declare_launch_cost counts. Calibrated on an H200
// (2026-11-26): permute_kernel over 4 dims of 6.3 M bf16 elements took 120 us, 8 divisions an
// element, where its bytes alone take 6: about 160 FLOPs of the cost model's element-wise rate each.
inline constexpr int64_t kDivModFlops = 160;
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
