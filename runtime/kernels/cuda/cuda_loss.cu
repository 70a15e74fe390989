// CUDA backend: the negative log-likelihood loss and its backward, and the classifier's fused
// cross-entropy (softmax, loss and the logits' gradient without a copy of the logits in fp32).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

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

template <class T>
__global__ void __launch_bounds__(1024) nll_loss_kernel(const T* logp, const int64_t* target, int64_t rows, int64_t cols, T* loss) {
  double acc = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const int64_t t = target[r];
    acc += (t < 0 || t >= cols) ? NAN : static_cast<double>(DevElem<T>::load(logp[r * cols + t]));
  }
  acc = block_reduce(acc, SumOp{});
  if (threadIdx.x == 0)
    loss[0] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(-acc / static_cast<double>(rows)));
}

template <class T>
__global__ void nll_loss_backward_kernel(const T* grad, const int64_t* target, int64_t rows, int64_t cols, T* out) {
  using C = typename DevElem<T>::Compute;
  const C g = static_cast<C>(DevElem<T>::load(grad[0]));
  AMP_GRID_STRIDE(r, rows) {
    const int64_t t = target[r];
    if (t >= 0 && t < cols) out[r * cols + t] = DevElem<T>::store(-g / static_cast<C>(rows));
  }
}

// One block per row, one read of its first `classes` logits: each thread keeps a running maximum m
// and the sum s of e^(x - m) over its columns, rescaling s when m grows (the online softmax); then
// the block's maximum, and the threads' sums rescaled to it, summed in fp64.
template <class T>
__global__ void cross_entropy_rows_kernel(const T* __restrict__ x, int64_t cols, int64_t classes,
                                          typename DevElem<T>::Compute* __restrict__ lse) {
  using C = typename DevElem<T>::Compute;
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
  C m = -INFINITY;
  double s = 0.0;
  for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) {
    const C v = static_cast<C>(DevElem<T>::load(xr[c]));
    if (v > m) {
      s = s * static_cast<double>(std::exp(m - v)) + 1.0;
      m = v;
    } else {
      s += static_cast<double>(std::exp(v - m));
    }
  }
  const C mx = block_reduce(m, MaxOp{});
  const double total = block_reduce(m == -INFINITY ? 0.0 : s * static_cast<double>(std::exp(m - mx)), SumOp{});
  if (threadIdx.x == 0) lse[blockIdx.x] = mx + static_cast<C>(std::log(total));
}

// The mean over rows of lse[r] - x[r, t_r], in fp64 in a fixed order (one block).
template <class T>
__global__ void __launch_bounds__(1024) cross_entropy_loss_kernel(const T* x, const int64_t* target,
                                                                  const typename DevElem<T>::Compute* lse, int64_t rows,
                                                                  int64_t cols, int64_t classes,
                                                                  typename DevElem<T>::Compute* loss) {
  using C = typename DevElem<T>::Compute;
  double acc = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const int64_t t = target[r];
    acc += (t < 0 || t >= classes) ? NAN
                                   : static_cast<double>(lse[r]) - static_cast<double>(DevElem<T>::load(x[r * cols + t]));
  }
  acc = block_reduce(acc, SumOp{});
  if (threadIdx.x == 0) loss[0] = static_cast<C>(acc / static_cast<double>(rows));
}

// One block per row: the logits' gradient, written in their dtype, 0 past `classes`; gx may be x
// (each thread reads an element before it writes it, and no other thread reads it).
template <class T>
__global__ void cross_entropy_backward_kernel(const T* x, const int64_t* __restrict__ target,
                                              const typename DevElem<T>::Compute* __restrict__ lse,
                                              const typename DevElem<T>::Compute* __restrict__ grad, int64_t rows,
                                              int64_t cols, int64_t classes, T* gx) {
  using C = typename DevElem<T>::Compute;
  const int64_t r = blockIdx.x;
  const C scale = grad[0] / static_cast<C>(rows), l = lse[r];
  const int64_t t = target[r];
  const T* xr = x + r * cols;
  T* o = gx + r * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    o[c] = DevElem<T>::store(
        c < classes ? math::cross_entropy_grad<C>(static_cast<C>(DevElem<T>::load(xr[c])), l, scale, c == t) : C(0));
}

}  // namespace

