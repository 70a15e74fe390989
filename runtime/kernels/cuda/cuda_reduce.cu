// CUDA backend: sum_to, broadcast_to's backward (the dims it keeps, the others summed). Sums
// accumulate in fp64 as on the CPU, in a fixed order: deterministic.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "runtime/kernels/cuda/block_reduce.cuh"
#include "runtime/kernels/cuda/broadcast_index.h"
#include "runtime/kernels/cuda/column_tile.cuh"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/strided_index.h"

namespace amp::cuda {

namespace {

// The dims of x that sum_to keeps and the ones it sums over, with x's element strides.
using MixedRadix = math::StridedIndex<kMaxDims>;

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

}  // namespace amp::cuda
