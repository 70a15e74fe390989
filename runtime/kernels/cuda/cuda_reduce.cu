// CUDA backend: sum_to, softmax over the last dim (plain, and attention's causal one), NLL loss and its backward. Sums accumulate in
// fp64 as on the CPU; every reduction combines in a fixed order, so results are deterministic.
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

// The dims of x that sum_to keeps and the ones it sums over, with x's element strides.
using MixedRadix = math::StridedIndex<kMaxDims>;

// --- kernels

template <class T>
__global__ void sum_all_partial_kernel(const T* x, int64_t n, double* partial) {
  double acc = 0.0;
  AMP_GRID_STRIDE(i, n) acc += static_cast<double>(DevElem<T>::load(x[i]));
  acc = block_reduce(acc, SumOp{});
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

template <class T>
__global__ void __launch_bounds__(1024) sum_partials_kernel(const double* partial, int count, T* out) {
  double acc = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += static_cast<int>(blockDim.x)) acc += partial[i];
  acc = block_reduce(acc, SumOp{});
  if (threadIdx.x == 0) out[0] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(acc));
}

// One thread per output: coalesced when the kept dims are the innermost (the bias gradient).
template <class T>
__global__ void sum_thread_per_output_kernel(const T* x, T* out, int64_t outputs, MixedRadix kept, MixedRadix red,
                                             int64_t reduced) {
  AMP_GRID_STRIDE(j, outputs) {
    const T* base = x + kept.offset(j);
    double acc = 0.0;
    for (int64_t r = 0; r < reduced; ++r) acc += static_cast<double>(DevElem<T>::load(base[red.offset(r)]));
    out[j] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(acc));
  }
}

// One block per output: for few outputs with long reductions.
template <class T>
__global__ void sum_block_per_output_kernel(const T* x, T* out, MixedRadix kept, MixedRadix red, int64_t reduced) {
  const int64_t j = blockIdx.x;
  const T* base = x + kept.offset(j);
  double acc = 0.0;
  for (int64_t r = threadIdx.x; r < reduced; r += blockDim.x)
    acc += static_cast<double>(DevElem<T>::load(base[red.offset(r)]));
  acc = block_reduce(acc, SumOp{});
  if (threadIdx.x == 0) out[j] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(acc));
}

// x viewed as [rows, cols] summed over its rows (the bias gradient: [N, M] -> [M]). Block (bx, by)
// owns 32 adjacent columns and the by-th run of rows_per_split rows; its 8 rows of 32 threads walk
// those rows 8 apart, so each warp reads 32 adjacent elements (coalesced) and nothing divides. With
// one split the block writes the column sums; with several (few columns, many rows: more blocks to
// fill the GPU) it writes its partial sums and sum_column_partials_kernel adds them. Every addition
// happens in a fixed order: deterministic.
constexpr int kColTile = 32, kRowLanes = 8;
template <class T>
__global__ void __launch_bounds__(kColTile * kRowLanes)
    sum_columns_kernel(const T* x, T* out, double* split_partials, int64_t rows, int64_t cols, int64_t rows_per_split) {
  AMP_SHARED(double[kRowLanes][kColTile], partial);
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + tx;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_split;
  const int64_t last = first + rows_per_split < rows ? first + rows_per_split : rows;
  double acc = 0.0;
  if (col < cols)
    for (int64_t r = first + ty; r < last; r += kRowLanes) acc += static_cast<double>(DevElem<T>::load(x[r * cols + col]));
  partial[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < cols) {
    double total = 0.0;
    for (int k = 0; k < kRowLanes; ++k) total += partial[k][tx];
    if (split_partials != nullptr) split_partials[static_cast<int64_t>(blockIdx.y) * cols + col] = total;
    else out[col] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(total));
  }
}

