// The CPU backend's element-wise family: casts, unary and binary maps (with broadcasting), and
// broadcast_to with its backward, sum_to.
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

// --- element-wise

namespace {

template <class S, class D>
AMP_SIMD_CLONES void cast_range(const S* s, D* d, long n) {
  for (long i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<S, double>) {
      // Round once from fp64 straight into the target, as a direct conversion would.
      if constexpr (std::is_same_v<D, double>) d[i] = s[i];
      else if constexpr (std::is_same_v<D, float>) d[i] = static_cast<float>(s[i]);
      else d[i] = Elem<D>::store(static_cast<float>(s[i]));
    } else if constexpr (std::is_same_v<D, double>) {
      d[i] = static_cast<double>(Elem<S>::load(s[i]));
    } else {
      d[i] = Elem<D>::store(Elem<S>::load(s[i]));
    }
  }
}

template <class S, class D>
void cast_loop(const S* s, D* d, long n) {
  cpu::parallel_chunks(n, [&](long b, long e) { cast_range(s + b, d + b, e - b); });
}

}  // namespace

void CpuBackend::cast(const Tensor& src, Tensor& dst) {
  if (src.numel() != dst.numel()) throw std::invalid_argument("cast: element counts differ");
  const long n = static_cast<long>(src.numel());
  cpu::dispatch_float(src.dtype(), [&](auto S_tag) { using S = decltype(S_tag);
    cpu::dispatch_float(dst.dtype(), [&](auto D_tag) { using D = decltype(D_tag); cast_loop(src.data<S>(), dst.data<D>(), n); });
  });
}

