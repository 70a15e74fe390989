// CUDA backend: layer norm and its backward. Row statistics are block reductions in double; the
// weight's and bias's gradients are column sums (fp32, a fixed order), in the backward's pass over
// the rows where they are at most 2048 wide, else in tiles.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/kernels/cuda/block_reduce.cuh"
#include "runtime/kernels/cuda/column_tile.cuh"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/row_blocks.cuh"
#include "runtime/kernels/strided_index.h"
#include "runtime/kernels/transformer_math.h"

namespace amp::cuda {

namespace {

// Row blockIdx.x of LayerNorm, its block's threads striding the row (thread t reads elements t,
// t + blockDim.x, ...), s the sum of the elements this thread reads. y in O: the row rounded to T,
// then cast to O (layer_norm_cast).
template <class T, class O>
__device__ void layer_norm_row(const T* xr, double s, const T* w, const T* b, int64_t cols, double eps, O* yr,
                               typename DevElem<T>::Compute* mean, typename DevElem<T>::Compute* rstd) {
  using C = typename DevElem<T>::Compute;
  const int64_t r = blockIdx.x;
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
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const T out = DevElem<T>::store(math::layer_norm_apply<C>(static_cast<C>(DevElem<T>::load(xr[c])), mu, rs,
                                                              static_cast<C>(DevElem<T>::load(w[c])),
                                                              static_cast<C>(DevElem<T>::load(b[c]))));
    if constexpr (std::is_same_v<O, T>) yr[c] = out;
    else yr[c] = DevElem<O>::store(static_cast<typename DevElem<O>::Compute>(DevElem<T>::load(out)));
  }
}

// One block per row.
template <class T, class O>
__global__ void layer_norm_kernel(const T* x, const T* w, const T* b, int64_t cols, double eps, O* y,
                                  typename DevElem<T>::Compute* mean, typename DevElem<T>::Compute* rstd) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  double s = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += static_cast<double>(DevElem<T>::load(xr[c]));
  layer_norm_row<T, O>(xr, s, w, b, cols, eps, y + r * cols, mean, rstd);
}

// One block per row: the residual add (sum = a + b, b read as its cast to T: add_cast's numbers),
// then LayerNorm of the sum, which each thread reads back where it wrote it.
template <class T, class B, class O>
__global__ void add_layer_norm_kernel(const T* a, const B* b, const T* w, const T* bias, int64_t cols, double eps,
                                      T* sum, O* y, typename DevElem<T>::Compute* mean,
                                      typename DevElem<T>::Compute* rstd) {
  const int64_t r = blockIdx.x;
  T* sr = sum + r * cols;
  double s = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const T v = DevElem<T>::store(DevElem<T>::load(a[r * cols + c]) + load_as<T>(b[r * cols + c]));
    sr[c] = v;
    s += static_cast<double>(DevElem<T>::load(v));
  }
  layer_norm_row<T, O>(sr, s, w, bias, cols, eps, y + r * cols, mean, rstd);
}

// Columns a thread keeps the weight's and the bias's sums for in layer_norm_backward_rows_kernel:
// rows up to kLnSlots x 256 = 2048 wide (GPT-2's 768 to 1600); wider rows take the tiled kernels.
constexpr int kLnSlots = 8;

// A 16-bit copy of the input gradient's final values, as cast writes it (or none: p null).
struct LowCopy {
  void* p = nullptr;
  bool bf16 = true;  // else fp16
  __device__ void put(int64_t i, float v) const {
    if (bf16) static_cast<BFloat16*>(p)[i] = DevElem<BFloat16>::store(v);
    else static_cast<Half*>(p)[i] = DevElem<Half>::store(v);
  }
};

