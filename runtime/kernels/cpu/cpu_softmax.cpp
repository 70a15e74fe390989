// The CPU backend's softmax family: softmax and log-softmax over the last dim, attention's causal
// softmax, and their backward.
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

namespace {
// A float row's softmax: y = e^(scale x - mx) (vectorised, cpu::exp_float), their sum in fp64
// lanes (cpu::lane_sum), then y / sum. (In place too: each element is read before it is written.)
AMP_SIMD_CLONES void softmax_float_row(const float* x, float* y, long n, float scale, float mx) {
  for (long c = 0; c < n; ++c) y[c] = cpu::exp_float(scale * x[c] - mx);
  const float total = static_cast<float>(cpu::lane_sum(n, [y](long c) { return static_cast<double>(y[c]); }));
  for (long c = 0; c < n; ++c) y[c] = y[c] / total;
}

// A float row's log-softmax: y = (scale x - mx) - log(sum of e^(scale x - mx)), the sum as above.
AMP_SIMD_CLONES void log_softmax_float_row(const float* x, float* y, long n, float scale, float mx) {
  const double total = cpu::lane_sum(n, [&](long c) { return static_cast<double>(cpu::exp_float(scale * x[c] - mx)); });
  const float log_total = std::log(static_cast<float>(total));
  for (long c = 0; c < n; ++c) y[c] = (scale * x[c] - mx) - log_total;
}

// Softmax (or log-softmax) of each row of x [rows, cols]. causal: row r is query r mod cols, whose
// keys past it get 0 (attention's mask); scale multiplies x first (1 for a plain softmax: 1 x is x
// exactly). Float rows (the softmax of attention and of the loss under autocast) take the
// vectorised row kernels above; other dtypes compute each exp in their compute type.
template <class T>
void softmax_rows(const Tensor& x, Tensor& y, bool log, double scale, bool causal) {
  using C = typename Elem<T>::Compute;
  const long cols = x.dim() == 0 ? 1 : static_cast<long>(x.shape().back());
  const long rows = cols == 0 ? 0 : static_cast<long>(x.numel()) / cols;
  const C sc = static_cast<C>(scale);
  const T* xs = x.data<T>();
  T* ys = y.data<T>();
  auto ld = [sc](T v) { return sc * static_cast<C>(Elem<T>::load(v)); };
#pragma omp parallel for schedule(static) if (rows * cols > cpu::kParallelGrain)
  for (long r = 0; r < rows; ++r) {
    const T* xr = xs + r * cols;
    T* yr = ys + r * cols;
    const long valid = causal ? r % cols + 1 : cols;
    C mx = -std::numeric_limits<C>::infinity();
    for (long c = 0; c < valid; ++c) mx = std::max(mx, ld(xr[c]));
    if constexpr (std::is_same_v<T, float>) {
      if (log) log_softmax_float_row(xr, yr, valid, sc, mx);
      else softmax_float_row(xr, yr, valid, sc, mx);
    } else {
      C total = 0;
      for (long c = 0; c < valid; ++c) total += std::exp(ld(xr[c]) - mx);
      const C log_total = std::log(total);
      for (long c = 0; c < valid; ++c) {
        const C shifted = ld(xr[c]) - mx;
        yr[c] = Elem<T>::store(log ? shifted - log_total : std::exp(shifted) / total);
      }
    }
    for (long c = valid; c < cols; ++c) yr[c] = Elem<T>::store(C(0));
  }
}
}  // namespace

void CpuBackend::softmax_lastdim(const Tensor& x, Tensor& y, bool log) {
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { softmax_rows<decltype(T_tag)>(x, y, log, 1.0, false); });
}

void CpuBackend::causal_softmax(const Tensor& x, Tensor& y, double scale) {
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { softmax_rows<decltype(T_tag)>(x, y, false, scale, true); });
}

namespace {
// Softmax's (or log-softmax's) gradient for rows [0, rows) of C elements, from the output y.
template <class T, class Cm = typename Elem<T>::Compute>
AMP_SIMD_CLONES void softmax_grad_rows(const T* ys, const T* gs, T* out, long rows, long C, bool log, Cm scale) {
  auto ld = [](T v) { return static_cast<Cm>(Elem<T>::load(v)); };
  for (long r = 0; r < rows; ++r) {
    const T* yr = ys + r * C;
    const T* gr = gs + r * C;
    T* o = out + r * C;
    const Cm row = static_cast<Cm>(log ? cpu::lane_sum(C, [&](long c) { return static_cast<double>(ld(gr[c])); })
                                       : cpu::lane_sum(C, [&](long c) { return static_cast<double>(ld(gr[c]) * ld(yr[c])); }));
    if (log)
      for (long c = 0; c < C; ++c) o[c] = Elem<T>::store(math::log_softmax_grad<Cm>(ld(yr[c]), ld(gr[c]), row));
    else
      for (long c = 0; c < C; ++c) o[c] = Elem<T>::store(math::softmax_grad<Cm>(ld(yr[c]), ld(gr[c]), row, scale));
  }
}
}  // namespace

void CpuBackend::softmax_backward(const Tensor& y, const Tensor& g, Tensor& gx, bool log, double scale) {
  const long C = y.dim() == 0 ? 1 : static_cast<long>(y.shape().back()), rows = C == 0 ? 0 : static_cast<long>(y.numel()) / C;
  cpu::dispatch_float(y.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using Cm = typename Elem<T>::Compute;
    const T *ys = y.data<T>(), *gs = g.data<T>();
    T* out = gx.data<T>();
    cpu::parallel_chunks(rows, [&](long r, long e) {
      softmax_grad_rows<T>(ys + r * C, gs + r * C, out + r * C, e - r, C, log, static_cast<Cm>(scale));
    }, cpu::kParallelGrain / std::max(C, 1L));
  });
}

}  // namespace amp
