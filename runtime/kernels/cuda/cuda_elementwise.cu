// CUDA backend: fill, cast, unary and binary element-wise kernels with broadcasting, broadcast_to.
// Per-element math comes from activation_math.h; loads and stores from device_elem.cuh.
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "runtime/kernels/activation_math.h"
#include "runtime/kernels/cuda/broadcast_index.h"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/vec_pack.cuh"

namespace amp::cuda {

// --- kernels

namespace {

template <class U>
__global__ void fill_kernel(U* d, int64_t n, U v) {
  AMP_GRID_STRIDE(i, n) d[i] = v;
}

template <class U>
__global__ void fill_from_device_kernel(U* d, int64_t n, const U* v) {
  AMP_GRID_STRIDE(i, n) d[i] = v[0];
}

// Mirrors the CPU cast loop: fp64 sources round once into fp32, or via fp32 into a 16-bit type.
template <class S, class D>
__global__ void cast_kernel(const S* s, D* d, int64_t n) {
  AMP_GRID_STRIDE(i, n) {
    if constexpr (std::is_same_v<S, double>) {
      if constexpr (std::is_same_v<D, double>) d[i] = s[i];
      else if constexpr (std::is_same_v<D, float>) d[i] = static_cast<float>(s[i]);
      else d[i] = DevElem<D>::store(static_cast<float>(s[i]));
    } else if constexpr (std::is_same_v<D, double>) {
      d[i] = static_cast<double>(DevElem<S>::load(s[i]));
    } else {
      d[i] = DevElem<D>::store(DevElem<S>::load(s[i]));
    }
  }
}

// cast_kernel's conversion of one element, and the same over packs (contiguous, aligned operands).
template <class S, class D>
__device__ __forceinline__ D cast_element(S v) {
  if constexpr (std::is_same_v<S, double>) {
    if constexpr (std::is_same_v<D, double>) return v;
    else if constexpr (std::is_same_v<D, float>) return static_cast<float>(v);
    else return DevElem<D>::store(static_cast<float>(v));
  } else if constexpr (std::is_same_v<D, double>) {
    return static_cast<double>(DevElem<S>::load(v));
  } else {
    return DevElem<D>::store(static_cast<typename DevElem<D>::Compute>(DevElem<S>::load(v)));
  }
}

template <class S, class D>
__global__ void cast_packed_kernel(const S* __restrict__ s, D* __restrict__ d, int64_t n) {
  constexpr int N = kPackOf<S, D>;
  const int64_t packs = n / N;
  AMP_GRID_STRIDE(p, packs) {
    const Pack<S, N> in = reinterpret_cast<const Pack<S, N>*>(s)[p];
    Pack<D, N> out;
    for (int k = 0; k < N; ++k) out.v[k] = cast_element<S, D>(in.v[k]);
    reinterpret_cast<Pack<D, N>*>(d)[p] = out;
  }
  const int64_t tail = packs * N + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tail < n) d[tail] = cast_element<S, D>(s[tail]);
}

// pow with exponent 2 is a separate op so that it is v * v exactly, as on the CPU.
enum class UnaryKind { neg, exp, log, sqrt, relu, gelu, gelu_tanh, square, pow, mul, div, add, copy };

template <UnaryKind K, class C>
__device__ __forceinline__ C unary_fn(C v, C a) {
  if constexpr (K == UnaryKind::neg) return -v;
  else if constexpr (K == UnaryKind::exp) return std::exp(v);
  else if constexpr (K == UnaryKind::log) return std::log(v);
  else if constexpr (K == UnaryKind::sqrt) return std::sqrt(v);
  else if constexpr (K == UnaryKind::relu) return math::relu(v);
  else if constexpr (K == UnaryKind::gelu) return math::gelu(v);
  else if constexpr (K == UnaryKind::gelu_tanh) return math::gelu_tanh(v);
  else if constexpr (K == UnaryKind::square) return v * v;
  else if constexpr (K == UnaryKind::pow) return std::pow(v, a);
  else if constexpr (K == UnaryKind::mul) return v * a;
  else if constexpr (K == UnaryKind::div) return v / a;
  else if constexpr (K == UnaryKind::add) return v + a;
  else return v;
}

template <UnaryKind K, class T>
__global__ void unary_kernel(const T* x, T* y, int64_t n, typename DevElem<T>::Compute a) {
  using C = typename DevElem<T>::Compute;
  AMP_GRID_STRIDE(i, n) y[i] = DevElem<T>::store(unary_fn<K, C>(static_cast<C>(DevElem<T>::load(x[i])), a));
}

// unary_kernel over packs: contiguous, aligned operands (y may be x: each thread reads its pack
// before it writes it).
template <UnaryKind K, class T>
__global__ void unary_packed_kernel(const T* x, T* y, int64_t n, typename DevElem<T>::Compute a) {
  using C = typename DevElem<T>::Compute;
  constexpr int N = kPackOf<T>;
  const int64_t packs = n / N;
  AMP_GRID_STRIDE(p, packs) {
    const Pack<T, N> in = reinterpret_cast<const Pack<T, N>*>(x)[p];
    Pack<T, N> out;
    for (int k = 0; k < N; ++k) out.v[k] = DevElem<T>::store(unary_fn<K, C>(static_cast<C>(DevElem<T>::load(in.v[k])), a));
    reinterpret_cast<Pack<T, N>*>(y)[p] = out;
  }
  const int64_t tail = packs * N + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tail < n) y[tail] = DevElem<T>::store(unary_fn<K, C>(static_cast<C>(DevElem<T>::load(x[tail])), a));
}