// Row r of LayerNorm's backward, the block's threads striding it (thread t: columns t, t +
// blockDim.x, ...): the input's gradient (g in G, read as its cast to T); accumulate: added to gx as
// the binary add adds (rounded to T, then the sum in the compute type); low (float T only): its
// 16-bit copy too. With Sums, the thread's k-th column's g xhat and g are also added to sw[k] and
// sb[k] (the weight's and the bias's gradients).
template <class T, class G, bool Sums>
__device__ void layer_norm_backward_row(int64_t r, const G* g, const T* x, const T* w,
                                        const typename DevElem<T>::Compute* mean,
                                        const typename DevElem<T>::Compute* rstd, int64_t cols, T* gx, bool accumulate,
                                        LowCopy low, typename DevElem<T>::Compute* sw,
                                        typename DevElem<T>::Compute* sb) {
  using C = typename DevElem<T>::Compute;
  const C mu = mean[r], rs = rstd[r];
  double a = 0.0, bsum = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const C d = load_as<T>(g[r * cols + c]) * static_cast<C>(DevElem<T>::load(w[c]));
    const C xhat = (static_cast<C>(DevElem<T>::load(x[r * cols + c])) - mu) * rs;
    a += static_cast<double>(d);
    bsum += static_cast<double>(d) * static_cast<double>(xhat);
  }
  a = block_reduce(a, SumOp{});
  bsum = block_reduce(bsum, SumOp{});
  const C ma = static_cast<C>(a / static_cast<double>(cols));
  const C mb = static_cast<C>(bsum / static_cast<double>(cols));
  // Column c's gradient into gx; gv and xhat are what the weight's and the bias's sums add.
  const auto element = [&](int64_t c, C& gv, C& xhat) {
    gv = load_as<T>(g[r * cols + c]);
    xhat = (static_cast<C>(DevElem<T>::load(x[r * cols + c])) - mu) * rs;
    const T d = DevElem<T>::store(math::layer_norm_grad_input<C>(gv, static_cast<C>(DevElem<T>::load(w[c])), xhat, rs, ma, mb));
    const T v = accumulate ? DevElem<T>::store(static_cast<C>(DevElem<T>::load(gx[r * cols + c])) +
                                               static_cast<C>(DevElem<T>::load(d)))
                           : d;
    gx[r * cols + c] = v;
    if constexpr (std::is_same_v<T, float>) {
      if (low.p != nullptr) low.put(r * cols + c, v);
    }
  };
  C gv, xhat;
  if constexpr (Sums) {
    #pragma unroll
    for (int k = 0; k < kLnSlots; ++k) {  // unrolled: the sums stay in registers
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < cols) {
        element(c, gv, xhat);
        sw[k] += gv * xhat;
        sb[k] += gv;
      }
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) element(c, gv, xhat);
  }
}

// One block per row: the input's gradient (rows wider than the fused kernel takes).
template <class T, class G>
__global__ void layer_norm_backward_input_kernel(const G* g, const T* x, const T* w,
                                                 const typename DevElem<T>::Compute* mean,
                                                 const typename DevElem<T>::Compute* rstd, int64_t cols, T* gx,
                                                 bool accumulate) {
  layer_norm_backward_row<T, G, false>(blockIdx.x, g, x, w, mean, rstd, cols, gx, accumulate, LowCopy{}, nullptr,
                                       nullptr);
}

// LayerNorm's backward in one pass over g and x: block b takes rows [b rows_per_block, (b + 1)
// rows_per_block), each as layer_norm_backward_input_kernel does (the same numbers), and sums its
// columns' g xhat and g over them in row order, in the compute type; it writes them as its partials,
// [2][blocks][cols], which layer_norm_param_sums_kernel adds in a fixed order:
// deterministic run to run (the CPU adds in fp64 in row order: the two differ within the bound
// test_cuda states).
template <class T, class G>
__global__ void layer_norm_backward_rows_kernel(const G* __restrict__ g, const T* __restrict__ x,
                                                const T* __restrict__ w,
                                                const typename DevElem<T>::Compute* __restrict__ mean,
                                                const typename DevElem<T>::Compute* __restrict__ rstd, int64_t rows,
                                                int64_t cols, int64_t rows_per_block, T* gx, bool accumulate,
                                                LowCopy low, typename DevElem<T>::Compute* __restrict__ partials) {
  using C = typename DevElem<T>::Compute;
  C sw[kLnSlots], sb[kLnSlots];
  #pragma unroll
  for (int k = 0; k < kLnSlots; ++k) sw[k] = sb[k] = 0;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t last = first + rows_per_block < rows ? first + rows_per_block : rows;
  for (int64_t r = first; r < last; ++r)
    layer_norm_backward_row<T, G, true>(r, g, x, w, mean, rstd, cols, gx, accumulate, low, sw, sb);
  const int64_t blocks = gridDim.x;
  #pragma unroll
  for (int k = 0; k < kLnSlots; ++k) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (c < cols) {
      partials[static_cast<int64_t>(blockIdx.x) * cols + c] = sw[k];
      partials[(blocks + blockIdx.x) * cols + c] = sb[k];
    }
  }
}

