// The CPU backend's negative log-likelihood loss and its backward.
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

namespace amp {

void CpuBackend::nll_loss(const Tensor& logp, const Tensor& target, Tensor& loss) {
  const int64_t rows = logp.shape()[0], cols = logp.shape()[1];
  const int64_t* t = target.data<int64_t>();
  cpu::dispatch_float(logp.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    double acc = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      if (t[r] < 0 || t[r] >= cols)
        throw std::out_of_range("nll_loss: target " + std::to_string(t[r]) + " is out of bounds for " +
                                std::to_string(cols) + " classes");
      acc += static_cast<double>(Elem<T>::load(logp.data<T>()[r * cols + t[r]]));
    }
    loss.data<T>()[0] = Elem<T>::store(static_cast<typename Elem<T>::Compute>(-acc / static_cast<double>(rows)));
  });
}

void CpuBackend::nll_loss_backward(const Tensor& grad, const Tensor& target, Tensor& grad_logp) {
  const int64_t rows = grad_logp.shape()[0], cols = grad_logp.shape()[1];
  const int64_t* t = target.data<int64_t>();
  host_memory().fill(grad_logp, 0.0);
  cpu::dispatch_float(grad_logp.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename Elem<T>::Compute;
    const C g = static_cast<C>(Elem<T>::load(grad.data<T>()[0]));
    for (int64_t r = 0; r < rows; ++r)
      grad_logp.data<T>()[r * cols + t[r]] = Elem<T>::store(-g / static_cast<C>(rows));
  });
}

}  // namespace amp