template <BinaryOp K, class C>
__device__ __forceinline__ C binary_fn(C x, C y) {
  if constexpr (K == BinaryOp::add) return x + y;
  else if constexpr (K == BinaryOp::sub) return x - y;
  else if constexpr (K == BinaryOp::mul) return x * y;
  else if constexpr (K == BinaryOp::div) return x / y;
  else if constexpr (K == BinaryOp::relu_backward) return math::relu_backward(x, y);
  else if constexpr (K == BinaryOp::gelu_backward) return math::gelu_backward(x, y);
  else return math::gelu_tanh_backward(x, y);
}

template <BinaryOp K, class T>
__global__ void binary_kernel(const T* a, const T* b, T* out, int64_t n, BroadcastIndex ia, BroadcastIndex ib) {
  using C = typename DevElem<T>::Compute;
  AMP_GRID_STRIDE(i, n) {
    const C x = DevElem<T>::load(a[ia.offset(i)]);
    const C y = DevElem<T>::load(b[ib.offset(i)]);
    out[i] = DevElem<T>::store(binary_fn<K, C>(x, y));
  }
}

// a + b, b read as its cast to T (add_cast): contiguous operands of one shape.
template <class T, class B>
__global__ void add_cast_kernel(const T* __restrict__ a, const B* __restrict__ b, T* __restrict__ out, int64_t n) {
  using C = typename DevElem<T>::Compute;
  AMP_GRID_STRIDE(i, n) out[i] = DevElem<T>::store(binary_fn<BinaryOp::add, C>(DevElem<T>::load(a[i]), load_as<T>(b[i])));
}

// binary_kernel for operands of the output's shape over packs: contiguous, aligned (out may be a or b).
template <BinaryOp K, class T>
__global__ void binary_packed_kernel(const T* a, const T* b, T* out, int64_t n) {
  using C = typename DevElem<T>::Compute;
  constexpr int N = kPackOf<T>;
  const int64_t packs = n / N;
  AMP_GRID_STRIDE(p, packs) {
    const Pack<T, N> x = reinterpret_cast<const Pack<T, N>*>(a)[p], y = reinterpret_cast<const Pack<T, N>*>(b)[p];
    Pack<T, N> r;
    for (int k = 0; k < N; ++k) r.v[k] = DevElem<T>::store(binary_fn<K, C>(DevElem<T>::load(x.v[k]), DevElem<T>::load(y.v[k])));
    reinterpret_cast<Pack<T, N>*>(out)[p] = r;
  }
  const int64_t tail = packs * N + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tail < n) out[tail] = DevElem<T>::store(binary_fn<K, C>(DevElem<T>::load(a[tail]), DevElem<T>::load(b[tail])));
}

