// CPU backend: the transformer primitives (embedding, layer norm, permute, softmax's backward,
// dropout's mask; attention's causal softmax shares the softmax rows in cpu_backend.cpp). The
// per-element math is runtime/transformer_math.h, shared with the CUDA kernels; row and column sums
// run in double, in index order.
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
    // as the CUDA kernel does (one thread per column).
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
void CpuBackend::layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                            Tensor& rstd) {
  const int64_t C = x.shape().back(), rows = C == 0 ? 0 : x.numel() / C;
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using Cm = typename Elem<T>::Compute;
    auto ld = [](T v) { return static_cast<Cm>(Elem<T>::load(v)); };
    const T* xs = x.data<T>();
    const T* ws = w.data<T>();
    const T* bs = b.data<T>();
    T* ys = y.data<T>();
    Cm* mu = mean.data<Cm>();
    Cm* rs = rstd.data<Cm>();
#pragma omp parallel for schedule(static) if (rows * C > cpu::kParallelGrain)
    for (long r = 0; r < static_cast<long>(rows); ++r) {
      const T* xr = xs + r * C;
      double s = 0.0;
      for (int64_t c = 0; c < C; ++c) s += static_cast<double>(ld(xr[c]));
      const double m = s / static_cast<double>(C);
      double v = 0.0;
      for (int64_t c = 0; c < C; ++c) {
        const double d = static_cast<double>(ld(xr[c])) - m;
        v += d * d;
      }
      mu[r] = static_cast<Cm>(m);
      rs[r] = math::layer_norm_rstd<Cm>(v / static_cast<double>(C), eps);
      for (int64_t c = 0; c < C; ++c)
        ys[r * C + c] = Elem<T>::store(math::layer_norm_apply<Cm>(ld(xr[c]), mu[r], rs[r], ld(ws[c]), ld(bs[c])));
    }
  });
}

void CpuBackend::layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                     const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb) {
  const int64_t C = x.shape().back(), rows = C == 0 ? 0 : x.numel() / C;
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using Cm = typename Elem<T>::Compute;
    auto ld = [](T v) { return static_cast<Cm>(Elem<T>::load(v)); };
    const T* gs = g.data<T>();
    const T* xs = x.data<T>();
    const T* ws = w.data<T>();
    const Cm* mu = mean.data<Cm>();
    const Cm* rs = rstd.data<Cm>();
    auto xhat = [&](int64_t r, int64_t c) { return (ld(xs[r * C + c]) - mu[r]) * rs[r]; };
    T* gxs = gx.data<T>();
#pragma omp parallel for schedule(static) if (rows * C > cpu::kParallelGrain)
    for (long r = 0; r < static_cast<long>(rows); ++r) {
      double a = 0.0, bsum = 0.0;
      for (int64_t c = 0; c < C; ++c) {
        const Cm d = ld(gs[r * C + c]) * ld(ws[c]);
        a += static_cast<double>(d);
        bsum += static_cast<double>(d) * static_cast<double>(xhat(r, c));
      }
      const Cm ma = static_cast<Cm>(a / static_cast<double>(C));
      const Cm mb = static_cast<Cm>(bsum / static_cast<double>(C));
      for (int64_t c = 0; c < C; ++c)
        gxs[r * C + c] = Elem<T>::store(math::layer_norm_grad_input<Cm>(ld(gs[r * C + c]), ld(ws[c]), xhat(r, c), rs[r], ma, mb));
    }
    T* gws = gw.data<T>();
    T* gbs = gb.data<T>();
    // Each column sums its rows in order, a block of columns read a row at a time (contiguous loads).
    constexpr long kBlock = 64;
#pragma omp parallel for schedule(static) if (rows * C > cpu::kParallelGrain)
    for (long c0 = 0; c0 < static_cast<long>(C); c0 += kBlock) {
      const long c1 = std::min(static_cast<long>(C), c0 + kBlock);
      double sw[kBlock] = {}, sb[kBlock] = {};
      for (int64_t r = 0; r < rows; ++r)
        for (long c = c0; c < c1; ++c) {
          const double gv = static_cast<double>(ld(gs[r * C + c]));
          sw[c - c0] += gv * static_cast<double>(xhat(r, c));
          sb[c - c0] += gv;
        }
      for (long c = c0; c < c1; ++c) {
        gws[c] = Elem<T>::store(static_cast<Cm>(sw[c - c0]));
        gbs[c] = Elem<T>::store(static_cast<Cm>(sb[c - c0]));
      }
    }
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

void CpuBackend::softmax_backward(const Tensor& y, const Tensor& g, Tensor& gx, bool log, double scale) {
  const int64_t C = y.dim() == 0 ? 1 : y.shape().back(), rows = C == 0 ? 0 : y.numel() / C;
  cpu::dispatch_float(y.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using Cm = typename Elem<T>::Compute;
    auto ld = [](T v) { return static_cast<Cm>(Elem<T>::load(v)); };
    const T* ys = y.data<T>();
    const T* gs = g.data<T>();
    T* out = gx.data<T>();
#pragma omp parallel for schedule(static) if (rows * C > cpu::kParallelGrain)
    for (long r = 0; r < static_cast<long>(rows); ++r) {
      const T* yr = ys + r * C;
      const T* gr = gs + r * C;
      double acc = 0.0;
      for (int64_t c = 0; c < C; ++c) acc += log ? static_cast<double>(ld(gr[c])) : static_cast<double>(ld(gr[c]) * ld(yr[c]));
      const Cm row = static_cast<Cm>(acc);
      for (int64_t c = 0; c < C; ++c)
        out[r * C + c] = Elem<T>::store(log ? math::log_softmax_grad<Cm>(ld(yr[c]), ld(gr[c]), row)
                                            : math::softmax_grad<Cm>(ld(yr[c]), ld(gr[c]), row, static_cast<Cm>(scale)));
    }
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