template <class T>
__global__ void sum_column_partials_kernel(const double* split_partials, int64_t splits, int64_t cols, T* out) {
  AMP_GRID_STRIDE(col, cols) {
    double total = 0.0;
    for (int64_t s = 0; s < splits; ++s) total += split_partials[s * cols + col];
    out[col] = DevElem<T>::store(static_cast<typename DevElem<T>::Compute>(total));
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

// --- launchers

template <class T>
void launch_sum_all(const Tensor& x, Tensor& out) {
  Context& ctx = context();
  const int64_t n = x.numel();
  const int blocks = static_cast<int>(std::min<int64_t>(std::max<int64_t>(1, (n + 4 * kBlock - 1) / (4 * kBlock)), 1024));
  Scratch partial(sizeof(double) * static_cast<size_t>(blocks));
  declare_launch_cost(n * static_cast<int64_t>(sizeof(T)), 8 * blocks, n);
  AMP_LAUNCH(blocks, kBlock, 0, ctx.stream(), sum_all_partial_kernel<T>)(x.data<T>(), n, partial.as<double>());
  AMP_CUDA_CHECK_LAUNCH();
  declare_launch_cost(8 * blocks, static_cast<int64_t>(sizeof(T)), blocks);
  AMP_LAUNCH(1, 1024, 0, ctx.stream(), sum_partials_kernel<T>)(partial.as<double>(), blocks, out.data<T>());
  AMP_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_sum_to(const Tensor& x, Tensor& out) {
  // out broadcasts back to x: dims where out has extent 1 and x does not are summed over.
  const BroadcastIndex ob = make_broadcast_index(out.shape(), x.shape());
  MixedRadix kept, red;
  int64_t stride = 1;
  int64_t x_strides[kMaxDims] = {};
  for (int d = ob.ndim - 1; d >= 0; --d) {
    x_strides[d] = stride;
    stride *= ob.out_shape[d];
  }
  for (int d = 0; d < ob.ndim; ++d) {
    const bool summed = ob.strides[d] == 0 && ob.out_shape[d] != 1;
    MixedRadix& m = summed ? red : kept;
    m.size[m.n] = ob.out_shape[d];
    m.stride[m.n] = x_strides[d];
    ++m.n;
  }
  int64_t reduced = 1;
  for (int d = 0; d < red.n; ++d) reduced *= red.size[d];
  const int64_t outputs = out.numel();
  Context& ctx = context();
  const int64_t x_bytes = x.numel() * static_cast<int64_t>(sizeof(T)), out_bytes = outputs * static_cast<int64_t>(sizeof(T));
  // The summed dims all lead and the kept ones all trail: x is [reduced, outputs].
  bool leading = true;
  for (int d = 0, seen_kept = 0; d < ob.ndim; ++d) {
    const bool summed = ob.strides[d] == 0 && ob.out_shape[d] != 1;
    if (summed && seen_kept) leading = false;
    seen_kept |= !summed && ob.out_shape[d] != 1;
  }
  if (leading) {
    // Enough blocks to fill the GPU a few times over; each split keeps at least 64 rows.
    const int64_t col_blocks = (outputs + kColTile - 1) / kColTile;
    const int64_t wanted = (4 * static_cast<int64_t>(ctx.sm_count()) + col_blocks - 1) / col_blocks;
    const int64_t splits = std::max<int64_t>(1, std::min<int64_t>({wanted, (reduced + 63) / 64, 65535}));
    const int64_t rows_per_split = (reduced + splits - 1) / splits;
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(splits));
    if (splits == 1) {
      declare_launch_cost(x_bytes, out_bytes, x.numel());
      AMP_LAUNCH(grid, dim3(kColTile, kRowLanes), 0, ctx.stream(), sum_columns_kernel<T>)(
          x.data<T>(), out.data<T>(), nullptr, reduced, outputs, rows_per_split);
    } else {
      Scratch partials(sizeof(double) * static_cast<size_t>(splits * outputs));
      declare_launch_cost(x_bytes, 8 * splits * outputs, x.numel());
      AMP_LAUNCH(grid, dim3(kColTile, kRowLanes), 0, ctx.stream(), sum_columns_kernel<T>)(
          x.data<T>(), out.data<T>(), partials.as<double>(), reduced, outputs, rows_per_split);
      AMP_CUDA_CHECK_LAUNCH();
      declare_launch_cost(8 * splits * outputs, out_bytes, splits * outputs);
      AMP_LAUNCH(grid_for(outputs, ctx.sm_count()), kBlock, 0, ctx.stream(), sum_column_partials_kernel<T>)(
          partials.as<double>(), splits, outputs, out.data<T>());
    }
  } else if (outputs <= 4096 && reduced >= 256) {
    declare_launch_cost(x_bytes, out_bytes, x.numel());
    AMP_LAUNCH(static_cast<unsigned>(outputs), kBlock, 0, ctx.stream(), sum_block_per_output_kernel<T>)(x.data<T>(), out.data<T>(),
                                                                                                kept, red, reduced);
  } else {
    declare_launch_cost(x_bytes, out_bytes, x.numel());
    AMP_LAUNCH(grid_for(outputs, ctx.sm_count()), kBlock, 0, ctx.stream(), sum_thread_per_output_kernel<T>)(
        x.data<T>(), out.data<T>(), outputs, kept, red, reduced);
  }
  AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void CudaBackend::sum_to(const Tensor& x, Tensor& out) {
  require_cuda(x, "sum_to: input");
  require_cuda(out, "sum_to: output");
  if (out.numel() == 0) return;
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    if (out.numel() == 1) {
      launch_sum_all<T>(x, out);
    } else if (out.numel() == x.numel()) {
      copy(out.data_ptr(), x.data_ptr(), x.nbytes());
    } else {
      launch_sum_to<T>(x, out);
    }
  });
}

namespace {
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
  // Narrow rows get a smaller block, so that most threads have work.
  const int threads = cols >= 256 ? 256 : (cols >= 64 ? 64 : 32);
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
  const int threads = cols >= 256 ? 256 : (cols >= 64 ? 64 : 32);  // launch_softmax's: the same sums
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