template <class U>
__global__ void gather_kernel(const U* x, U* out, int64_t n, BroadcastIndex ix) {
  AMP_GRID_STRIDE(i, n) out[i] = x[ix.offset(i)];
}

// broadcast_to where x is out's trailing dims (a bias [C] to [N, C]): out is x repeated, pack by
// pack (x's length a whole number of packs): one remainder per 16 bytes instead of an index per element.
template <class U, int N>
__global__ void tile_kernel(const U* x, int64_t x_packs, U* out, int64_t packs) {
  AMP_GRID_STRIDE(i, packs) reinterpret_cast<Pack<U, N>*>(out)[i] = reinterpret_cast<const Pack<U, N>*>(x)[i % x_packs];
}

// Whether out is x repeated: x's shape, aligned right, is 1 in out's leading dims and equal in the rest.
bool is_tile(const Shape& x, const Shape& out) {
  if (x.size() > out.size()) return false;
  const size_t lead = out.size() - x.size();
  size_t d = 0;
  while (d < x.size() && x[d] == 1 && out[lead + d] != 1) ++d;  // x's leading 1s broadcast
  for (; d < x.size(); ++d)
    if (x[d] != out[lead + d]) return false;
  return true;
}

}  // namespace

// --- launchers

namespace {

template <class U>
void launch_fill(void* d, int64_t n, U v) {
  Context& ctx = context();
  declare_launch_cost(0, n * static_cast<int64_t>(sizeof(U)));
  AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), fill_kernel<U>)(static_cast<U*>(d), n, v);
  AMP_CUDA_CHECK_LAUNCH();
}

// Runs f(U{}) with the unsigned integer type as wide as one element: copies need only the bits.
template <class F>
void dispatch_bits(size_t size, F&& f) {
  switch (size) {
    case 2: f(uint16_t{}); return;
    case 4: f(uint32_t{}); return;
    case 8: f(uint64_t{}); return;
    default: throw std::invalid_argument("CUDA backend: unsupported element size " + std::to_string(size));
  }
}

template <UnaryKind K, class T>
void launch_unary(const Tensor& x, Tensor& y, double alpha) {
  using C = typename DevElem<T>::Compute;
  Context& ctx = context();
  const int64_t n = x.numel();
  declare_launch_cost(n * static_cast<int64_t>(sizeof(T)), n * static_cast<int64_t>(sizeof(T)), n);
  constexpr int pack_bytes = kPackOf<T> * static_cast<int>(sizeof(T));
  if (pack_aligned(x.data_ptr(), pack_bytes) && pack_aligned(y.data_ptr(), pack_bytes))
    AMP_LAUNCH(packed_grid(n, kPackOf<T>, ctx.sm_count()), kBlock, 0, ctx.stream(), unary_packed_kernel<K, T>)(
        x.data<T>(), y.data<T>(), n, static_cast<C>(alpha));
  else
    AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), unary_kernel<K, T>)(x.data<T>(), y.data<T>(), n,
                                                                                   static_cast<C>(alpha));
  AMP_CUDA_CHECK_LAUNCH();
}