namespace {

template <class T, class F>
AMP_SIMD_CLONES void unary_range(const T* xs, T* ys, long n, F f) {
  using C = typename Elem<T>::Compute;
  for (long i = 0; i < n; ++i) ys[i] = Elem<T>::store(f(static_cast<C>(Elem<T>::load(xs[i]))));
}

template <class T, class F>
void map_unary(const Tensor& x, Tensor& y, F f) {
  const T* xs = x.data<T>();
  T* ys = y.data<T>();
  cpu::parallel_chunks(static_cast<long>(x.numel()), [&](long b, long e) { unary_range<T>(xs + b, ys + b, e - b, f); });
}

// Offsets of a broadcast operand: stride 0 along the dims it is broadcast over.
std::vector<int64_t> broadcast_strides(const Shape& in, const Shape& out) {
  if (in.size() > out.size()) throw std::invalid_argument("shape " + shape_str(in) + " has more dims than " + shape_str(out));
  std::vector<int64_t> strides(out.size(), 0);
  int64_t stride = 1;
  for (size_t k = 0; k < in.size(); ++k) {
    const size_t di = in.size() - 1 - k;
    const size_t dout = out.size() - 1 - k;
    if (in[di] != 1) strides[dout] = stride;
    if (in[di] != 1 && in[di] != out[dout])
      throw std::invalid_argument("shape " + shape_str(in) + " cannot broadcast to " + shape_str(out));
    stride *= in[di];
  }
  return strides;
}

int64_t offset_of(int64_t linear, const Shape& out, const std::vector<int64_t>& strides) {
  int64_t off = 0;
  for (size_t d = out.size(); d-- > 0;) {
    const int64_t idx = linear % out[d];
    linear /= out[d];
    off += idx * strides[d];
  }
  return off;
}

// out = f(a, b) over n elements; an operand marked Scalar is one value read n times.
template <bool AScalar, bool BScalar, class T, class F>
AMP_SIMD_CLONES void binary_range(const T* as, const T* bs, T* os, long n, F f) {
  using C = typename Elem<T>::Compute;
  for (long i = 0; i < n; ++i)
    os[i] = Elem<T>::store(f(static_cast<C>(Elem<T>::load(as[AScalar ? 0 : i])),
                             static_cast<C>(Elem<T>::load(bs[BScalar ? 0 : i]))));
}

// in repeats over out's leading dims: in's shape, leading 1s aside, is out's trailing shape.
bool is_trailing(const Shape& in, const Shape& out) {
  size_t lead = 0;
  while (lead < in.size() && in[lead] == 1) ++lead;
  const size_t k = in.size() - lead;
  return k <= out.size() && std::equal(in.begin() + static_cast<long>(lead), in.end(), out.end() - static_cast<long>(k));
}

template <class T, class F>
void map_binary(const Tensor& a, const Tensor& b, Tensor& out, F f) {
  const T* as = a.data<T>();
  const T* bs = b.data<T>();
  T* os = out.data<T>();
  const long n = static_cast<long>(out.numel());
  const bool a_full = a.shape() == out.shape(), b_full = b.shape() == out.shape();
  if (a_full && b_full) {
    cpu::parallel_chunks(n, [&](long i, long e) { binary_range<false, false, T>(as + i, bs + i, os + i, e - i, f); });
  } else if (a_full && b.numel() == 1) {
    cpu::parallel_chunks(n, [&](long i, long e) { binary_range<false, true, T>(as + i, bs, os + i, e - i, f); });
  } else if (b_full && a.numel() == 1) {
    cpu::parallel_chunks(n, [&](long i, long e) { binary_range<true, false, T>(as, bs + i, os + i, e - i, f); });
  } else if (n > 0 && ((a_full && is_trailing(b.shape(), out.shape())) || (b_full && is_trailing(a.shape(), out.shape())))) {
    // A row repeated over the leading dims (a bias): row by row.
    const long row = static_cast<long>(a_full ? b.numel() : a.numel());
    cpu::parallel_chunks(n / row, [&](long r0, long r1) {
      for (long o = r0 * row; o < r1 * row; o += row)
        binary_range<false, false, T>(a_full ? as + o : as, a_full ? bs : bs + o, os + o, row, f);
    }, cpu::kParallelGrain / row);
  } else {
    using C = typename Elem<T>::Compute;
    auto ld = [](T v) { return static_cast<C>(Elem<T>::load(v)); };
    const auto sa = broadcast_strides(a.shape(), out.shape());
    const auto sb = broadcast_strides(b.shape(), out.shape());
    const Shape& shape = out.shape();
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
    for (long i = 0; i < n; ++i)
      os[i] = Elem<T>::store(f(ld(as[offset_of(i, shape, sa)]), ld(bs[offset_of(i, shape, sb)])));
  }
}

}  // namespace

namespace {

// In a 16-bit dtype every input is one of 65536 values, so GELU's output for each, and its slope
// (the float factor its backward multiplies the gradient by), are computed once by the very
// functions the per-element loop would call: the results are bit for bit the same, without an erf
// and an exp per element.
template <class T>
struct GeluTable {
  std::vector<T> value;      // Elem<T>::store(gelu(load(bits)))
  std::vector<float> slope;  // gelu_slope(load(bits))
};

template <class T>
const GeluTable<T>& gelu_table(bool tanh) {
  static const auto build = [](bool approx) {
    GeluTable<T> t;
    t.value.resize(65536);
    t.slope.resize(65536);
    for (uint32_t b = 0; b < 65536; ++b) {
      const float v = Elem<T>::load(T{static_cast<uint16_t>(b)});
      t.value[b] = Elem<T>::store(approx ? math::gelu_tanh(v) : math::gelu(v));
      t.slope[b] = approx ? math::gelu_tanh_slope(v) : math::gelu_slope(v);
    }
    return t;
  };
  if (tanh) {
    static const GeluTable<T> approx = build(true);  // each built on its first use only
    return approx;
  }
  static const GeluTable<T> exact = build(false);
  return exact;
}

template <class T>
constexpr bool kSixteenBit = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

template <class T>
void gelu_by_table(const Tensor& x, Tensor& y, bool tanh) {
  const GeluTable<T>& t = gelu_table<T>(tanh);
  const T* xs = x.data<T>();
  T* ys = y.data<T>();
  const long n = static_cast<long>(x.numel());
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
  for (long i = 0; i < n; ++i) ys[i] = t.value[xs[i].bits];
}

template <class T>
void gelu_backward_by_table(const Tensor& g, const Tensor& x, Tensor& out, bool tanh) {
  const GeluTable<T>& t = gelu_table<T>(tanh);
  const T* gs = g.data<T>();
  const T* xs = x.data<T>();
  T* os = out.data<T>();
  const long n = static_cast<long>(out.numel());
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
  for (long i = 0; i < n; ++i) os[i] = Elem<T>::store(Elem<T>::load(gs[i]) * t.slope[xs[i].bits]);
}

}  // namespace

