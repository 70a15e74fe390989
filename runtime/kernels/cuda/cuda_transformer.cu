// CUDA backend: the transformer primitives (embedding, layer norm, permute, softmax's backward,
// dropout's mask; attention's causal softmax is softmax_kernel's, in cuda_reduce.cu). The
// per-element math is runtime/kernels/transformer_math.h, shared with the CPU backend; row statistics are
// block reductions in double, column sums run in row order (so gw, gb and the embedding's gradient
// add up in the CPU's order).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/kernels/cuda/block_reduce.cuh"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/strided_index.h"
#include "runtime/kernels/transformer_math.h"

namespace amp::cuda {

namespace {

constexpr int kMaxPermuteDims = 8;
using Permute = math::StridedIndex<kMaxPermuteDims>;

// --- kernels

// An index outside [0, vocab) gives a NaN row, which the loss and the scaler then report (a kernel
// cannot throw without a host sync).
template <class T>
__global__ void embedding_kernel(const T* w, const int64_t* idx, int64_t n_idx, int64_t vocab, int64_t cols, T* out) {
  AMP_GRID_STRIDE(i, n_idx * cols) {
    const int64_t n = i / cols, c = i % cols, v = idx[n];
    out[i] = v >= 0 && v < vocab ? w[v * cols + c] : DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(NAN));
  }
}

// One thread per column, rows in order: deterministic, and the CPU's order of addition.
template <class T>
__global__ void embedding_backward_kernel(const T* g, const int64_t* idx, int64_t n_idx, int64_t vocab, int64_t cols,
                                          T* gw) {
  using C = typename DevElem<T>::Compute;
  AMP_GRID_STRIDE(c, cols) {
    for (int64_t n = 0; n < n_idx; ++n) {
      const int64_t v = idx[n];
      if (v < 0 || v >= vocab) continue;
      T& dst = gw[v * cols + c];
      dst = DevElem<T>::store(static_cast<C>(DevElem<T>::load(dst)) + static_cast<C>(DevElem<T>::load(g[n * cols + c])));
    }
  }
}

// One block per row.
template <class T>
__global__ void layer_norm_kernel(const T* x, const T* w, const T* b, int64_t cols, double eps, T* y,
                                  typename DevElem<T>::Compute* mean, typename DevElem<T>::Compute* rstd) {
  using C = typename DevElem<T>::Compute;
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  double s = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += static_cast<double>(DevElem<T>::load(xr[c]));
  const double m = block_reduce(s, SumOp{}) / static_cast<double>(cols);
  double v = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const double d = static_cast<double>(DevElem<T>::load(xr[c])) - m;
    v += d * d;
  }
  v = block_reduce(v, SumOp{});
  const C mu = static_cast<C>(m);
  const C rs = math::layer_norm_rstd<C>(v / static_cast<double>(cols), eps);
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    y[r * cols + c] = DevElem<T>::store(math::layer_norm_apply<C>(
        static_cast<C>(DevElem<T>::load(xr[c])), mu, rs, static_cast<C>(DevElem<T>::load(w[c])),
        static_cast<C>(DevElem<T>::load(b[c]))));
}

// One block per row: the input's gradient.
template <class T>
__global__ void layer_norm_backward_input_kernel(const T* g, const T* x, const T* w,
                                                 const typename DevElem<T>::Compute* mean,
                                                 const typename DevElem<T>::Compute* rstd, int64_t cols, T* gx) {
  using C = typename DevElem<T>::Compute;
  const int64_t r = blockIdx.x;
  const C mu = mean[r], rs = rstd[r];
  double a = 0.0, bsum = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const C d = static_cast<C>(DevElem<T>::load(g[r * cols + c])) * static_cast<C>(DevElem<T>::load(w[c]));
    const C xhat = (static_cast<C>(DevElem<T>::load(x[r * cols + c])) - mu) * rs;
    a += static_cast<double>(d);
    bsum += static_cast<double>(d) * static_cast<double>(xhat);
  }
  a = block_reduce(a, SumOp{});
  bsum = block_reduce(bsum, SumOp{});
  const C ma = static_cast<C>(a / static_cast<double>(cols));
  const C mb = static_cast<C>(bsum / static_cast<double>(cols));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const C xhat = (static_cast<C>(DevElem<T>::load(x[r * cols + c])) - mu) * rs;
    gx[r * cols + c] = DevElem<T>::store(math::layer_norm_grad_input<C>(
        static_cast<C>(DevElem<T>::load(g[r * cols + c])), static_cast<C>(DevElem<T>::load(w[c])), xhat, rs, ma, mb));
  }
}