template <BinaryOp K, class T>
void launch_binary(const Tensor& a, const Tensor& b, Tensor& out) {
  Context& ctx = context();
  const int64_t n = out.numel();
  const BroadcastIndex ia = make_broadcast_index(a.shape(), out.shape());
  const BroadcastIndex ib = make_broadcast_index(b.shape(), out.shape());
  // A broadcast operand is read once: its own size, not the output's (what a cache makes of it).
  declare_launch_cost((a.numel() + b.numel()) * static_cast<int64_t>(sizeof(T)), n * static_cast<int64_t>(sizeof(T)), n);
  constexpr int pack_bytes = kPackOf<T> * static_cast<int>(sizeof(T));
  if (ia.identity && ib.identity && pack_aligned(a.data_ptr(), pack_bytes) && pack_aligned(b.data_ptr(), pack_bytes) &&
      pack_aligned(out.data_ptr(), pack_bytes))
    AMP_LAUNCH(packed_grid(n, kPackOf<T>, ctx.sm_count()), kBlock, 0, ctx.stream(), binary_packed_kernel<K, T>)(
        a.data<T>(), b.data<T>(), out.data<T>(), n);
  else
    AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), binary_kernel<K, T>)(a.data<T>(), b.data<T>(),
                                                                                    out.data<T>(), n, ia, ib);
  AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void CudaBackend::fill(Tensor& t, double value) {
  require_cuda(t, "fill: tensor");
  const int64_t n = t.numel();
  if (n == 0) return;
  // The element's bits are computed on the host with the CPU's conversion, then replicated.
  switch (t.dtype()) {
    case DType::i64: launch_fill<uint64_t>(t.data_ptr(), n, static_cast<uint64_t>(static_cast<int64_t>(value))); return;
    case DType::f64: {
      uint64_t bits;
      std::memcpy(&bits, &value, 8);
      launch_fill<uint64_t>(t.data_ptr(), n, bits);
      return;
    }
    case DType::f32: launch_fill<uint32_t>(t.data_ptr(), n, f32_bits(static_cast<float>(value))); return;
    case DType::f16: launch_fill<uint16_t>(t.data_ptr(), n, f32_to_f16_bits(static_cast<float>(value))); return;
    case DType::bf16: launch_fill<uint16_t>(t.data_ptr(), n, f32_to_bf16_bits(static_cast<float>(value))); return;
  }
}

void CudaBackend::cast(const Tensor& src, Tensor& dst) {
  require_cuda(src, "cast: source");
  require_cuda(dst, "cast: destination");
  if (src.numel() != dst.numel()) throw std::invalid_argument("cast: element counts differ");
  const int64_t n = src.numel();
  if (n == 0) return;
  Context& ctx = context();
  dispatch_float(src.dtype(), [&](auto S_tag) { using S = decltype(S_tag);
    dispatch_float(dst.dtype(), [&](auto D_tag) { using D = decltype(D_tag);
      declare_launch_cost(n * static_cast<int64_t>(sizeof(S)), n * static_cast<int64_t>(sizeof(D)));
      constexpr int N = kPackOf<S, D>;
      if (pack_aligned(src.data_ptr(), N * static_cast<int>(sizeof(S))) && pack_aligned(dst.data_ptr(), N * static_cast<int>(sizeof(D))))
        AMP_LAUNCH(packed_grid(n, N, ctx.sm_count()), kBlock, 0, ctx.stream(), cast_packed_kernel<S, D>)(src.data<S>(), dst.data<D>(), n);
      else
        AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), cast_kernel<S, D>)(src.data<S>(), dst.data<D>(), n);
      AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

void CudaBackend::unary(UnaryOp op, const Tensor& x, Tensor& y, double alpha) {
  require_cuda(x, "unary op: input");
  require_cuda(y, "unary op: output");
  if (x.numel() == 0) return;
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    switch (op) {
      case UnaryOp::neg: launch_unary<UnaryKind::neg, T>(x, y, alpha); break;
      case UnaryOp::exp: launch_unary<UnaryKind::exp, T>(x, y, alpha); break;
      case UnaryOp::log: launch_unary<UnaryKind::log, T>(x, y, alpha); break;
      case UnaryOp::sqrt: launch_unary<UnaryKind::sqrt, T>(x, y, alpha); break;
      case UnaryOp::relu: launch_unary<UnaryKind::relu, T>(x, y, alpha); break;
      case UnaryOp::gelu: launch_unary<UnaryKind::gelu, T>(x, y, alpha); break;
      case UnaryOp::gelu_tanh: launch_unary<UnaryKind::gelu_tanh, T>(x, y, alpha); break;
      case UnaryOp::pow_scalar:
        if (alpha == 2.0) launch_unary<UnaryKind::square, T>(x, y, alpha);
        else launch_unary<UnaryKind::pow, T>(x, y, alpha);
        break;
      case UnaryOp::mul_scalar: launch_unary<UnaryKind::mul, T>(x, y, alpha); break;
      case UnaryOp::div_scalar: launch_unary<UnaryKind::div, T>(x, y, alpha); break;
      case UnaryOp::add_scalar: launch_unary<UnaryKind::add, T>(x, y, alpha); break;
      case UnaryOp::copy: launch_unary<UnaryKind::copy, T>(x, y, alpha); break;
    }
  });
}

void CudaBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) {
  require_cuda(a, "binary op: first operand");
  require_cuda(b, "binary op: second operand");
  require_cuda(out, "binary op: output");
  if (a.dtype() != b.dtype() || a.dtype() != out.dtype())
    throw std::invalid_argument(std::string("binary op: dtypes differ (") + dtype_name(a.dtype()) + ", " +
                                dtype_name(b.dtype()) + ")");
  if (out.numel() == 0) return;
  dispatch_float(a.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    switch (op) {
      case BinaryOp::add: launch_binary<BinaryOp::add, T>(a, b, out); break;
      case BinaryOp::sub: launch_binary<BinaryOp::sub, T>(a, b, out); break;
      case BinaryOp::mul: launch_binary<BinaryOp::mul, T>(a, b, out); break;
      case BinaryOp::div: launch_binary<BinaryOp::div, T>(a, b, out); break;
      case BinaryOp::relu_backward: launch_binary<BinaryOp::relu_backward, T>(a, b, out); break;
      case BinaryOp::gelu_backward: launch_binary<BinaryOp::gelu_backward, T>(a, b, out); break;
      case BinaryOp::gelu_tanh_backward: launch_binary<BinaryOp::gelu_tanh_backward, T>(a, b, out); break;
    }
  });
}