void CpuBackend::unary(UnaryOp op, const Tensor& x, Tensor& y, double alpha) {
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename Elem<T>::Compute;
    const C a = static_cast<C>(alpha);
    switch (op) {
      case UnaryOp::neg: map_unary<T>(x, y, [](C v) { return -v; }); break;
      case UnaryOp::exp: map_unary<T>(x, y, [](C v) { return std::exp(v); }); break;
      case UnaryOp::log: map_unary<T>(x, y, [](C v) { return std::log(v); }); break;
      case UnaryOp::sqrt: map_unary<T>(x, y, [](C v) { return std::sqrt(v); }); break;
      case UnaryOp::relu: map_unary<T>(x, y, [](C v) { return math::relu(v); }); break;
      case UnaryOp::gelu:
        if constexpr (kSixteenBit<T>) gelu_by_table<T>(x, y, false);
        else map_unary<T>(x, y, [](C v) { return math::gelu(v); });
        break;
      case UnaryOp::gelu_tanh:
        if constexpr (kSixteenBit<T>) gelu_by_table<T>(x, y, true);
        else map_unary<T>(x, y, [](C v) { return math::gelu_tanh(v); });
        break;
      case UnaryOp::pow_scalar:
        if (alpha == 2.0) map_unary<T>(x, y, [](C v) { return v * v; });
        else map_unary<T>(x, y, [a](C v) { return std::pow(v, a); });
        break;
      case UnaryOp::mul_scalar: map_unary<T>(x, y, [a](C v) { return v * a; }); break;
      case UnaryOp::div_scalar: map_unary<T>(x, y, [a](C v) { return v / a; }); break;
      case UnaryOp::add_scalar: map_unary<T>(x, y, [a](C v) { return v + a; }); break;
      case UnaryOp::copy: map_unary<T>(x, y, [](C v) { return v; }); break;
    }
  });
}

void CpuBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) {
  if (a.dtype() != b.dtype() || a.dtype() != out.dtype())
    throw std::invalid_argument(std::string("binary op: dtypes differ (") + dtype_name(a.dtype()) + ", " +
                                dtype_name(b.dtype()) + ")");
  cpu::dispatch_float(a.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename Elem<T>::Compute;
    switch (op) {
      case BinaryOp::add: map_binary<T>(a, b, out, [](C x, C y) { return x + y; }); break;
      case BinaryOp::sub: map_binary<T>(a, b, out, [](C x, C y) { return x - y; }); break;
      case BinaryOp::mul: map_binary<T>(a, b, out, [](C x, C y) { return x * y; }); break;
      case BinaryOp::div: map_binary<T>(a, b, out, [](C x, C y) { return x / y; }); break;
      case BinaryOp::relu_backward: map_binary<T>(a, b, out, [](C g, C x) { return math::relu_backward(g, x); }); break;
      case BinaryOp::gelu_backward:
      case BinaryOp::gelu_tanh_backward: {
        const bool tanh = op == BinaryOp::gelu_tanh_backward;
        if constexpr (kSixteenBit<T>) {
          if (a.shape() == out.shape() && b.shape() == out.shape()) {
            gelu_backward_by_table<T>(a, b, out, tanh);
            break;
          }
        }
        if (tanh) map_binary<T>(a, b, out, [](C g, C x) { return math::gelu_tanh_backward(g, x); });
        else map_binary<T>(a, b, out, [](C g, C x) { return math::gelu_backward(g, x); });
        break;
      }
    }
  });
}

