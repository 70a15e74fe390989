// CUDA backend: the embedding lookup and its backward, a deterministic sum of each index's gradient
// rows (sorted runs, or the CPU's row order above kSortedEmbeddingMax indices).
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
#include "runtime/kernels/strided_index.h"
#include "runtime/kernels/transformer_math.h"

namespace amp::cuda {

namespace {

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

// A row's sum added to its row once, with the numbers of embedding_backward into zeros then add():
// the sum stored as the zeroed row would hold it (rounded to T), then added (rounded again).
template <class T, class C>
__device__ __forceinline__ void add_row_sum(T& dst, C sum) {
  const T once = DevElem<T>::store(static_cast<C>(0) + sum);
  dst = DevElem<T>::store(static_cast<C>(DevElem<T>::load(dst)) + static_cast<C>(DevElem<T>::load(once)));
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
      add_row_sum(gw[v * cols + col], acc);
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
    add_row_sum(gw[v * cols + col], total);
  }
}

}  // namespace

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

// The sorted runs add each named row's sum once: add()'s numbers (add_row_sum). Above
// kSortedEmbeddingMax indices the row-order kernel adds one row at a time: the default then.
void CudaBackend::embedding_backward_add(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) {
  if (idx.numel() > kSortedEmbeddingMax) return Backend::embedding_backward_add(grad, idx, grad_weight);
  embedding_backward(grad, idx, grad_weight);
}

}  // namespace amp::cuda