// The weight's and the bias's gradients, column sums over the rows in tiles (the design of
// sum_to's sum_columns_kernel, cuda_reduce.cu): block (bx, by) owns 32 adjacent columns and the
// by-th run of rows_per_split rows, its 8 rows of 32 threads walking those rows 8 apart (each warp
// reads 32 adjacent elements, coalesced), accumulating in the compute type (fp32; fp64 for f64).
// With one split the block writes gw and gb; with several it writes its partial sums, [2][splits]
// [cols], and layer_norm_param_sums_kernel adds them. Every addition happens in a
// fixed order: deterministic run to run (not the CPU's fp64 row order: the two differ within the
// bound test_cuda states).
template <class T, class G>
__global__ void __launch_bounds__(kColTile * kRowLanes)
    layer_norm_param_partials_kernel(const G* __restrict__ g, const T* __restrict__ x,
                                     const typename DevElem<T>::Compute* __restrict__ mean,
                                     const typename DevElem<T>::Compute* __restrict__ rstd, int64_t rows, int64_t cols,
                                     int64_t rows_per_split, T* __restrict__ gw, T* __restrict__ gb,
                                     typename DevElem<T>::Compute* __restrict__ partials) {
  using C = typename DevElem<T>::Compute;
  AMP_SHARED(C[2][kRowLanes][kColTile], part);
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + tx;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_split;
  const int64_t last = first + rows_per_split < rows ? first + rows_per_split : rows;
  C sw = 0, sb = 0;
  if (col < cols)
    for (int64_t r = first + ty; r < last; r += kRowLanes) {
      const C gv = load_as<T>(g[r * cols + col]);
      sw += gv * ((static_cast<C>(DevElem<T>::load(x[r * cols + col])) - mean[r]) * rstd[r]);
      sb += gv;
    }
  part[0][ty][tx] = sw;
  part[1][ty][tx] = sb;
  __syncthreads();
  if (ty == 0 && col < cols) {
    C tw = 0, tb = 0;
    for (int k = 0; k < kRowLanes; ++k) {
      tw += part[0][k][tx];
      tb += part[1][k][tx];
    }
    if (partials != nullptr) {
      const int64_t splits = gridDim.y;
      partials[static_cast<int64_t>(blockIdx.y) * cols + col] = tw;
      partials[(splits + blockIdx.y) * cols + col] = tb;
    } else {
      gw[col] = DevElem<T>::store(tw);
      gb[col] = DevElem<T>::store(tb);
    }
  }
}

// The partial sums' totals, [2][splits][cols] to gw and gb: block bx owns kColTile adjacent
// columns, its kRowLanes lanes each adding every kRowLanes-th split (coalesced rows of 32), then the
// lanes added in order. A fixed order: deterministic run to run.
template <class T>
__global__ void __launch_bounds__(kColTile * kRowLanes)
    layer_norm_param_sums_kernel(const typename DevElem<T>::Compute* __restrict__ partials, int64_t splits,
                                 int64_t cols, T* __restrict__ gw, T* __restrict__ gb) {
  using C = typename DevElem<T>::Compute;
  AMP_SHARED(C[2][kRowLanes][kColTile], part);
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + tx;
  C tw = 0, tb = 0;
  if (col < cols)
    for (int64_t s = ty; s < splits; s += kRowLanes) {
      tw += partials[s * cols + col];
      tb += partials[(splits + s) * cols + col];
    }
  part[0][ty][tx] = tw;
  part[1][ty][tx] = tb;
  __syncthreads();
  if (ty == 0 && col < cols) {
    tw = 0;
    tb = 0;
    for (int k = 0; k < kRowLanes; ++k) {
      tw += part[0][k][tx];
      tb += part[1][k][tx];
    }
    gw[col] = DevElem<T>::store(tw);
    gb[col] = DevElem<T>::store(tb);
  }
}

}  // namespace

