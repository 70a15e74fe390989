// Copies from global to shared memory that do not pass through registers (cp.async, sm_80 and newer):
// a thread issues 16-byte copies, closes them into a group, and later waits until at most N of its
// groups are still in flight; a __syncthreads after the wait makes every thread's copies visible to
// the block. So the next tile loads while the block computes on the last (two buffers).
// The emulated GPU lands each group at one end of its flight or the other, at random: at its commit (a
// refill of a buffer that other warps still read shows) or at the wait that retires it (a read that
// comes too early reads the old bytes): tests/gpu_emulator/kernel.h.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace amp::cuda {

// 16 bytes from src (global, 16-byte aligned) to dst (shared, 16-byte aligned); 16 zero bytes
// instead when !valid (src is then not read, but must still be a valid address: pass the base).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
#if defined(AMP_CUDA_EMU)
  ::amp::emu::cp_async_16(dst, src, valid ? 16 : 0, std::source_location::current());
#elif defined(__CUDA_ARCH__)
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(addr), "l"(src), "r"(valid ? 16 : 0) : "memory");
#endif
}

// Closes the copies issued since the last commit into a group.
__device__ __forceinline__ void cp_async_commit() {
#if defined(AMP_CUDA_EMU)
  ::amp::emu::cp_async_commit();
#elif defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most Pending of this thread's groups are in flight (the newest ones).
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(AMP_CUDA_EMU)
  ::amp::emu::cp_async_wait(Pending, std::source_location::current());
#elif defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
#endif
}

}  // namespace amp::cuda
