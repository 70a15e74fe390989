// CUDA backend: the transformer primitives (embedding, layer norm, permute, softmax's backward,
// dropout's mask; attention's causal softmax is softmax_kernel's, in cuda_reduce.cu). The
// per-element math is runtime/kernels/transformer_math.h, shared with the CPU backend; row statistics are
// block reductions in double; LayerNorm's gw and gb are column sums in tiles (fp32, a fixed order),
// the embedding's gradient adds up in the CPU's row order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
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

// One thread per column, rows in order: deterministic, and the CPU's order of addition. For more
// than kSortedEmbeddingMax indices; fewer take the sorted runs below (a grid of the GPU's size).
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

// The weight's and the bias's gradients, column sums over the rows in tiles (the design of
// sum_to's sum_columns_kernel, cuda_reduce.cu): block (bx, by) owns 32 adjacent columns and the
// by-th run of rows_per_split rows, its 8 rows of 32 threads walking those rows 8 apart (each warp
// reads 32 adjacent elements, coalesced), accumulating in the compute type (fp32; fp64 for f64).
// With one split the block writes gw and gb; with several it writes its partial sums, [2][splits]
// [cols], and layer_norm_param_sums_kernel adds them in split order. Every addition happens in a
// fixed order: deterministic run to run (not the CPU's fp64 row order: the two differ within the
// bound test_cuda states).
constexpr int kColTile = 32, kRowLanes = 8;
template <class T>
__global__ void __launch_bounds__(kColTile * kRowLanes)
    layer_norm_param_partials_kernel(const T* __restrict__ g, const T* __restrict__ x,
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
      const C gv = static_cast<C>(DevElem<T>::load(g[r * cols + col]));
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

template <class T>
__global__ void layer_norm_param_sums_kernel(const typename DevElem<T>::Compute* __restrict__ partials, int64_t splits,
                                             int64_t cols, T* __restrict__ gw, T* __restrict__ gb) {
  using C = typename DevElem<T>::Compute;
  AMP_GRID_STRIDE(col, cols) {
    C tw = 0, tb = 0;
    for (int64_t s = 0; s < splits; ++s) {
      tw += partials[s * cols + col];
      tb += partials[(splits + s) * cols + col];
    }
    gw[col] = DevElem<T>::store(tw);
    gb[col] = DevElem<T>::store(tb);
  }
}

// Above this many indices the embedding's gradient takes the row-order kernel above: the sort below
// compares every pair (2^32 comparisons at the limit, about a millisecond on an H100).
constexpr int64_t kSortedEmbeddingMax = int64_t{1} << 16;

// The sort key of an index: itself, or vocab for one out of range (sorted last, and skipped).
AMP_HD int64_t embedding_key(int64_t v, int64_t vocab) { return v >= 0 && v < vocab ? v : vocab; }

// The positions 0..n-1 sorted by (index, position), stable: each thread counts the positions that
// come before its own, over tiles of the indices staged in shared memory. order[rank] = position.
constexpr int kOrderTile = 256;
__global__ void __launch_bounds__(kOrderTile)
    embedding_order_kernel(const int64_t* __restrict__ idx, int64_t n, int64_t vocab, int32_t* __restrict__ order) {
  AMP_SHARED(int64_t[kOrderTile], keys);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kOrderTile + threadIdx.x;
  const int64_t mine = i < n ? embedding_key(idx[i], vocab) : 0;
  int64_t rank = 0;
  for (int64_t base = 0; base < n; base += kOrderTile) {
    const int64_t j = base + threadIdx.x;
    keys[threadIdx.x] = j < n ? embedding_key(idx[j], vocab) : 0;
    __syncthreads();
    const int count = static_cast<int>(n - base < kOrderTile ? n - base : kOrderTile);
    for (int k = 0; k < count; ++k) rank += keys[k] < mine || (keys[k] == mine && base + k < i) ? 1 : 0;
    __syncthreads();
  }
  if (i < n) order[rank] = static_cast<int32_t>(i);
}

// The gradient rows summed over the sorted positions: warp (threadIdx.y) of block (bx, by) owns 32
// adjacent columns and chunk by * kRunWarps + threadIdx.y of `chunk` sorted positions, in which the
// positions of one index form runs. A run that starts and ends in the chunk is added to its row of
// gw; the chunk's first run, when it began in an earlier chunk, goes to head[chunk][col], its last,
// when it goes on past the chunk, to tail[chunk][col], for embedding_join_kernel. Each run adds up
// in position order, in the compute type: deterministic.
constexpr int kRunWarps = 4;
template <class T>
__global__ void __launch_bounds__(kColTile * kRunWarps)
    embedding_runs_kernel(const T* __restrict__ g, const int64_t* __restrict__ idx, const int32_t* __restrict__ order,
                          int64_t n, int64_t vocab, int64_t cols, int64_t chunk, int64_t chunks, T* __restrict__ gw,
                          typename DevElem<T>::Compute* __restrict__ head, typename DevElem<T>::Compute* __restrict__ tail) {
  using C = typename DevElem<T>::Compute;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t k = static_cast<int64_t>(blockIdx.y) * kRunWarps + threadIdx.y;
  if (col >= cols || k >= chunks) return;  // no barrier follows
  const int64_t p0 = k * chunk, p1 = p0 + chunk < n ? p0 + chunk : n;
  for (int64_t s = p0; s < p1;) {
    const int64_t v = embedding_key(idx[order[s]], vocab);
    if (v == vocab) break;  // out of range: sorted last, added nowhere
    C acc = 0;
    int64_t e = s;
    for (; e < p1; ++e) {
      const int64_t t = order[e];
      if (embedding_key(idx[t], vocab) != v) break;
      acc += static_cast<C>(DevElem<T>::load(g[t * cols + col]));
    }
    if (s == p0 && p0 > 0 && embedding_key(idx[order[p0 - 1]], vocab) == v) {
      head[k * cols + col] = acc;
    } else if (e == p1 && p1 < n && embedding_key(idx[order[p1]], vocab) == v) {
      tail[k * cols + col] = acc;
    } else {
      T& dst = gw[v * cols + col];
      dst = DevElem<T>::store(static_cast<C>(DevElem<T>::load(dst)) + acc);
    }
    s = e;
  }
}

// The runs that cross chunks: the chunk where one starts (its tail) adds the heads of the chunks it
// goes on into, in chunk order, and adds the total to its row.
template <class T>
__global__ void embedding_join_kernel(const int64_t* __restrict__ idx, const int32_t* __restrict__ order, int64_t n,
                                      int64_t vocab, int64_t cols, int64_t chunk, int64_t chunks, T* __restrict__ gw,
                                      const typename DevElem<T>::Compute* __restrict__ head,
                                      const typename DevElem<T>::Compute* __restrict__ tail) {
  using C = typename DevElem<T>::Compute;
  const auto key_at = [&](int64_t p) { return embedding_key(idx[order[p]], vocab); };
  AMP_GRID_STRIDE(i, chunks * cols) {
    const int64_t k = i / cols, col = i - k * cols;
    const int64_t p0 = k * chunk, p1 = p0 + chunk < n ? p0 + chunk : n;
    const int64_t v = key_at(p1 - 1);
    if (v == vocab || p1 >= n || key_at(p1) != v) continue;           // the last run ends here
    if (p0 > 0 && key_at(p0) == v && key_at(p0 - 1) == v) continue;   // it began in an earlier chunk
    C total = tail[k * cols + col];
    for (int64_t j = k + 1; j < chunks; ++j) {
      total += head[j * cols + col];
      const int64_t q1 = (j + 1) * chunk < n ? (j + 1) * chunk : n;
      if (q1 >= n || key_at(q1 - 1) != v || key_at(q1) != v) break;
    }
    T& dst = gw[v * cols + col];
    dst = DevElem<T>::store(static_cast<C>(DevElem<T>::load(dst)) + total);
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
    using C = typename DevElem<T>::Compute;
    // The rows of the indices read, added to and written: at most min(n, vocab) distinct ones.
    const int64_t touched = std::min(n, vocab) * cols * static_cast<int64_t>(sizeof(T));
    if (n > kSortedEmbeddingMax) {
      declare_launch_cost(n * 8 + n * cols * static_cast<int64_t>(sizeof(T)) + touched, touched, n * cols);
      AMP_LAUNCH(grid_for(cols, ctx.sm_count()), kBlock, 0, ctx.stream(), embedding_backward_kernel<T>)(
          grad.data<T>(), idx.data<int64_t>(), n, vocab, cols, grad_weight.data<T>());
      AMP_CUDA_CHECK_LAUNCH();
      return;
    }
    // Chunks of sorted positions so that column tiles x chunks fill the GPU 4 times over.
    const int64_t col_tiles = (cols + kColTile - 1) / kColTile;
    const int64_t wanted = (4 * kRunWarps * static_cast<int64_t>(ctx.sm_count()) + col_tiles - 1) / col_tiles;
    const int64_t chunk = std::max<int64_t>(8, (n + wanted - 1) / wanted), chunks = (n + chunk - 1) / chunk;
    if (col_tiles > 0x7fffffff) throw std::invalid_argument("embedding_backward: more than 2^36 columns");
    Scratch order(sizeof(int32_t) * static_cast<size_t>(n));
    Scratch runs(2 * sizeof(C) * static_cast<size_t>(chunks * cols));
    C* head = runs.as<C>();
    C* tail = head + chunks * cols;
    declare_launch_cost(n * 8, n * 4, 2 * n * n);
    AMP_LAUNCH(static_cast<unsigned>((n + kOrderTile - 1) / kOrderTile), kOrderTile, 0, ctx.stream(),
               embedding_order_kernel)(idx.data<int64_t>(), n, vocab, order.as<int32_t>());
    AMP_CUDA_CHECK_LAUNCH();
    // Each sorted position's index and gradient row once (the column tiles' re-reads of the order
    // and the indices hit the cache), and the rows of gw; the runs that cross chunks (at most two
    // partial sums a chunk and column) are the join's.
    declare_launch_cost(n * 12 + n * cols * static_cast<int64_t>(sizeof(T)) + touched, touched, n * cols);
    AMP_LAUNCH(dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>((chunks + kRunWarps - 1) / kRunWarps)),
               dim3(kColTile, kRunWarps), 0, ctx.stream(), embedding_runs_kernel<T>)(
        grad.data<T>(), idx.data<int64_t>(), order.as<int32_t>(), n, vocab, cols, chunk, chunks,
        grad_weight.data<T>(), head, tail);
    AMP_CUDA_CHECK_LAUNCH();
    declare_launch_cost(2 * chunks * cols * static_cast<int64_t>(sizeof(C)) + 24 * chunks, 0, chunks * cols);
    AMP_LAUNCH(grid_for(chunks * cols, ctx.sm_count()), kBlock, 0, ctx.stream(), embedding_join_kernel<T>)(
        idx.data<int64_t>(), order.as<int32_t>(), n, vocab, cols, chunk, chunks, grad_weight.data<T>(), head, tail);
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
    // Enough blocks to fill the GPU 4 times over (at least one per SM), each split at least 64 rows.
    const int64_t col_tiles = (cols + kColTile - 1) / kColTile;
    const int64_t wanted = (4 * static_cast<int64_t>(ctx.sm_count()) + col_tiles - 1) / col_tiles;
    const int64_t splits = std::max<int64_t>(1, std::min<int64_t>({wanted, (rows + 63) / 64, 65535}));
    const int64_t rows_per_split = (rows + splits - 1) / splits;
    if (col_tiles > 0x7fffffff) throw std::invalid_argument("layer_norm_backward: more than 2^36 columns");
    const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(splits)), block(kColTile, kRowLanes);
    const int64_t param_bytes = 2 * cols * static_cast<int64_t>(sizeof(T));
    if (splits == 1) {
      declare_launch_cost(2 * gx_bytes + stats, param_bytes, 4 * rows * cols);
      AMP_LAUNCH(grid, block, 0, ctx.stream(), layer_norm_param_partials_kernel<T>)(
          g.data<T>(), x.data<T>(), mean.data<C>(), rstd.data<C>(), rows, cols, rows_per_split, gw.data<T>(),
          gb.data<T>(), nullptr);
      AMP_CUDA_CHECK_LAUNCH();
    } else {
      const int64_t partial_bytes = 2 * splits * cols * static_cast<int64_t>(sizeof(C));
      Scratch partials(static_cast<size_t>(partial_bytes));
      declare_launch_cost(2 * gx_bytes + stats, partial_bytes, 4 * rows * cols);
      AMP_LAUNCH(grid, block, 0, ctx.stream(), layer_norm_param_partials_kernel<T>)(
          g.data<T>(), x.data<T>(), mean.data<C>(), rstd.data<C>(), rows, cols, rows_per_split, gw.data<T>(),
          gb.data<T>(), partials.as<C>());
      AMP_CUDA_CHECK_LAUNCH();
      declare_launch_cost(partial_bytes, param_bytes, 2 * splits * cols);
      AMP_LAUNCH(grid_for(cols, ctx.sm_count()), kBlock, 0, ctx.stream(), layer_norm_param_sums_kernel<T>)(
          partials.as<C>(), splits, cols, gw.data<T>(), gb.data<T>());
      AMP_CUDA_CHECK_LAUNCH();
    }
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