namespace {

template <class T, class O>
void launch_layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                       Tensor& rstd) {
  using C = typename DevElem<T>::Compute;
  const int64_t cols = x.shape().back(), rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return;
  Context& ctx = context();
  declare_launch_cost((rows + 2) * cols * static_cast<int64_t>(sizeof(T)),
                      rows * cols * static_cast<int64_t>(sizeof(O)) + 2 * rows * static_cast<int64_t>(sizeof(C)), 8 * rows * cols);
  AMP_LAUNCH(rows_grid(rows, "layer_norm"), row_threads(cols), 0, ctx.stream(), layer_norm_kernel<T, O>)(
      x.data<T>(), w.data<T>(), b.data<T>(), cols, eps, y.data<O>(), mean.data<C>(), rstd.data<C>());
  AMP_CUDA_CHECK_LAUNCH();
}

template <class T, class B, class O>
void launch_add_layer_norm(const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias, double eps,
                           Tensor& sum, Tensor& y, Tensor& mean, Tensor& rstd) {
  using C = typename DevElem<T>::Compute;
  const int64_t cols = a.shape().back(), rows = cols == 0 ? 0 : a.numel() / cols;
  if (rows == 0) return;
  Context& ctx = context();
  const int64_t n = rows * cols;
  declare_launch_cost((n + 2 * cols) * static_cast<int64_t>(sizeof(T)) + n * static_cast<int64_t>(sizeof(B)),
                      n * static_cast<int64_t>(sizeof(T) + sizeof(O)) + 2 * rows * static_cast<int64_t>(sizeof(C)), 9 * n);
  AMP_LAUNCH(rows_grid(rows, "add_layer_norm"), row_threads(cols), 0, ctx.stream(), add_layer_norm_kernel<T, B, O>)(
      a.data<T>(), b.data<B>(), w.data<T>(), bias.data<T>(), cols, eps, sum.data<T>(), y.data<O>(), mean.data<C>(),
      rstd.data<C>());
  AMP_CUDA_CHECK_LAUNCH();
}

