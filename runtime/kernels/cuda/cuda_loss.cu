// CUDA backend: the negative log-likelihood loss and its backward.
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
#include "runtime/kernels/strided_index.h"

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

}  // namespace amp::cuda
