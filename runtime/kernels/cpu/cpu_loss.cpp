// The CPU backend's negative log-likelihood loss and its backward, and the classifier's fused
// cross-entropy (softmax, loss and the logits' gradient without a copy of the logits in fp32).
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

namespace {
void check_targets(const int64_t* t, int64_t rows, int64_t classes) {
  for (int64_t r = 0; r < rows; ++r)
    if (t[r] < 0 || t[r] >= classes)
      throw std::out_of_range("cross_entropy: target " + std::to_string(t[r]) + " of row " + std::to_string(r) +
                              " is out of bounds for " + std::to_string(classes) + " classes");
}
}  // namespace

void CpuBackend::cross_entropy(const Tensor& logits, const Tensor& target, int64_t classes, Tensor& lse, Tensor& loss) {
  const long rows = static_cast<long>(logits.shape()[0]), cols = static_cast<long>(logits.shape()[1]);
  const int64_t* t = target.data<int64_t>();
  check_targets(t, rows, classes);
  cpu::dispatch_float(logits.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename Elem<T>::Compute;  // the loss's and lse's dtype
    const T* xs = logits.data<T>();
    C* ls = lse.data<C>();
    auto ld = [](T v) { return static_cast<C>(Elem<T>::load(v)); };
    cpu::parallel_chunks(rows, [&](long r0, long r1) {
      for (long r = r0; r < r1; ++r) {
        const T* xr = xs + r * cols;
        C mx = -std::numeric_limits<C>::infinity();
        for (long c = 0; c < classes; ++c) mx = std::max(mx, ld(xr[c]));
        const double total = cpu::lane_sum(classes, [&](long c) { return static_cast<double>(std::exp(ld(xr[c]) - mx)); });
        ls[r] = mx + static_cast<C>(std::log(total));
      }
    }, cpu::kParallelGrain / std::max(cols, 1L));
    double acc = 0.0;
    for (long r = 0; r < rows; ++r) acc += static_cast<double>(ls[r]) - static_cast<double>(ld(xs[r * cols + t[r]]));
    loss.data<C>()[0] = static_cast<C>(acc / static_cast<double>(rows));
  });
}

void CpuBackend::cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                        const Tensor& grad, int64_t classes, Tensor& gx) {
  const long rows = static_cast<long>(logits.shape()[0]), cols = static_cast<long>(logits.shape()[1]);
  const int64_t* t = target.data<int64_t>();
  cpu::dispatch_float(logits.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename Elem<T>::Compute;  // the loss's and lse's dtype
    const T* xs = logits.data<T>();
    const C* ls = lse.data<C>();
    T* out = gx.data<T>();
    const C scale = grad.data<C>()[0] / static_cast<C>(rows);
    cpu::parallel_chunks(rows, [&](long r0, long r1) {
      for (long r = r0; r < r1; ++r) {
        const T* xr = xs + r * cols;
        T* o = out + r * cols;
        for (long c = 0; c < classes; ++c)
          o[c] = Elem<T>::store(math::cross_entropy_grad<C>(static_cast<C>(Elem<T>::load(xr[c])), ls[r], scale, c == t[r]));
        for (long c = classes; c < cols; ++c) o[c] = Elem<T>::store(C(0));
      }
    }, cpu::kParallelGrain / std::max(cols, 1L));
  });
}

}  // namespace amp
