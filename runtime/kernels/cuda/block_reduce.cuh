// Block-wide reductions for the reduction kernels. The combination order depends only on the block
// size, so results are deterministic run to run.
#pragma once
#include <cuda_runtime.h>

#include "runtime/kernels/cuda/launch.cuh"

namespace amp::cuda {

struct SumOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
// std::max's semantics, (a < b) ? b : a, as the CPU softmax uses.
struct MaxOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? b : a; }
};

template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  return v;
}

// Every thread of the block must call it; the result is returned to every thread. blockDim.x must
// be a multiple of 32 and at most 1024. No shared slot is written while another thread may still
// read it (compute-sanitizer's racecheck on an H200 found the first version's total written into
// the warp_results[0] that the lanes of warp 0 read, with no barrier between: a shuffle orders
// execution, not memory).
template <class T, class Op>
__device__ T block_reduce(T v, Op op) {
  AMP_SHARED(T[32], warp_results);
  AMP_SHARED(T, total);  // not warp_results[0]: lane 0 would write the slot its warp's lanes read
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int warps = static_cast<int>(blockDim.x) / 32;
  v = warp_reduce(v, op);
  __syncthreads();  // warp_results may still be read by a previous call
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = warp_results[lane < warps ? lane : 0];
    // Lanes past the last warp repeat a real value; they are masked out of the fold below.
    for (int offset = 16; offset > 0; offset /= 2) {
      const T other = __shfl_down_sync(0xffffffffu, w, offset);
      if (lane + offset < warps) w = op(w, other);
    }
    if (lane == 0) total = w;
  }
  __syncthreads();
  return total;
}

}  // namespace amp::cuda
