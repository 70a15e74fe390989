// CUDA backend: softmax and log-softmax over the last dim, attention's causal softmax, their
// backward, and their autocast variants (the casts in the same pass). One block per row; row sums in
// double. The per-element math is runtime/kernels/transformer_math.h, shared with the CPU backend.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/kernels/cuda/block_reduce.cuh"
#include "runtime/kernels/cuda/broadcast_index.h"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/row_blocks.cuh"
#include "runtime/kernels/strided_index.h"
#include "runtime/kernels/transformer_math.h"

namespace amp::cuda {

namespace {

// g may be stored in a narrower dtype G than y and gx in O (autocast's casts in the same pass: g read
// as its cast to T, gx rounded once from T's value into O, the numbers of cast, kernel, cast).
template <class T, class G, class O>
__global__ void softmax_backward_kernel(const T* __restrict__ y, const G* __restrict__ g, O* __restrict__ gx,
                                        int64_t cols, bool log, double scale) {
  using C = typename DevElem<T>::Compute;
  const int64_t r = blockIdx.x;
  const T* yr = y + r * cols;
  const G* gr = g + r * cols;
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const C gv = static_cast<C>(DevElem<G>::load(gr[c]));
    acc += log ? static_cast<double>(gv) : static_cast<double>(gv * static_cast<C>(DevElem<T>::load(yr[c])));
  }
  const C row = static_cast<C>(block_reduce(acc, SumOp{}));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const C yv = static_cast<C>(DevElem<T>::load(yr[c])), gv = static_cast<C>(DevElem<G>::load(gr[c]));
    const T out = DevElem<T>::store(log ? math::log_softmax_grad<C>(yv, gv, row)
                                        : math::softmax_grad<C>(yv, gv, row, static_cast<C>(scale)));
    gx[r * cols + c] = DevElem<O>::store(static_cast<typename DevElem<O>::Compute>(DevElem<T>::load(out)));
  }
}

// One block per row. causal: row r is query r mod cols, whose keys past it get 0 (attention's
// mask); scale multiplies x first (1 for a plain softmax: 1 x is x exactly). x may be stored in a
// narrower dtype X than y (read as its cast to T: exact from f16/bf16 to f32), and where low is not
// null the row is also written cast to L (autocast's casts in the same pass, the same numbers).
template <class X, class T, class L>
__global__ void softmax_kernel(const X* __restrict__ x, T* __restrict__ y, L* __restrict__ low, int64_t cols, bool log,
                               double scale, bool causal) {
  using C = typename DevElem<T>::Compute;
  const int64_t r = blockIdx.x;
  const X* xr = x + r * cols;
  T* yr = y + r * cols;
  const int64_t valid = causal ? r % cols + 1 : cols;
  const C sc = static_cast<C>(scale);
  C mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < valid; c += blockDim.x) mx = MaxOp{}(mx, sc * static_cast<C>(DevElem<X>::load(xr[c])));
  mx = block_reduce(mx, MaxOp{});
  C total = 0;
  for (int64_t c = threadIdx.x; c < valid; c += blockDim.x) total += std::exp(sc * static_cast<C>(DevElem<X>::load(xr[c])) - mx);
  total = block_reduce(total, SumOp{});
  const C log_total = std::log(total);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    C v = 0;  // past the query: not read
    if (c < valid) {
      const C shifted = sc * static_cast<C>(DevElem<X>::load(xr[c])) - mx;
      v = log ? shifted - log_total : std::exp(shifted) / total;
    }
    const T out = DevElem<T>::store(v);
    yr[c] = out;
    if (low != nullptr) low[r * cols + c] = DevElem<L>::store(static_cast<typename DevElem<L>::Compute>(DevElem<T>::load(out)));
  }
}

// The elements a softmax reads: all, or (causal) row r's first r mod cols + 1.
int64_t read_elements(int64_t rows, int64_t cols, bool causal) {
  if (!causal) return rows * cols;
  const int64_t full = rows / cols, rem = rows % cols;
  return full * (cols * (cols + 1) / 2) + rem * (rem + 1) / 2;
}