// One thread per column, rows in order: the weight's and the bias's gradients.
template <class T>
__global__ void layer_norm_backward_params_kernel(const T* g, const T* x, const typename DevElem<T>::Compute* mean,
                                                  const typename DevElem<T>::Compute* rstd, int64_t rows, int64_t cols,
                                                  T* gw, T* gb) {
  using C = typename DevElem<T>::Compute;
  AMP_GRID_STRIDE(c, cols) {
    double sw = 0.0, sb = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const double gv = static_cast<double>(DevElem<T>::load(g[r * cols + c]));
      const C xhat = (static_cast<C>(DevElem<T>::load(x[r * cols + c])) - mean[r]) * rstd[r];
      sw += gv * static_cast<double>(xhat);
      sb += gv;
    }
    gw[c] = DevElem<T>::store(static_cast<C>(sw));
    gb[c] = DevElem<T>::store(static_cast<C>(sb));
  }
}

template <class U>
__global__ void permute_kernel(const U* x, int64_t n, Permute index, U* out) {
  AMP_GRID_STRIDE(i, n) out[i] = x[index.offset(i)];
}

template <class T>
__global__ void dropout_mask_kernel(T* mask, int64_t n, uint64_t seed, uint64_t offset, double p) {
  AMP_GRID_STRIDE(i, n)
    mask[i] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(
        math::dropout_mask(seed, offset + static_cast<uint64_t>(i), p)));
}

template <class T>
__global__ void softmax_backward_kernel(const T* y, const T* g, T* gx, int64_t cols, bool log, double scale) {
  using C = typename DevElem<T>::Compute;
  const int64_t r = blockIdx.x;
  const T* yr = y + r * cols;
  const T* gr = g + r * cols;
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const C gv = static_cast<C>(DevElem<T>::load(gr[c]));
    acc += log ? static_cast<double>(gv) : static_cast<double>(gv * static_cast<C>(DevElem<T>::load(yr[c])));
  }
  const C row = static_cast<C>(block_reduce(acc, SumOp{}));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const C yv = static_cast<C>(DevElem<T>::load(yr[c])), gv = static_cast<C>(DevElem<T>::load(gr[c]));
    gx[r * cols + c] = DevElem<T>::store(log ? math::log_softmax_grad<C>(yv, gv, row)
                                             : math::softmax_grad<C>(yv, gv, row, static_cast<C>(scale)));
  }
}

int row_threads(int64_t cols) { return cols >= 256 ? 256 : (cols >= 64 ? 64 : 32); }

unsigned rows_grid(int64_t rows, const char* op) {
  if (rows > 0x7fffffff) throw std::invalid_argument(std::string(op) + ": more than 2^31-1 rows");
  return static_cast<unsigned>(rows);
}

}  // namespace

// --- launchers