// Returns whether it wrote gx_low too (the one pass, float x, a 16-bit gx_low); else the caller casts.
template <class T, class G>
bool launch_layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate,
                                const Tensor& gx_low) {
  using C = typename DevElem<T>::Compute;
  const int64_t cols = x.shape().back(), rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return true;
  Context& ctx = context();
  const int64_t gx_bytes = rows * cols * static_cast<int64_t>(sizeof(T)), stats = 2 * rows * static_cast<int64_t>(sizeof(C));
  const int64_t g_bytes = rows * cols * static_cast<int64_t>(sizeof(G));
  const int64_t param_bytes = 2 * cols * static_cast<int64_t>(sizeof(T));
  const int threads = row_threads(cols);
  const int64_t col_tiles = (cols + kColTile - 1) / kColTile;
  if (col_tiles > 0x7fffffff) throw std::invalid_argument("layer_norm_backward: more than 2^36 columns");
  const dim3 sums_grid(static_cast<unsigned>(col_tiles)), sums_block(kColTile, kRowLanes);
  if (cols <= static_cast<int64_t>(kLnSlots) * threads) {
    // One pass (layer_norm_backward_rows_kernel): 2 blocks an SM, then the partials' sums.
    LowCopy low;
    const bool low_here = std::is_same_v<T, float> && gx_low.defined() &&
                          (gx_low.dtype() == DType::bf16 || gx_low.dtype() == DType::f16);
    if (low_here) low = LowCopy{gx_low.data_ptr(), gx_low.dtype() == DType::bf16};
    const int64_t low_bytes = low_here ? rows * cols * static_cast<int64_t>(dtype_size(gx_low.dtype())) : 0;
    const int64_t blocks = std::min<int64_t>(rows, 2 * static_cast<int64_t>(ctx.sm_count()));
    const int64_t rows_per_block = (rows + blocks - 1) / blocks;
    const int64_t used = (rows + rows_per_block - 1) / rows_per_block;  // no block without rows
    const int64_t partial_bytes = 2 * used * cols * static_cast<int64_t>(sizeof(C));
    Scratch partials(static_cast<size_t>(partial_bytes));
    declare_launch_cost(g_bytes + (accumulate ? 2 : 1) * gx_bytes + cols * static_cast<int64_t>(sizeof(T)) + stats,
                        gx_bytes + low_bytes + partial_bytes, (accumulate ? 15 : 14) * rows * cols);
    AMP_LAUNCH(static_cast<unsigned>(used), threads, 0, ctx.stream(), layer_norm_backward_rows_kernel<T, G>)(
        g.data<G>(), x.data<T>(), w.data<T>(), mean.data<C>(), rstd.data<C>(), rows, cols, rows_per_block, gx.data<T>(),
        accumulate, low, partials.as<C>());
    AMP_CUDA_CHECK_LAUNCH();
    declare_launch_cost(partial_bytes, param_bytes, 2 * used * cols);
    AMP_LAUNCH(sums_grid, sums_block, 0, ctx.stream(), layer_norm_param_sums_kernel<T>)(
        partials.as<C>(), used, cols, gw.data<T>(), gb.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
    return low_here;
  }
  // Wider rows: the input's gradient a row a block, then the weight's and bias's in column tiles.
  // x and g read, and gx too when the gradient is added to it.
  declare_launch_cost(g_bytes + (accumulate ? 2 : 1) * gx_bytes + cols * static_cast<int64_t>(sizeof(T)) + stats,
                      gx_bytes, (accumulate ? 11 : 10) * rows * cols);
  AMP_LAUNCH(rows_grid(rows, "layer_norm_backward"), row_threads(cols), 0, ctx.stream(),
             layer_norm_backward_input_kernel<T, G>)(g.data<G>(), x.data<T>(), w.data<T>(), mean.data<C>(),
                                                     rstd.data<C>(), cols, gx.data<T>(), accumulate);
  AMP_CUDA_CHECK_LAUNCH();
  // Enough blocks to fill the GPU 4 times over (at least one per SM), each split at least 64 rows.
  const int64_t wanted = (4 * static_cast<int64_t>(ctx.sm_count()) + col_tiles - 1) / col_tiles;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>({wanted, (rows + 63) / 64, 65535}));
  const int64_t rows_per_split = (rows + splits - 1) / splits;
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(splits)), block(kColTile, kRowLanes);
  if (splits == 1) {
    declare_launch_cost(g_bytes + gx_bytes + stats, param_bytes, 4 * rows * cols);
    AMP_LAUNCH(grid, block, 0, ctx.stream(), layer_norm_param_partials_kernel<T, G>)(
        g.data<G>(), x.data<T>(), mean.data<C>(), rstd.data<C>(), rows, cols, rows_per_split, gw.data<T>(),
        gb.data<T>(), nullptr);
    AMP_CUDA_CHECK_LAUNCH();
  } else {
    const int64_t partial_bytes = 2 * splits * cols * static_cast<int64_t>(sizeof(C));
    Scratch partials(static_cast<size_t>(partial_bytes));
    declare_launch_cost(g_bytes + gx_bytes + stats, partial_bytes, 4 * rows * cols);
    AMP_LAUNCH(grid, block, 0, ctx.stream(), layer_norm_param_partials_kernel<T, G>)(
        g.data<G>(), x.data<T>(), mean.data<C>(), rstd.data<C>(), rows, cols, rows_per_split, gw.data<T>(),
        gb.data<T>(), partials.as<C>());
    AMP_CUDA_CHECK_LAUNCH();
    declare_launch_cost(partial_bytes, param_bytes, 2 * splits * cols);
    AMP_LAUNCH(sums_grid, sums_block, 0, ctx.stream(), layer_norm_param_sums_kernel<T>)(
        partials.as<C>(), splits, cols, gw.data<T>(), gb.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  }
  return false;
}