void CudaBackend::nll_loss(const Tensor& logp, const Tensor& target, Tensor& loss) {
  require_cuda(logp, "nll_loss: log-probabilities");
  require_cuda(target, "nll_loss: target");
  require_cuda(loss, "nll_loss: loss");
  if (target.dtype() != DType::i64) throw std::invalid_argument("nll_loss: target must be int64");
  const int64_t rows = logp.shape()[0], cols = logp.shape()[1];
  Context& ctx = context();
  dispatch_float(logp.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(rows * (8 + static_cast<int64_t>(sizeof(T))), static_cast<int64_t>(sizeof(T)), rows);
    AMP_LAUNCH(1, 1024, 0, ctx.stream(), nll_loss_kernel<T>)(logp.data<T>(), target.data<int64_t>(), rows, cols, loss.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::nll_loss_backward(const Tensor& grad, const Tensor& target, Tensor& grad_logp) {
  require_cuda(grad, "nll_loss_backward: grad");
  require_cuda(target, "nll_loss_backward: target");
  require_cuda(grad_logp, "nll_loss_backward: output");
  const int64_t rows = grad_logp.shape()[0], cols = grad_logp.shape()[1];
  Context& ctx = context();
  // All-zero bits are +0.0 in every float dtype.
  AMP_CUDA_CHECK(cudaMemsetAsync(grad_logp.data_ptr(), 0, grad_logp.nbytes(), ctx.stream()));
  if (rows == 0) return;
  dispatch_float(grad_logp.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    declare_launch_cost(static_cast<int64_t>(sizeof(T)) + rows * 8, rows * static_cast<int64_t>(sizeof(T)), rows);
    AMP_LAUNCH(grid_for(rows, ctx.sm_count()), kBlock, 0, ctx.stream(), nll_loss_backward_kernel<T>)(
        grad.data<T>(), target.data<int64_t>(), rows, cols, grad_logp.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::cross_entropy(const Tensor& logits, const Tensor& target, int64_t classes, Tensor& lse, Tensor& loss) {
  require_cuda(logits, "cross_entropy: logits");
  require_cuda(target, "cross_entropy: target");
  require_cuda(lse, "cross_entropy: lse");
  require_cuda(loss, "cross_entropy: loss");
  const int64_t rows = logits.shape()[0], cols = logits.shape()[1];
  Context& ctx = context();
  dispatch_float(logits.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename DevElem<T>::Compute;
    const auto tb = static_cast<int64_t>(sizeof(T)), cb = static_cast<int64_t>(sizeof(C));
    if (rows > 0) {
      declare_launch_cost(rows * classes * tb, rows * cb, 4 * rows * classes);
      AMP_LAUNCH(rows_grid(rows, "cross_entropy"), row_threads(classes), 0, ctx.stream(), cross_entropy_rows_kernel<T>)(
          logits.data<T>(), cols, classes, lse.data<C>());
      AMP_CUDA_CHECK_LAUNCH();
    }
    declare_launch_cost(rows * (8 + cb + tb), cb, 2 * rows);
    AMP_LAUNCH(1, 1024, 0, ctx.stream(), cross_entropy_loss_kernel<T>)(logits.data<T>(), target.data<int64_t>(),
                                                                       lse.data<C>(), rows, cols, classes, loss.data<C>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                         const Tensor& grad, int64_t classes, Tensor& gx) {
  require_cuda(logits, "cross_entropy_backward: logits");
  require_cuda(target, "cross_entropy_backward: target");
  require_cuda(lse, "cross_entropy_backward: lse");
  require_cuda(grad, "cross_entropy_backward: grad");
  require_cuda(gx, "cross_entropy_backward: output");
  const int64_t rows = logits.shape()[0], cols = logits.shape()[1];
  if (rows == 0) return;
  Context& ctx = context();
  dispatch_float(logits.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    using C = typename DevElem<T>::Compute;
    const auto tb = static_cast<int64_t>(sizeof(T)), cb = static_cast<int64_t>(sizeof(C));
    declare_launch_cost(rows * (classes * tb + 8 + cb), rows * cols * tb, 4 * rows * classes);
    AMP_LAUNCH(rows_grid(rows, "cross_entropy_backward"), row_threads(cols), 0, ctx.stream(),
               cross_entropy_backward_kernel<T>)(logits.data<T>(), target.data<int64_t>(), lse.data<C>(),
                                                 grad.data<C>(), rows, cols, classes, gx.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace amp::cuda