void CudaBackend::embedding(const Tensor& weight, const Tensor& idx, Tensor& out) {
  require_cuda(weight, "embedding: weight");
  require_cuda(idx, "embedding: indices");
  require_cuda(out, "embedding: output");
  if (idx.dtype() != DType::i64) throw std::invalid_argument("embedding: indices must be int64");
  const int64_t vocab = weight.shape()[0], cols = weight.shape()[1], n = idx.numel();
  if (n * cols == 0) return;
  Context& ctx = context();
  dispatch_float(weight.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(n * 8 + n * cols * static_cast<int64_t>(sizeof(T)), n * cols * static_cast<int64_t>(sizeof(T)));
    AMP_LAUNCH(grid_for(n * cols, ctx.sm_count()), kBlock, 0, ctx.stream(), embedding_kernel<T>)(
        weight.data<T>(), idx.data<int64_t>(), n, vocab, cols, out.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::embedding_backward(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) {
  require_cuda(grad, "embedding_backward: gradient");
  require_cuda(idx, "embedding_backward: indices");
  require_cuda(grad_weight, "embedding_backward: weight's gradient");
  if (idx.dtype() != DType::i64) throw std::invalid_argument("embedding_backward: indices must be int64");
  const int64_t vocab = grad_weight.shape()[0], cols = grad_weight.shape()[1], n = idx.numel();
  if (n * cols == 0) return;
  Context& ctx = context();
  dispatch_float(grad.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    // The rows of the indices read, added to and written: at most min(n, vocab) distinct ones.
    const int64_t touched = std::min(n, vocab) * cols * static_cast<int64_t>(sizeof(T));
    declare_launch_cost(n * 8 + n * cols * static_cast<int64_t>(sizeof(T)) + touched, touched, n * cols);
    AMP_LAUNCH(grid_for(cols, ctx.sm_count()), kBlock, 0, ctx.stream(), embedding_backward_kernel<T>)(
        grad.data<T>(), idx.data<int64_t>(), n, vocab, cols, grad_weight.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                             Tensor& rstd) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &w, &b, &y, &mean, &rstd}) require_cuda(*t, "layer_norm: operand");
  const int64_t cols = x.shape().back(), rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return;
  Context& ctx = context();
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename DevElem<T>::Compute;
    declare_launch_cost((rows + 2) * cols * static_cast<int64_t>(sizeof(T)), rows * cols * static_cast<int64_t>(sizeof(T)) + 2 * rows * static_cast<int64_t>(sizeof(C)), 8 * rows * cols);
    AMP_LAUNCH(rows_grid(rows, "layer_norm"), row_threads(cols), 0, ctx.stream(), layer_norm_kernel<T>)(
        x.data<T>(), w.data<T>(), b.data<T>(), cols, eps, y.data<T>(), mean.data<C>(), rstd.data<C>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                      const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&g, &x, &w, &mean, &rstd, &gx, &gw, &gb})
    require_cuda(*t, "layer_norm_backward: operand");
  const int64_t cols = x.shape().back(), rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return;
  Context& ctx = context();
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename DevElem<T>::Compute;
    const int64_t gx_bytes = rows * cols * static_cast<int64_t>(sizeof(T)), stats = 2 * rows * static_cast<int64_t>(sizeof(C));
    declare_launch_cost(2 * gx_bytes + cols * static_cast<int64_t>(sizeof(T)) + stats, gx_bytes, 10 * rows * cols);
    AMP_LAUNCH(rows_grid(rows, "layer_norm_backward"), row_threads(cols), 0, ctx.stream(),
               layer_norm_backward_input_kernel<T>)(g.data<T>(), x.data<T>(), w.data<T>(), mean.data<C>(),
                                                    rstd.data<C>(), cols, gx.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
    declare_launch_cost(2 * gx_bytes + stats, 2 * cols * static_cast<int64_t>(sizeof(T)), 4 * rows * cols);
    AMP_LAUNCH(grid_for(cols, ctx.sm_count()), kBlock, 0, ctx.stream(), layer_norm_backward_params_kernel<T>)(
        g.data<T>(), x.data<T>(), mean.data<C>(), rstd.data<C>(), rows, cols, gw.data<T>(), gb.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) {
  require_cuda(x, "permute: input");
  require_cuda(out, "permute: output");
  const Permute index = math::permuted<kMaxPermuteDims>(x.shape(), perm);
  const int64_t total = x.numel();
  if (total == 0) return;
  Context& ctx = context();
  auto launch = [&](auto U_tag) { using U = decltype(U_tag);
    declare_launch_cost(total * static_cast<int64_t>(sizeof(U)), total * static_cast<int64_t>(sizeof(U)));
    AMP_LAUNCH(grid_for(total, ctx.sm_count()), kBlock, 0, ctx.stream(), permute_kernel<U>)(
        static_cast<const U*>(x.data_ptr()), total, index, static_cast<U*>(out.data_ptr()));
    AMP_CUDA_CHECK_LAUNCH();
  };
  switch (dtype_size(x.dtype())) {
    case 2: launch(uint16_t{}); break;
    case 4: launch(uint32_t{}); break;
    case 8: launch(uint64_t{}); break;
    default: throw std::invalid_argument("permute: unsupported element size");
  }
}

void CudaBackend::softmax_backward(const Tensor& y, const Tensor& g, Tensor& gx, bool log, double scale) {
  require_cuda(y, "softmax_backward: output");
  require_cuda(g, "softmax_backward: gradient");
  require_cuda(gx, "softmax_backward: input's gradient");
  const int64_t cols = y.dim() == 0 ? 1 : y.shape().back(), rows = cols == 0 ? 0 : y.numel() / cols;
  if (rows == 0) return;
  Context& ctx = context();
  dispatch_float(y.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(2 * y.numel() * static_cast<int64_t>(sizeof(T)), y.numel() * static_cast<int64_t>(sizeof(T)), 4 * y.numel());
    AMP_LAUNCH(rows_grid(rows, "softmax_backward"), row_threads(cols), 0, ctx.stream(), softmax_backward_kernel<T>)(
        y.data<T>(), g.data<T>(), gx.data<T>(), cols, log, scale);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::dropout_mask(Tensor& mask, uint64_t seed, uint64_t offset, double p) {
  require_cuda(mask, "dropout: mask");
  const int64_t n = mask.numel();
  if (n == 0) return;
  Context& ctx = context();
  dispatch_float(mask.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(0, n * static_cast<int64_t>(sizeof(T)), 10 * n);  // a counter-based draw an element
    AMP_LAUNCH(grid_for(n, ctx.sm_count()), kBlock, 0, ctx.stream(), dropout_mask_kernel<T>)(mask.data<T>(), n, seed,
                                                                                              offset, p);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace amp::cuda
