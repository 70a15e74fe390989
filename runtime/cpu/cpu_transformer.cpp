// CPU backend: the transformer primitives (embedding, layer norm, permute, softmax's backward,
// dropout's mask; attention's causal softmax shares the softmax rows in cpu_backend.cpp). The
// per-element math is runtime/transformer_math.h, shared with the CUDA kernels; row and column sums
// run in double (a row's in cpu::lane_sum's fixed order, a column's in row order).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/cpu/cpu_backend.h"
#include "runtime/cpu/dispatch.h"
#include "runtime/strided_index.h"
#include "runtime/transformer_math.h"

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

// mean and rstd are f32, or f64 for f64 tensors (the compute type).
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

// The input's gradient for rows [0, rows).
template <class T, class Cm = typename Elem<T>::Compute>
AMP_SIMD_CLONES void layer_norm_grad_rows(const T* gs, const T* xs, const T* ws, const Cm* mu, const Cm* rs, T* gxs,
                                          long rows, long C) {
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
    for (long c = 0; c < C; ++c)
      gxr[c] = Elem<T>::store(math::layer_norm_grad_input<Cm>(ld(gr[c]), ld(ws[c]), xhat(c), rstd, ma, mb));
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
                                     const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb) {
  const long C = static_cast<long>(x.shape().back()), rows = C == 0 ? 0 : static_cast<long>(x.numel()) / C;
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using Cm = typename Elem<T>::Compute;
    const T *gs = g.data<T>(), *xs = x.data<T>(), *ws = w.data<T>();
    const Cm* mu = mean.data<Cm>();
    const Cm* rs = rstd.data<Cm>();
    T* gxs = gx.data<T>();
    cpu::parallel_chunks(rows, [&](long r, long e) {
      layer_norm_grad_rows<T>(gs + r * C, xs + r * C, ws, mu + r, rs + r, gxs + r * C, e - r, C);
    }, cpu::kParallelGrain / std::max(C, 1L));
    T* gws = gw.data<T>();
    T* gbs = gb.data<T>();
    cpu::parallel_chunks(C, [&](long c0, long c1) {
      layer_norm_param_grad_columns<T>(gs, xs, mu, rs, gws, gbs, rows, C, c0, c1);
    }, cpu::kParallelGrain / std::max(rows, 1L));
  });
}

void CpuBackend::permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) {
  const math::StridedIndex<8> pi = math::permuted<8>(x.shape(), perm);
  const int n = pi.n;
  const size_t es = dtype_size(x.dtype());
  const long total = static_cast<long>(x.numel());
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  // Whole rows when the last dim stays last: one copy per row.
  const int64_t row = n > 0 && perm[n - 1] == n - 1 ? x.shape()[n - 1] : 1;
  const long rows = row == 0 ? 0 : total / static_cast<long>(row);
#pragma omp parallel for schedule(static) if (total > cpu::kParallelGrain)
  for (long r = 0; r < rows; ++r) {
    const int64_t o = static_cast<int64_t>(r) * row;
    std::memcpy(dst + static_cast<size_t>(o) * es, src + static_cast<size_t>(pi.offset(o)) * es, static_cast<size_t>(row) * es);
  }
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

void CpuBackend::dropout_mask(Tensor& mask, uint64_t seed, uint64_t offset, double p) {
  cpu::dispatch_float(mask.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    T* d = mask.data<T>();
    const long n = static_cast<long>(mask.numel());
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
    for (long i = 0; i < n; ++i)
      d[i] = Elem<T>::store(static_cast<typename Elem<T>::Compute>(math::dropout_mask(seed, offset + static_cast<uint64_t>(i), p)));
  });
}

}  // namespace amp
