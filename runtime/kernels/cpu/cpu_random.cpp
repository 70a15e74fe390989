// The CPU backend's counter-based random fills: uniform, normal, and dropout's mask.
#include "runtime/kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <vector>
#include <type_traits>

#include "runtime/kernels/activation_math.h"
#include "runtime/kernels/cpu/dispatch.h"
#include "runtime/kernels/cpu/exp_float.h"
#include "runtime/kernels/rng_math.h"
#include "runtime/kernels/transformer_math.h"

namespace amp {

void CpuBackend::fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, double lo, double hi) {
  cpu::dispatch_float(t.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    T* d = t.data<T>();
    const long n = static_cast<long>(t.numel());
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
    for (long i = 0; i < n; ++i) {
      const double u = math::uniform01(seed, offset + static_cast<uint64_t>(i));
      d[i] = Elem<T>::store(static_cast<typename Elem<T>::Compute>(lo + (hi - lo) * u));
    }
  });
}

void CpuBackend::fill_normal(Tensor& t, uint64_t seed, uint64_t offset, double mean, double std) {
  cpu::dispatch_float(t.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    T* d = t.data<T>();
    const long n = static_cast<long>(t.numel());
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
    for (long i = 0; i < n; ++i) {
      const double z = math::standard_normal(seed, offset + static_cast<uint64_t>(i));
      d[i] = Elem<T>::store(static_cast<typename Elem<T>::Compute>(mean + std * z));
    }
  });
}

void CpuBackend::dropout_mask(Tensor& mask, uint64_t seed, uint64_t offset, double p, const Tensor& base,
                              uint64_t per_base) {
  if (base.defined()) {
    require_device_scalar(base, DType::i64, kCPU, "dropout: the counter base");
    offset += static_cast<uint64_t>(base.data<int64_t>()[0]) * per_base;
  }
  cpu::dispatch_float(mask.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    T* d = mask.data<T>();
    const long n = static_cast<long>(mask.numel());
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
    for (long i = 0; i < n; ++i)
      d[i] = Elem<T>::store(static_cast<typename Elem<T>::Compute>(math::dropout_mask(seed, offset + static_cast<uint64_t>(i), p)));
  });
}

}  // namespace amp
