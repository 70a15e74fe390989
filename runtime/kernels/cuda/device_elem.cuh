// Device-side loads and stores between storage types and the compute type (float, or double for
// f64), through the same bit-exact conversions as the CPU backend (runtime/core/half.h), plus the dtype
// dispatch and the 1-D launch geometry that every kernel file uses.
#pragma once
#include <cuda_runtime.h>

#include "runtime/kernels/cuda/launch.cuh"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "runtime/core/dtype.h"
#include "runtime/core/dtype_dispatch.h"
#include "runtime/core/half.h"

namespace amp::cuda {

template <class S>
struct DevElem;
template <>
struct DevElem<float> {
  using Compute = float;
  AMP_HD static float load(float v) { return v; }
  AMP_HD static float store(float v) { return v; }
};
template <>
struct DevElem<double> {
  using Compute = double;
  AMP_HD static double load(double v) { return v; }
  AMP_HD static double store(double v) { return v; }
};
template <>
struct DevElem<Half> {
  using Compute = float;
  AMP_HD static float load(Half v) { return f16_bits_to_f32(v.bits); }
  AMP_HD static Half store(float v) { return Half{f32_to_f16_bits(v)}; }
};
template <>
struct DevElem<BFloat16> {
  using Compute = float;
  AMP_HD static float load(BFloat16 v) { return bf16_bits_to_f32(v.bits); }
  AMP_HD static BFloat16 store(float v) { return BFloat16{f32_to_bf16_bits(v)}; }
};

using amp::dispatch_float;  // runtime/core/dtype_dispatch.h, shared with the CPU backend

// v of dtype G as its cast to T would read it, in T's compute type (the identity where G is T): a
// kernel that folds autocast's or promotion's cast of an operand into its own pass.
template <class T, class G>
__device__ __forceinline__ typename DevElem<T>::Compute load_as(G v) {
  using C = typename DevElem<T>::Compute;
  if constexpr (std::is_same_v<G, T>) return static_cast<C>(DevElem<T>::load(v));
  else return static_cast<C>(DevElem<T>::load(DevElem<T>::store(static_cast<C>(DevElem<G>::load(v)))));
}

constexpr int kBlock = 256;
// Grid-stride loops: enough blocks to fill the GPU a few times over, never more than the work needs.
inline unsigned grid_for(int64_t n, int sm_count) {
  const int64_t needed = (n + kBlock - 1) / kBlock;
  const int64_t cap = static_cast<int64_t>(sm_count) * 8;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, cap)));
}

#define AMP_GRID_STRIDE(i, n)                                                                     \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);          \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

}  // namespace amp::cuda
