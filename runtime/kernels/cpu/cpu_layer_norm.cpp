// The CPU backend's layer norm and its backward (input, weight and bias gradients).
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
// LayerNorm over rows [0, rows) of C elements: each row's sums in fp64 (cpu::lane_sum), then the
// shared per-element math.
template <class T, class Cm = typename Elem<T>::Compute>
AMP_SIMD_CLONES void layer_norm_rows(const T* xs, const T* ws, const T* bs, T* ys, Cm* mu, Cm* rs, long rows, long C,
                                     double eps) {
  auto ld = [](T v) { return static_cast<Cm>(Elem<T>::load(v)); };
  for (long r = 0; r < rows; ++r) {
    const T* xr = xs + r * C;
    T* yr = ys + r * C;
    const double m = cpu::lane_sum(C, [&](long c) { return static_cast<double>(ld(xr[c])); }) / static_cast<double>(C);
    const double v = cpu::lane_sum(C, [&](long c) {
      const double d = static_cast<double>(ld(xr[c])) - m;
      return d * d;
    });
    const Cm mean = static_cast<Cm>(m), rstd = math::layer_norm_rstd<Cm>(v / static_cast<double>(C), eps);
    mu[r] = mean;
    rs[r] = rstd;
    for (long c = 0; c < C; ++c) yr[c] = Elem<T>::store(math::layer_norm_apply<Cm>(ld(xr[c]), mean, rstd, ld(ws[c]), ld(bs[c])));
  }
}

// The input's gradient for rows [0, rows); accumulate: added to gxs as add() adds (rounded to T, then
// the sum in the compute type).
template <class T, class Cm = typename Elem<T>::Compute>
AMP_SIMD_CLONES void layer_norm_grad_rows(const T* gs, const T* xs, const T* ws, const Cm* mu, const Cm* rs, T* gxs,
                                          long rows, long C, bool accumulate) {
  auto ld = [](T v) { return static_cast<Cm>(Elem<T>::load(v)); };
  for (long r = 0; r < rows; ++r) {
    const T* gr = gs + r * C;
    const T* xr = xs + r * C;
    T* gxr = gxs + r * C;
    const Cm mean = mu[r], rstd = rs[r];
    auto xhat = [&](long c) { return (ld(xr[c]) - mean) * rstd; };
    const double a = cpu::lane_sum(C, [&](long c) { return static_cast<double>(ld(gr[c]) * ld(ws[c])); });
    const double b = cpu::lane_sum(C, [&](long c) {
      return static_cast<double>(ld(gr[c]) * ld(ws[c])) * static_cast<double>(xhat(c));
    });
    const Cm ma = static_cast<Cm>(a / static_cast<double>(C)), mb = static_cast<Cm>(b / static_cast<double>(C));
    for (long c = 0; c < C; ++c) {
      const T d = Elem<T>::store(math::layer_norm_grad_input<Cm>(ld(gr[c]), ld(ws[c]), xhat(c), rstd, ma, mb));
      gxr[c] = accumulate ? Elem<T>::store(ld(gxr[c]) + ld(d)) : d;
    }
  }
}

// The weight's and bias's gradients for columns [c0, c1): each column sums its rows in order, the
// block read a row at a time (contiguous loads, one vector lane per column).
template <class T, class Cm = typename Elem<T>::Compute>
AMP_SIMD_CLONES void layer_norm_param_grad_columns(const T* gs, const T* xs, const Cm* mu, const Cm* rs, T* gws, T* gbs,
                                                   long rows, long C, long c0, long c1) {
  constexpr long kBlock = 64;
  auto ld = [](T v) { return static_cast<Cm>(Elem<T>::load(v)); };
  for (long b0 = c0; b0 < c1; b0 += kBlock) {
    const long w = std::min(kBlock, c1 - b0);
    double sw[kBlock] = {}, sb[kBlock] = {};
    for (long r = 0; r < rows; ++r) {
      const T* gr = gs + r * C + b0;
      const T* xr = xs + r * C + b0;
      const Cm mean = mu[r], rstd = rs[r];
      for (long c = 0; c < w; ++c) {
        const double gv = static_cast<double>(ld(gr[c]));
        sw[c] += gv * static_cast<double>((ld(xr[c]) - mean) * rstd);
        sb[c] += gv;
      }
    }
    for (long c = 0; c < w; ++c) {
      gws[b0 + c] = Elem<T>::store(static_cast<Cm>(sw[c]));
      gbs[b0 + c] = Elem<T>::store(static_cast<Cm>(sb[c]));
    }
  }
}
}  // namespace

void CpuBackend::layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                            Tensor& rstd) {
  const long C = static_cast<long>(x.shape().back()), rows = C == 0 ? 0 : static_cast<long>(x.numel()) / C;
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using Cm = typename Elem<T>::Compute;
    const T *xs = x.data<T>(), *ws = w.data<T>(), *bs = b.data<T>();
    T* ys = y.data<T>();
    Cm* mu = mean.data<Cm>();
    Cm* rs = rstd.data<Cm>();
    cpu::parallel_chunks(rows, [&](long r, long e) {
      layer_norm_rows<T>(xs + r * C, ws, bs, ys + r * C, mu + r, rs + r, e - r, C, eps);
    }, cpu::kParallelGrain / std::max(C, 1L));
  });
}

void CpuBackend::layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                     const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate) {
  const long C = static_cast<long>(x.shape().back()), rows = C == 0 ? 0 : static_cast<long>(x.numel()) / C;
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using Cm = typename Elem<T>::Compute;
    const T *gs = g.data<T>(), *xs = x.data<T>(), *ws = w.data<T>();
    const Cm* mu = mean.data<Cm>();
    const Cm* rs = rstd.data<Cm>();
    T* gxs = gx.data<T>();
    cpu::parallel_chunks(rows, [&](long r, long e) {
      layer_norm_grad_rows<T>(gs + r * C, xs + r * C, ws, mu + r, rs + r, gxs + r * C, e - r, C, accumulate);
    }, cpu::kParallelGrain / std::max(C, 1L));
    T* gws = gw.data<T>();
    T* gbs = gb.data<T>();
    cpu::parallel_chunks(C, [&](long c0, long c1) {
      layer_norm_param_grad_columns<T>(gs, xs, mu, rs, gws, gbs, rows, C, c0, c1);
    }, cpu::kParallelGrain / std::max(rows, 1L));
  });
}

}  // namespace amp