void launch_softmax(const Tensor& x, Tensor& y, bool log, double scale, bool causal, const char* op) {
  require_cuda(x, op);
  require_cuda(y, op);
  const int64_t cols = x.dim() == 0 ? 1 : x.shape().back();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument(std::string(op) + ": more than 2^31-1 rows");
  const int threads = row_threads(cols);
  Context& ctx = context();
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    // Every element read (causal: those up to the query), every one written; the passes over a row
    // after the first hit the cache. About 5 operations an element.
    declare_launch_cost(read_elements(rows, cols, causal) * static_cast<int64_t>(sizeof(T)),
                        x.numel() * static_cast<int64_t>(sizeof(T)), 5 * x.numel());
    AMP_LAUNCH(static_cast<unsigned>(rows), threads, 0, ctx.stream(), softmax_kernel<T, T, T>)(
        x.data<T>(), y.data<T>(), nullptr, cols, log, scale, causal);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void CudaBackend::softmax_backward(const Tensor& y, const Tensor& g, Tensor& gx, bool log, double scale) {
  require_cuda(y, "softmax_backward: output");
  require_cuda(g, "softmax_backward: gradient");
  require_cuda(gx, "softmax_backward: input's gradient");
  const int64_t cols = y.dim() == 0 ? 1 : y.shape().back(), rows = cols == 0 ? 0 : y.numel() / cols;
  if (rows == 0) return;
  Context& ctx = context();
  dispatch_float(y.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(2 * y.numel() * static_cast<int64_t>(sizeof(T)), y.numel() * static_cast<int64_t>(sizeof(T)), 4 * y.numel());
    AMP_LAUNCH(rows_grid(rows, "softmax_backward"), row_threads(cols), 0, ctx.stream(), softmax_backward_kernel<T, T, T>)(
        y.data<T>(), g.data<T>(), gx.data<T>(), cols, log, scale);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::softmax_backward_cast(const Tensor& y, const Tensor& g, Tensor& gx, double scale) {
  // One pass for autocast's case: an fp32 softmax, its 16-bit gradient in and out.
  const bool narrow = g.dtype() == DType::f16 || g.dtype() == DType::bf16;
  if (!narrow || y.dtype() != DType::f32 || gx.dtype() != g.dtype()) {
    Backend::softmax_backward_cast(y, g, gx, scale);
    return;
  }
  require_cuda(y, "softmax_backward: output");
  require_cuda(g, "softmax_backward: gradient");
  require_cuda(gx, "softmax_backward: input's gradient");
  if (g.numel() != y.numel() || gx.numel() != y.numel())
    throw std::invalid_argument("softmax_backward: operands differ in size");
  const int64_t cols = y.dim() == 0 ? 1 : y.shape().back(), rows = cols == 0 ? 0 : y.numel() / cols;
  if (rows == 0) return;
  Context& ctx = context();
  dispatch_float(g.dtype(), [&](auto G_tag) { using G = decltype(G_tag);
    if constexpr (std::is_same_v<G, Half> || std::is_same_v<G, BFloat16>) {
      const int64_t n = y.numel(), gb = static_cast<int64_t>(sizeof(G));
      declare_launch_cost(n * (4 + gb), n * gb, 4 * n);
      AMP_LAUNCH(rows_grid(rows, "softmax_backward"), row_threads(cols), 0, ctx.stream(),
                 softmax_backward_kernel<float, G, G>)(y.data<float>(), g.data<G>(), gx.data<G>(), cols, false, scale);
      AMP_CUDA_CHECK_LAUNCH();
    }
  });
}

void CudaBackend::softmax_lastdim(const Tensor& x, Tensor& y, bool log) { launch_softmax(x, y, log, 1.0, false, "softmax"); }

void CudaBackend::causal_softmax(const Tensor& x, Tensor& y, double scale) {
  launch_softmax(x, y, false, scale, true, "causal_softmax");
}

void CudaBackend::causal_softmax_cast(const Tensor& x, Tensor& y, const Tensor& low, double scale) {
  // One pass for autocast's case: 16-bit scores, an fp32 softmax, its 16-bit copy in the same dtype.
  const bool narrow = x.dtype() == DType::f16 || x.dtype() == DType::bf16;
  if (!narrow || y.dtype() != DType::f32 || (low.defined() && low.dtype() != x.dtype())) {
    Backend::causal_softmax_cast(x, y, low, scale);
    return;
  }
  require_cuda(x, "causal_softmax: input");
  require_cuda(y, "causal_softmax: output");
  if (low.defined()) require_cuda(low, "causal_softmax: low-precision output");
  if (x.numel() != y.numel() || (low.defined() && low.numel() != y.numel()))
    throw std::invalid_argument("causal_softmax: input and outputs differ in size");
  const int64_t cols = x.dim() == 0 ? 1 : x.shape().back();
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return;
  if (rows > 0x7fffffff) throw std::invalid_argument("causal_softmax: more than 2^31-1 rows");
  const int threads = row_threads(cols);  // launch_softmax's: the same sums
  Context& ctx = context();
  dispatch_float(x.dtype(), [&](auto X_tag) { using X = decltype(X_tag);
    if constexpr (std::is_same_v<X, Half> || std::is_same_v<X, BFloat16>) {
      const int64_t n = x.numel(), xb = static_cast<int64_t>(sizeof(X));
      declare_launch_cost(read_elements(rows, cols, true) * xb, n * 4 + (low.defined() ? n * xb : 0), 5 * n);
      AMP_LAUNCH(static_cast<unsigned>(rows), threads, 0, ctx.stream(), softmax_kernel<X, float, X>)(
          x.data<X>(), y.data<float>(), low.defined() ? static_cast<X*>(low.data_ptr()) : nullptr, cols, false, scale,
          true);
      AMP_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace amp::cuda
