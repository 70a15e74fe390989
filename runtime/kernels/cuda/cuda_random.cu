// CUDA backend: counter-based random fills, and dropout's mask. Element i uses counter offset + i (rng_math.h), so a
// tensor filled on the GPU holds the same values as one filled on the CPU with the same seed.
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/rng_math.h"
#include "runtime/kernels/transformer_math.h"

namespace amp::cuda {

namespace {

template <class T>
__global__ void uniform_kernel(T* d, int64_t n, uint64_t seed, uint64_t offset, double lo, double hi) {
  AMP_GRID_STRIDE(i, n) {
    const double u = math::uniform01(seed, offset + static_cast<uint64_t>(i));
    d[i] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(lo + (hi - lo) * u));
  }
}

template <class T>
__global__ void normal_kernel(T* d, int64_t n, uint64_t seed, uint64_t offset, double mean, double std) {
  AMP_GRID_STRIDE(i, n) {
    const double z = math::standard_normal(seed, offset + static_cast<uint64_t>(i));
    d[i] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(mean + std * z));
  }
}

template <class T>
__global__ void dropout_mask_kernel(T* mask, int64_t n, uint64_t seed, uint64_t offset, double p,
                                    const int64_t* base, uint64_t per_base) {
  const uint64_t first = offset + (base != nullptr ? static_cast<uint64_t>(*base) * per_base : 0);
  AMP_GRID_STRIDE(i, n)
    mask[i] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(
        math::dropout_mask(seed, first + static_cast<uint64_t>(i), p)));
}

}  // namespace

void CudaBackend::fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, double lo, double hi) {
  require_cuda(t, "fill_uniform: tensor");
  const int64_t n = t.numel();
  if (n == 0) return;
  Context& ctx = context();
  dispatch_float(t.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(0, n * static_cast<int64_t>(sizeof(T)), 10 * n);
    AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), uniform_kernel<T>)(t.data<T>(), n, seed, offset, lo, hi);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::fill_normal(Tensor& t, uint64_t seed, uint64_t offset, double mean, double std) {
  require_cuda(t, "fill_normal: tensor");
  const int64_t n = t.numel();
  if (n == 0) return;
  Context& ctx = context();
  dispatch_float(t.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(0, n * static_cast<int64_t>(sizeof(T)), 20 * n);
    AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), normal_kernel<T>)(t.data<T>(), n, seed, offset, mean, std);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::dropout_mask(Tensor& mask, uint64_t seed, uint64_t offset, double p, const Tensor& base,
                               uint64_t per_base) {
  require_cuda(mask, "dropout: mask");
  if (base.defined()) require_device_scalar(base, DType::i64, mask.device(), "dropout: the counter base");
  const int64_t n = mask.numel();
  if (n == 0) return;
  Context& ctx = context();
  const int64_t* b = base.defined() ? base.data<int64_t>() : nullptr;
  dispatch_float(mask.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(b != nullptr ? 8 : 0, n * static_cast<int64_t>(sizeof(T)), 10 * n);  // a counter-based draw an element
    AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), dropout_mask_kernel<T>)(mask.data<T>(), n, seed,
                                                                                              offset, p, b, per_base);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace amp::cuda