void CpuBackend::broadcast_to(const Tensor& x, Tensor& out) {
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    const auto s = broadcast_strides(x.shape(), out.shape());
    const T* xs = x.data<T>();
    T* os = out.data<T>();
    const long n = static_cast<long>(out.numel());
    const Shape& shape = out.shape();
    const long row = x.dim() >= 1 ? static_cast<long>(x.shape().back()) : 1;
    if (x.numel() == 1) {
      std::fill_n(os, n, xs[0]);
    } else if (x.numel() == row && !shape.empty() && shape.back() == row) {
      // A row repeated over the leading dims: the bias of a linear layer.
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
      for (long r = 0; r < n / row; ++r) std::copy_n(xs, row, os + r * row);
    } else {
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
      for (long i = 0; i < n; ++i) os[i] = xs[offset_of(i, shape, s)];
    }
  });
}

namespace {
// acc[j] += the sum over rows of x[i, j] for columns [j0, j1) of x [rows, m]: each column sums its
// rows in order; a block of columns is read a row at a time (contiguous loads, a lane per column).
template <class T>
AMP_SIMD_CLONES void column_sums(const T* xs, long rows, long m, long j0, long j1, double* acc) {
  constexpr long kBlock = 64;
  for (long b0 = j0; b0 < j1; b0 += kBlock) {
    const long w = std::min(kBlock, j1 - b0);
    double a[kBlock] = {};
    for (long i = 0; i < rows; ++i) {
      const T* xr = xs + i * m + b0;
      for (long j = 0; j < w; ++j) a[j] += static_cast<double>(Elem<T>::load(xr[j]));
    }
    for (long j = 0; j < w; ++j) acc[b0 + j] += a[j];
  }
}
}  // namespace

// Reductions accumulate in fp64, over fixed chunks added in order: the same bits on any thread count.
void CpuBackend::sum_to(const Tensor& x, Tensor& out) {
  cpu::dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    const T* xs = x.data<T>();
    T* os = out.data<T>();
    const long n = static_cast<long>(x.numel());
    auto ld = [](T v) { return static_cast<double>(Elem<T>::load(v)); };
    auto st = [](double v) { return Elem<T>::store(static_cast<typename Elem<T>::Compute>(v)); };
    if (out.numel() == 1) {
      os[0] = st(cpu::sum_of_chunks(n, [&](long b, long e) {
        double acc = 0.0;
        for (long i = b; i < e; ++i) acc += ld(xs[i]);
        return acc;
      }));
    } else if (out.numel() == x.numel()) {
      std::memcpy(static_cast<void*>(os), xs, x.nbytes());
    } else {
      const auto s = broadcast_strides(out.shape(), x.shape());
      const long m = static_cast<long>(out.numel());
      std::vector<double> acc(static_cast<size_t>(m), 0.0);
      // out repeats over x's leading dims ([N, M] -> [M], the bias gradient; [B, T, C] -> [T, C]):
      // x is [n / m, m] summed over its rows.
      if (is_trailing(out.shape(), x.shape())) {
        const long r = n / m;
        cpu::parallel_chunks(m, [&](long j0, long j1) { column_sums(xs, r, m, j0, j1, acc.data()); },
                             cpu::kParallelGrain / std::max(r, 1L));
      } else {
        const Shape& shape = x.shape();
        for (long i = 0; i < n; ++i) acc[static_cast<size_t>(offset_of(i, shape, s))] += ld(xs[i]);
      }
      for (long j = 0; j < m; ++j) os[j] = st(acc[static_cast<size_t>(j)]);
    }
  });
}

}  // namespace amp