void require_layer_norm_operands(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts) require_cuda(*t, op);
}

}  // namespace

void CudaBackend::layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                             Tensor& rstd) {
  require_layer_norm_operands({&x, &w, &b, &y, &mean, &rstd}, "layer_norm: operand");
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    launch_layer_norm<T, T>(x, w, b, eps, y, mean, rstd);
  });
}

// One pass: each element rounded to x's dtype, then cast to y's (the numbers of layer_norm, then cast).
void CudaBackend::layer_norm_cast(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y,
                                  Tensor& mean, Tensor& rstd) {
  require_layer_norm_operands({&x, &w, &b, &y, &mean, &rstd}, "layer_norm_cast: operand");
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    dispatch_float(y.dtype(), [&](auto O_tag) { launch_layer_norm<T, decltype(O_tag)>(x, w, b, eps, y, mean, rstd); });
  });
}

void CudaBackend::layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                      const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate) {
  require_layer_norm_operands({&g, &x, &w, &mean, &rstd, &gx, &gw, &gb}, "layer_norm_backward: operand");
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    (void)launch_layer_norm_backward<T, T>(g, x, w, mean, rstd, gx, gw, gb, accumulate, Tensor());
  });
}

// One pass where the residual stream is fp32 or fp64 (the GPT's), else the default's two.
void CudaBackend::add_layer_norm_cast(const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias, double eps,
                                      Tensor& sum, Tensor& y, Tensor& mean, Tensor& rstd) {
  require_layer_norm_operands({&a, &b, &w, &bias, &sum, &y, &mean, &rstd}, "add_layer_norm_cast: operand");
  if (b.shape() != a.shape() || sum.shape() != a.shape() || y.shape() != a.shape() || sum.dtype() != a.dtype() ||
      result_type(a.dtype(), false, b.dtype(), false) != a.dtype())
    throw std::invalid_argument("add_layer_norm_cast: expected a, b, sum and y of one shape, sum in a's dtype, and b "
                                "no wider than a");
  if (a.dtype() != DType::f32 && a.dtype() != DType::f64) {
    Backend::add_layer_norm_cast(a, b, w, bias, eps, sum, y, mean, rstd);
    return;
  }
  dispatch_float(a.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      dispatch_float(b.dtype(), [&](auto B_tag) {
        dispatch_float(y.dtype(), [&](auto O_tag) {
          launch_add_layer_norm<T, decltype(B_tag), decltype(O_tag)>(a, b, w, bias, eps, sum, y, mean, rstd);
        });
      });
    }
  });
}

// The gradient read in its own dtype, as its cast to x's (the numbers of cast, then the backward).
// gx_low in the same pass where it is one (layer_norm_backward_rows_kernel, float x), else cast after.
void CudaBackend::layer_norm_backward_cast(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                           const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate,
                                           const Tensor& gx_low) {
  require_layer_norm_operands({&g, &x, &w, &mean, &rstd, &gx, &gw, &gb}, "layer_norm_backward_cast: operand");
  if (gx_low.defined()) {
    require_cuda(gx_low, "layer_norm_backward_cast: gx_low");
    if (gx_low.shape() != gx.shape())
      throw std::invalid_argument("layer_norm_backward_cast: gx_low " + shape_str(gx_low.shape()) + " is not gx's " +
                                  shape_str(gx.shape()));
  }
  bool low_written = false;
  dispatch_float(x.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
    dispatch_float(g.dtype(), [&](auto G_tag) {
      low_written = launch_layer_norm_backward<T, decltype(G_tag)>(g, x, w, mean, rstd, gx, gw, gb, accumulate, gx_low);
    });
  });
  if (gx_low.defined() && !low_written) {
    Tensor low = gx_low;
    cast(gx, low);
  }
}

}  // namespace amp::cuda
