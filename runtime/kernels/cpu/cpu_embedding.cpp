// The CPU backend's embedding lookup and its backward (a deterministic scatter-add).
#include "runtime/kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/kernels/cpu/dispatch.h"
#include "runtime/kernels/strided_index.h"
#include "runtime/kernels/transformer_math.h"

namespace amp {

namespace {
void require_index(const Tensor& idx, const char* op) {
  if (idx.dtype() != DType::i64) throw std::invalid_argument(std::string(op) + ": indices must be int64");
}
}  // namespace

void CpuBackend::embedding(const Tensor& weight, const Tensor& idx, Tensor& out) {
  require_index(idx, "embedding");
  const int64_t V = weight.shape()[0], C = weight.shape()[1], N = idx.numel();
  const int64_t* ix = idx.data<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    if (ix[n] < 0 || ix[n] >= V)
      throw std::out_of_range("embedding: index " + std::to_string(ix[n]) + " is out of range for " +
                              std::to_string(V) + " rows");
  cpu::dispatch_float(weight.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    const T* w = weight.data<T>();
    T* o = out.data<T>();
#pragma omp parallel for schedule(static) if (N * C > cpu::kParallelGrain)
    for (long n = 0; n < static_cast<long>(N); ++n)
      for (int64_t c = 0; c < C; ++c) o[n * C + c] = w[ix[n] * C + c];
  });
}

void CpuBackend::embedding_backward(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) {
  require_index(idx, "embedding_backward");
  const int64_t V = grad_weight.shape()[0], C = grad_weight.shape()[1], N = idx.numel();
  const int64_t* ix = idx.data<int64_t>();
  cpu::dispatch_float(grad.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using Cm = typename Elem<T>::Compute;
    const T* g = grad.data<T>();
    T* gw = grad_weight.data<T>();
    // Columns in parallel, rows in order: each element sums its contributions in the order of n,
    // rounding into T at each addition (the CUDA backend sums each row's run in the compute type).
#pragma omp parallel for schedule(static) if (N * C > cpu::kParallelGrain)
    for (long c = 0; c < static_cast<long>(C); ++c)
      for (int64_t n = 0; n < N; ++n) {
        if (ix[n] < 0 || ix[n] >= V) continue;
        T& dst = gw[ix[n] * C + c];
        dst = Elem<T>::store(static_cast<Cm>(Elem<T>::load(dst)) + static_cast<Cm>(Elem<T>::load(g[n * C + c])));
      }
  });
}

}  // namespace amp