void CudaBackend::add_cast(const Tensor& a, const Tensor& b, Tensor& out) {
  require_cuda(a, "add_cast: first operand");
  require_cuda(b, "add_cast: second operand");
  require_cuda(out, "add_cast: output");
  if (a.dtype() != out.dtype() || a.shape() != b.shape() || a.shape() != out.shape())
    throw std::invalid_argument("add_cast: expected a and out of one dtype, and one shape for all three");
  const int64_t n = out.numel();
  if (n == 0) return;
  Context& ctx = context();
  dispatch_float(a.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    dispatch_float(b.dtype(), [&](auto B_tag) { using B = decltype(B_tag);
      declare_launch_cost(n * static_cast<int64_t>(sizeof(T) + sizeof(B)), n * static_cast<int64_t>(sizeof(T)), n);
      AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), add_cast_kernel<T, B>)(
          a.data<T>(), b.data<B>(), out.data<T>(), n);
      AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

void CudaBackend::broadcast_to(const Tensor& x, Tensor& out) {
  require_cuda(x, "broadcast_to: input");
  require_cuda(out, "broadcast_to: output");
  const BroadcastIndex ix = make_broadcast_index(x.shape(), out.shape());
  const int64_t n = out.numel();
  if (n == 0) return;
  Context& ctx = context();
  dispatch_bits(dtype_size(x.dtype()), [&](auto U_tag) { using U = decltype(U_tag);
    const unsigned grid = grid_for(n, ctx.sm_count());
    const int64_t read = x.numel() * static_cast<int64_t>(sizeof(U)), written = n * static_cast<int64_t>(sizeof(U));
    constexpr int N = kPackOf<U>;
    if (x.numel() == 1) {
      declare_launch_cost(read, written);
      AMP_LAUNCH(grid, kBlock, 0, ctx.stream(), fill_from_device_kernel<U>)(out.data<U>(), n, x.data<U>());
    } else if (x.numel() % N == 0 && is_tile(x.shape(), out.shape()) && pack_aligned(x.data_ptr(), 16) &&
               pack_aligned(out.data_ptr(), 16)) {
      declare_launch_cost(read, written, n / N * kDivModFlops);  // a remainder per pack
      AMP_LAUNCH(grid_for(n / N, ctx.sm_count()), kBlock, 0, ctx.stream(), tile_kernel<U, N>)(
          x.data<U>(), x.numel() / N, out.data<U>(), n / N);
    } else {
      declare_launch_cost(read, written, ix.identity || ix.scalar ? 0 : n * 2 * ix.ndim * kDivModFlops);
      AMP_LAUNCH(grid, kBlock, 0, ctx.stream(), gather_kernel<U>)(x.data<U>(), out.data<U>(), n, ix);
    }
    AMP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace amp::cuda
