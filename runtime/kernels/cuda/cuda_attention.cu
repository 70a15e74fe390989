// CUDA backend: causal self-attention without the [T, T] scores in memory, in FlashAttention-2's order
// (Dao, 2023: a tile of keys at a time, the softmax kept online as a running maximum and sum, the
// backward recomputing the scores from each row's log-sum-exp), its products on the tensor cores
// (mma.sync m16n8k16, fp32 accumulators: runtime/kernels/cuda/mma.cuh). q, k and v are read where the
// qkv projection wrote them ([B, T, 3C], heads side by side) and y is written as [B, T, C]: no head
// permutes. As FlashAttention does, the probabilities (and their gradients) are rounded to the input
// type before their product with v (k, q, gy); the softmax statistics and every sum are fp32. Every
// output element is written once (no atomics), so the results are deterministic.
//
// The backward computes the scores once where its scratch allows: its dk/dv pass, a block per 64
// keys walking the queries, also writes each tile of the scores' gradient dS (rounded to the input
// type, as its products take it) to a scratch buffer, and the dq pass is then the product dS k, a
// block per 64 queries walking those tiles. FlashAttention-2 adds dq from the dk/dv pass with atomics
// instead, which is not deterministic. The scratch holds the causal half of dS in 64 x 64 tiles,
// T (T + 64) bytes a batch and head for 16-bit types (GPT-2 small at batch 8: 107 MB), taken a layer
// at a time, batches in groups under a limit (128 MiB: ds_limit). Where a batch's tiles pass it, or
// the batches it holds launch too few blocks to fill the GPU (long sequences: a head's tiles grow as
// T^2), the dq pass recomputes QK^T, P and dP from q, k, v and gy instead, with no scratch: two of
// the backward's seven tile products done twice. The choice depends on a batch's shape, not on the
// number of batches, so that a rank takes the same kernels whatever the number of ranks. Both round
// dS the same way and add it in the same order; they compute it as the transposed products K Q^T and
// Q K^T, which the emulated GPU sums alike (the two give the same bits there) and a GPU's mma.sync
// may not.
//
// A block is a number of warps over consecutive rows, 16 a warp: 128 query rows in the forward (8
// warps), 64 query rows in the dq pass and 64 key rows in the dk/dv pass (4 warps). Tiles of kTile
// rows of the other side are copied into shared memory row-major by cp.async, the next tile while the
// block computes on the last (two buffers: async_copy.cuh); a product that reads a tile along its rows
// takes its B fragments with ldmatrix.trans, so no tile is transposed. Each warp's results go out
// through shared memory, 16 bytes a store.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "runtime/kernels/cuda/async_copy.cuh"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/cudnn_sdpa.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/mma.cuh"

namespace amp::cuda {

namespace {

constexpr int kTile = 64;          // rows of a shared tile: keys (forward, dq) or queries (dk/dv)
constexpr int kForwardWarps = 8;   // 128 query rows a block, FlashAttention-2's tile for head size 64
constexpr int kBackwardWarps = 4;  // 64 rows a block
constexpr float kLog2e = 1.4426950408889634f;
// When the backward keeps dS's tiles: where the batches whose tiles fit in limit bytes (GPT-2 small:
// 10, 13 MB each) launch min_blocks blocks or more (2.6 waves of three blocks on 132 SMs); else the
// dq pass recomputes.
// set_attention_ds_policy changes it (tests).
std::atomic<int64_t> ds_limit{int64_t{128} << 20};
std::atomic<int64_t> ds_min_blocks{1024};

// A shared tile: R rows of N elements as N / 2 words, each row padded by 4 words so that the 8 rows
// of 16 bytes an ldmatrix phase (or a warp's row of stores) touches fall in 32 distinct banks; rows
// start on 16-byte boundaries.
template <int R, int N>
struct alignas(16) Words {
  uint32_t w[R][N / 2 + 4];
};
template <int D>
using Tile = Words<kTile, D>;

// A block's shared memory: two buffers of two tiles (k and v, or q and gy), and, once the tiles are
// done with, the staging area of its Outputs results (Rows x D each) on their way out.
template <int D, int Rows, int Outputs>
union Shared {
  struct {
    Tile<D> a, b;
  } stage[2];
  Words<Rows, D> out[Outputs];
};

// Copies rows [first, first + kTile) of a matrix of `rows` rows (row stride `stride` elements, N
// columns from base, 16-byte aligned) into w, 16 bytes a cp.async; zeros past the end. The caller
// commits the group.
template <int Threads, class T, int N>
__device__ void stage_rows(const T* base, int64_t first, int64_t rows, int64_t stride, Tile<N>& w) {
  constexpr int kQuads = N / 8;
  for (int e = static_cast<int>(threadIdx.x); e < kTile * kQuads; e += Threads) {
    const int r = e / kQuads, c = 4 * (e % kQuads);
    const int64_t row = first + r;
    const bool valid = row < rows;
    cp_async_16(&w.w[r][c], valid ? base + row * stride + 2 * c : base, valid);
  }
}

// The two-buffer pipeline over `tiles` tiles: stage(i) issues tile i's copies into buffer i % 2 and
// commits them; body(i) runs once every thread's copies of tile i are in, while tile i + 1's load.
// The barrier after each body frees its buffer for tile i + 2.
template <class Stage, class Body>
__device__ __forceinline__ void pipeline(int64_t tiles, Stage&& stage, Body&& body) {
  if (tiles > 0) stage(0);
  for (int64_t i = 0; i < tiles; ++i) {
    if (i + 1 < tiles) {
      stage(i + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile i is in, for every thread
    body(i);
    __syncthreads();  // tile i is done with: its buffer takes tile i + 2
  }
}

// Tile i of the keys (into buffer i's a) and values (b) of the head at at, for the passes that walk
// the keys (the forward and dq), committed as one group.
template <int Threads, class T, int D, class F, class S>
__device__ __forceinline__ void stage_keys_values(const F& at, const T* qkv, int64_t rows, int64_t i, S& sm) {
  stage_rows<Threads, T, D>(at.head(qkv, rows, 1), i * kTile, rows, at.stride, sm.stage[i % 2].a);
  stage_rows<Threads, T, D>(at.head(qkv, rows, 2), i * kTile, rows, at.stride, sm.stage[i % 2].b);
  cp_async_commit();
}

// The B fragments of n-tiles n and n + 1 (n even; cols 8 n ..) at k-step kk (k = 16 kk ..): one
// ldmatrix. b[0], b[1] for n; b[2], b[3] for n + 1. Trans = false: the tile's rows are B's columns
// (word (col, k / 2) holds B[k][col], B[k + 1][col]); Trans = true: its rows are B's k (word
// (k, col / 2) holds B[k][col], B[k][col + 1]), read by ldmatrix.trans.
template <bool Trans, int W>
__device__ __forceinline__ void b_frags(const uint32_t (*rows)[W], int n, int kk, int lane, uint32_t (&b)[4]) {
  const int i = lane / 8;
  if constexpr (Trans)
    ldmatrix_x4_trans(b, &rows[16 * kk + 8 * (i % 2) + lane % 8][4 * (n + i / 2)]);
  else
    ldmatrix_x4(b, &rows[8 * (n + i / 2) + lane % 8][8 * kk + 4 * (i % 2)]);
}

// d[n] += a B for NT n-tiles of B from n-tile n0 on.
template <bool Trans, class T, int R, int N, int NT>
__device__ __forceinline__ void mma_row(float (&d)[NT][4], const uint32_t (&a)[4], const Words<R, N>& w, int kk, int lane,
                                        int n0 = 0) {
  #pragma unroll
  for (int n = 0; n < NT; n += 2) {
    uint32_t b[4];
    b_frags<Trans>(w.w, n0 + n, kk, lane, b);
    mma_16816<T>(d[n], a, b[0], b[1]);
    mma_16816<T>(d[n + 1], a, b[2], b[3]);
  }
}

// A fragments of a warp's 16 rows (r0 = its row g, r0 + 8) of a [rows, D] matrix, straight from memory.
template <class T, int D>
__device__ void a_frags(const T* base, int64_t r0, int64_t rows, int64_t stride, int t, uint32_t (&a)[D / 16][4]) {
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    #pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int64_t r = r0 + 8 * (w % 2);
      a[kk][w] = r < rows ? load_pair(base + r * stride + 16 * kk + 8 * (w / 2) + 2 * t) : 0u;
    }
}

// The accumulators of two n-tiles (keys 16 kk ..) as the A fragment of the next product, rounded to T.
template <class T>
__device__ __forceinline__ void c_to_a(const float (&lo)[4], const float (&hi)[4], uint32_t (&a)[4]) {
  a[0] = pack_pair<T>(lo[0], lo[1]);
  a[1] = pack_pair<T>(lo[2], lo[3]);
  a[2] = pack_pair<T>(hi[0], hi[1]);
  a[3] = pack_pair<T>(hi[2], hi[3]);
}

// d += P B, P the warp's accumulators s (16 rows x 8 NT columns) as A fragments rounded to T, B from w
// (along its rows: P's columns are B's k) from k-step kk0 on.
template <class T, int NT, int DT, int R, int N>
__device__ __forceinline__ void mma_acc(float (&d)[DT][4], const float (&s)[NT][4], const Words<R, N>& w, int kk0,
                                        int lane) {
  #pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t a[4];
    c_to_a<T>(s[2 * kk], s[2 * kk + 1], a);
    mma_row<true, T>(d, a, w, kk0 + kk, lane);
  }
}

__device__ __forceinline__ float group_max(float v) {  // over the 4 lanes that hold one row
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float group_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// A warp's 16 rows of results (the accumulators acc, rows g and g + 8, already scaled), rounded to T,
// into its rows of the staging tile, and from there to out (row i of the block at out + (first + i)
// stride), 16 bytes a store; rows from `rows` on are not written. The staging tile must be free.
template <class T, int D, int R>
__device__ void store_rows(const float (&acc)[D / 8][4], Words<R, D>& stage, int64_t first, int64_t rows, T* out,
                           int64_t stride) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  #pragma unroll
  for (int r = 0; r < 2; ++r)
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
      stage.w[16 * warp + lane / 4 + 8 * r][4 * n + lane % 4] = pack_pair<T>(acc[n][2 * r], acc[n][2 * r + 1]);
  __syncwarp();
  constexpr int kQuads = D / 8;
  for (int e = lane; e < 16 * kQuads; e += 32) {
    const int r = 16 * warp + e / kQuads, c = 4 * (e % kQuads);
    if (first + r < rows) store_quad(out + (first + r) * stride + 2 * c, &stage.w[r][c]);
  }
}

// Where a thread stands: batch b and head h (blockIdx.y), the block's Rows rows from `first`, its
// warp's rows from `base`, its fragment rows r0 = base + g and r0 + 8, and the head's D columns in
// qkv, whose rows hold q, k and v (C columns each: stride 3C). Causal rows cost in proportion to their
// number in the forward and the dq pass: there the first blocks take the last rows (`reversed`), so
// that the longest run first and the shortest fill the tail.
template <int D, int Rows>
struct Frag {
  int lane, g, t;
  int64_t bh, b, h, C, stride, first, base, r0;
  __device__ Frag(int64_t heads, bool reversed)
      : lane(static_cast<int>(threadIdx.x) % 32), g(lane / 4), t(lane % 4), bh(blockIdx.y), b(bh / heads),
        h(bh % heads), C(heads * D), stride(3 * C),
        first(static_cast<int64_t>(reversed ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * Rows),
        base(first + 16 * (static_cast<int>(threadIdx.x) / 32)), r0(base + g) {}
  // Row 0 of this batch's q (part 0), k (1) or v (2) for this head.
  template <class T>
  __device__ const T* head(const T* qkv, int64_t rows, int part) const {
    return qkv + b * rows * stride + part * C + h * D;
  }
};

// y[b, i, h] = softmax_j<=i(scale q_i . k_j) v_j, and lse[b, h, i] = log sum_j<=i exp(scale q_i . k_j).
template <class T, int D>
__global__ void __launch_bounds__(32 * kForwardWarps, 2)
    attention_forward_kernel(const T* qkv, int64_t rows, int64_t heads, float scale, T* y, float* lse) {
  constexpr int kRows = 16 * kForwardWarps, kThreads = 32 * kForwardWarps;
  using Smem = Shared<D, kRows, 1>;
  AMP_SHARED(Smem, sm);
  const Frag<D, kRows> at(heads, true);
  const int t = at.t;
  uint32_t qa[D / 16][4];
  a_frags<T, D>(at.head(qkv, rows, 0), at.r0, rows, at.stride, t, qa);
  const float sl2 = scale * kLog2e;  // scores in log2 units: exp2f
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[D / 8][4] = {};
  const int64_t last = (at.first + kRows < rows ? at.first + kRows : rows) - 1;  // keys up to the block's last row
  auto stage = [&](int64_t i) { stage_keys_values<kThreads, T, D>(at, qkv, rows, i, sm); };
  pipeline(last / kTile + 1, stage, [&](int64_t i) {
    const int64_t j0 = i * kTile;
    if (j0 <= at.base + 15) {  // some key of the tile is at or before the warp's last row (the warp agrees)
      const Tile<D>& ks = sm.stage[i % 2].a;
      const Tile<D>& vs = sm.stage[i % 2].b;
      float s[kTile / 8][4] = {};
      #pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) mma_row<false, T>(s, qa[kk], ks, kk, at.lane);
      const int diag = static_cast<int>(at.r0 - j0);  // keys of the tile up to row r0: 0 .. diag
      const bool masked = j0 + kTile - 1 > at.base;   // the tile reaches past the warp's first row
      float mx[2] = {m[0], m[1]};
      #pragma unroll
      for (int n = 0; n < kTile / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool keep = !masked || 8 * n + 2 * t + e % 2 <= diag + 8 * (e / 2);
          s[n][e] = keep ? s[n][e] * sl2 : -INFINITY;
          mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
        }
      float rescale[2];
      #pragma unroll
      for (int r = 0; r < 2; ++r) {  // key 0 is in the first tile: m is finite from then on
        mx[r] = group_max(mx[r]);
        rescale[r] = exp2f(m[r] - mx[r]);  // 0 on the first tile (m = -inf)
        m[r] = mx[r];
        l[r] *= rescale[r];
      }
      #pragma unroll
      for (int n = 0; n < D / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] *= rescale[e / 2];
      #pragma unroll
      for (int n = 0; n < kTile / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = exp2f(s[n][e] - m[e / 2]);
          l[e / 2] += s[n][e];  // this lane's part of the row's sum
        }
      mma_acc<T>(o, s, vs, 0, at.lane);
    }
  });
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = group_sum(l[r]);
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][2 * r] /= l[r];
      o[n][2 * r + 1] /= l[r];
    }
    const int64_t row = at.r0 + 8 * r;
    if (t == 0 && row < rows) lse[at.bh * rows + row] = (m[r] + log2f(l[r])) / kLog2e;
  }
  store_rows<T, D>(o, sm.out[0], at.first, rows, y + at.b * rows * at.C + at.h * D, at.C);
}

// The tiles of dS for one batch and head: the causal half of [T, T] in kTile x kTile tiles, tile
// (query tile qi, key tile kj <= qi) at qi (qi + 1) / 2 + kj, each row-major with its rows the keys
// and its columns the queries (the dk/dv pass's accumulators' layout).
__host__ __device__ constexpr int64_t ds_tiles(int64_t rows) {
  const int64_t n = (rows + kTile - 1) / kTile;
  return n * (n + 1) / 2;
}
constexpr int64_t kDsTileElems = int64_t{kTile} * kTile;

// The backward's first step: delta_i = gy_i . y_i over a head's D columns, a thread per row and head.
template <class T, int D>
__global__ void attention_delta_kernel(const T* y, const T* gy, int64_t count, int64_t rows, int64_t heads,
                                       float* delta) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int64_t bt = i / heads, h = i % heads;  // row bt of [B T, C], head h: consecutive threads, consecutive bytes
  const T* yr = y + bt * heads * D + h * D;
  const T* gr = gy + bt * heads * D + h * D;
  float part[4] = {};  // over the columns 8 c + 2 w and 8 c + 2 w + 1, as the mma fragments split a row
  #pragma unroll
  for (int c = 0; c < D; c += 8) {
    uint32_t yw[4], gw[4];
    load_quad(yr + c, yw);
    load_quad(gr + c, gw);
    #pragma unroll
    for (int w = 0; w < 4; ++w)
      part[w] += pair_lo<T>(gw[w]) * pair_lo<T>(yw[w]) + pair_hi<T>(gw[w]) * pair_hi<T>(yw[w]);
  }
  delta[((bt / rows) * heads + h) * rows + bt % rows] = (part[0] + part[1]) + (part[2] + part[3]);
}

// The dk/dv pass, a warp per 16 key rows: dv_j = sum_i>=j p_ij gy_i, dk_j = scale sum_i>=j ds_ij q_i,
// from the transposed products (rows: keys, columns: queries), a tile's 64 queries 32 at a time, with
// p_ij = exp(scale q_i . k_j - lse_i) and ds_ij = p_ij (gy_i . v_j - delta_i). With Keep, each tile
// of ds goes to ds (ds_tiles' layout, batch and head blockIdx.y) as the products take it, rounded to
// T, zeros where the causal mask empties it, so that the dq pass reads only what was written.
template <class T, int D, bool Keep>
__global__ void __launch_bounds__(32 * kBackwardWarps, 3)
    attention_dkdv_kernel(const T* qkv, const float* lse, const T* gy, const float* delta, int64_t rows, int64_t heads,
                          float scale, T* dqkv, T* ds) {
  constexpr int kRows = 16 * kBackwardWarps, kThreads = 32 * kBackwardWarps;
  using Smem = Shared<D, kRows, 2>;
  AMP_SHARED(Smem, sm);
  AMP_SHARED(float[2][kTile], ls);  // the tile's lse (log2 units) and delta, in the buffer of its tile
  AMP_SHARED(float[2][kTile], dl);
  const Frag<D, kRows> at(heads, false);
  const int t = at.t;
  const T* gbase = gy + at.b * rows * at.C + at.h * D;
  uint32_t ka[D / 16][4], va[D / 16][4];
  a_frags<T, D>(at.head(qkv, rows, 1), at.r0, rows, at.stride, t, ka);
  a_frags<T, D>(at.head(qkv, rows, 2), at.r0, rows, at.stride, t, va);
  const float sl2 = scale * kLog2e;
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  const int64_t tiles = at.first < rows ? (rows - at.first + kTile - 1) / kTile : 0;  // queries from the first key on
  const int64_t kj = at.first / kTile;
  // This warp's rows (keys r0 - first and 8 on) of the tile for query tile kj + i, as words.
  uint32_t* const ds_rows = Keep ? reinterpret_cast<uint32_t*>(ds + blockIdx.y * ds_tiles(rows) * kDsTileElems) +
                                       (at.r0 - at.first) * (kTile / 2) + t
                                 : nullptr;  // ds is null then
  auto ds_tile = [&](int64_t i) {
    const int64_t qi = kj + i;
    return ds_rows + (qi * (qi + 1) / 2 + kj) * (kDsTileElems / 2);
  };
  auto stage = [&](int64_t i) {
    const int64_t i0 = at.first + i * kTile;
    stage_rows<kThreads, T, D>(at.head(qkv, rows, 0), i0, rows, at.stride, sm.stage[i % 2].a);
    stage_rows<kThreads, T, D>(gbase, i0, rows, at.C, sm.stage[i % 2].b);
    cp_async_commit();
    if (static_cast<int>(threadIdx.x) < kTile) {  // plain loads: visible after the barrier that follows
      const int e = static_cast<int>(threadIdx.x);
      const int64_t r = i0 + e;
      ls[i % 2][e] = r < rows ? lse[at.bh * rows + r] * kLog2e : 0.0f;
      dl[i % 2][e] = r < rows ? delta[at.bh * rows + r] : 0.0f;
    }
  };
  pipeline(tiles, stage, [&](int64_t i) {
    const Tile<D>& qs = sm.stage[i % 2].a;
    const Tile<D>& gs = sm.stage[i % 2].b;
    const float* lsi = ls[i % 2];
    const float* dli = dl[i % 2];
    const int64_t i0 = at.first + i * kTile;
    const int diag = static_cast<int>(at.r0 - i0);  // queries of the tile from key r0 on: diag ..
    const int valid = static_cast<int>(rows - i0 < kTile ? rows - i0 : kTile);  // queries that exist
    uint32_t* const out = Keep ? ds_tile(i) : nullptr;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {  // 32 queries at a time: fewer live registers
      constexpr int kN = kTile / 16;        // n-tiles of a half
      // Every query of the half is before the warp's keys, or past the last row: ds is 0 there.
      if (i0 + kN * 8 * (half + 1) - 1 < at.base || i0 + kN * 8 * half >= rows) {
        if constexpr (Keep) {
          #pragma unroll
          for (int n = 0; n < kN; ++n)
            #pragma unroll
            for (int r = 0; r < 2; ++r) out[8 * r * (kTile / 2) + 4 * (kN * half + n)] = 0u;
        }
        continue;
      }
      const bool masked = i0 + kN * 8 * half < at.base + 15 || valid < kTile;
      float s[kN][4] = {}, dp[kN][4] = {};
      #pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        mma_row<false, T>(s, ka[kk], qs, kk, at.lane, kN * half);
        mma_row<false, T>(dp, va[kk], gs, kk, at.lane, kN * half);
      }
      #pragma unroll
      for (int n = 0; n < kN; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * (kN * half + n) + 2 * t + e % 2;
          const bool keep = !masked || (c >= diag + 8 * (e / 2) && c < valid);
          const float p = keep ? exp2f(s[n][e] * sl2 - lsi[c]) : 0.0f;
          s[n][e] = p;
          dp[n][e] = p * (dp[n][e] - dli[c]);  // ds
        }
      if constexpr (Keep) {
        #pragma unroll
        for (int n = 0; n < kN; ++n)
          #pragma unroll
          for (int r = 0; r < 2; ++r)
            out[8 * r * (kTile / 2) + 4 * (kN * half + n)] = pack_pair<T>(dp[n][2 * r], dp[n][2 * r + 1]);
      }
      mma_acc<T>(dv, s, gs, kN / 2 * half, at.lane);
      mma_acc<T>(dk, dp, qs, kN / 2 * half, at.lane);  // dp holds ds
    }
  });
  #pragma unroll
  for (int n = 0; n < D / 8; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] *= scale;
  T* out = dqkv + at.b * rows * at.stride + at.h * D;
  store_rows<T, D>(dk, sm.out[0], at.first, rows, out + at.C, at.stride);
  store_rows<T, D>(dv, sm.out[1], at.first, rows, out + 2 * at.C, at.stride);
}

// The dq pass after a dk/dv pass that kept ds, a warp per 16 query rows: dq_i = scale sum_j<=i ds_ij k_j
// from the tiles of ds the dk/dv pass wrote. A tile's rows are the keys, so a warp takes its A
// fragments (its 16 queries, 16 keys at a time) with ldmatrix.trans, and k's B fragments along its
// rows as the other passes do.
template <class T, int D>
__global__ void __launch_bounds__(32 * kBackwardWarps, 4)
    attention_dq_kept_kernel(const T* qkv, const T* ds, int64_t rows, int64_t heads, float scale, T* dqkv) {
  constexpr int kRows = 16 * kBackwardWarps, kThreads = 32 * kBackwardWarps;
  union Smem {
    struct {
      Tile<kTile> s;  // ds's tile
      Tile<D> k;
    } stage[2];
    Words<kRows, D> out[1];
  };
  AMP_SHARED(Smem, sm);
  const Frag<D, kRows> at(heads, true);
  const int lane = at.lane, warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t qi = at.first / kTile;
  const T* tiles = ds + (blockIdx.y * ds_tiles(rows) + qi * (qi + 1) / 2) * kDsTileElems;  // key tile 0's
  float dq[D / 8][4] = {};
  auto stage = [&](int64_t i) {
    stage_rows<kThreads, T, kTile>(tiles + i * kDsTileElems, 0, kTile, kTile, sm.stage[i % 2].s);
    stage_rows<kThreads, T, D>(at.head(qkv, rows, 1), i * kTile, rows, at.stride, sm.stage[i % 2].k);
    cp_async_commit();
  };
  pipeline(qi + 1, stage, [&](int64_t i) {
    const auto& st = sm.stage[i % 2];
    #pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      if (i * kTile + 16 * kk > at.base + 15) break;  // these keys are after the warp's rows: ds is 0
      uint32_t a[4];  // matrix lane / 8: queries 8 ((lane / 8) % 2) .., keys 16 kk + 8 (lane / 16) ..
      ldmatrix_x4_trans(a, &st.s.w[16 * kk + 8 * (lane / 16) + lane % 8][8 * warp + 4 * ((lane / 8) % 2)]);
      mma_row<true, T>(dq, a, st.k, kk, lane);
    }
  });
  #pragma unroll
  for (int n = 0; n < D / 8; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] *= scale;
  store_rows<T, D>(dq, sm.out[0], at.first, rows, dqkv + at.b * rows * at.stride + at.h * D, at.stride);
}

// The dq pass without ds kept, a warp per 16 query rows: dq_i = scale sum_j ds_ij k_j, ds computed
// again from q, k, v, gy, lse and delta as the dk/dv pass computes it. A tile's 64 keys are taken 32 at
// a time (fewer live registers).
template <class T, int D>
__global__ void __launch_bounds__(32 * kBackwardWarps, 3)
    attention_dq_kernel(const T* qkv, const float* lse, const T* gy, const float* delta, int64_t rows,
                        int64_t heads, float scale, T* dqkv) {
  constexpr int kRows = 16 * kBackwardWarps, kThreads = 32 * kBackwardWarps;
  using Smem = Shared<D, kRows, 1>;
  AMP_SHARED(Smem, sm);
  const Frag<D, kRows> at(heads, true);
  const int t = at.t;
  uint32_t qa[D / 16][4], ga[D / 16][4];
  a_frags<T, D>(gy + at.b * rows * at.C + at.h * D, at.r0, rows, at.C, t, ga);
  a_frags<T, D>(at.head(qkv, rows, 0), at.r0, rows, at.stride, t, qa);
  float di[2], li[2];
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = at.r0 + 8 * r;
    li[r] = row < rows ? lse[at.bh * rows + row] * kLog2e : 0.0f;
    di[r] = row < rows ? delta[at.bh * rows + row] : 0.0f;
  }
  const float sl2 = scale * kLog2e;
  float dq[D / 8][4] = {};
  const int64_t last = (at.first + kRows < rows ? at.first + kRows : rows) - 1;
  auto stage = [&](int64_t i) { stage_keys_values<kThreads, T, D>(at, qkv, rows, i, sm); };
  pipeline(last / kTile + 1, stage, [&](int64_t i) {
    const Tile<D>& ks = sm.stage[i % 2].a;
    const Tile<D>& vs = sm.stage[i % 2].b;
    const int64_t j0 = i * kTile;
    const int diag = static_cast<int>(at.r0 - j0);
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      constexpr int kN = kTile / 16;  // n-tiles of a half
      if (j0 + kN * 8 * half > at.base + 15) continue;  // every key of the half is after the warp's rows
      const bool masked = j0 + kN * 8 * (half + 1) - 1 > at.base;
      float s[kN][4] = {}, dp[kN][4] = {};
      #pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        mma_row<false, T>(s, qa[kk], ks, kk, at.lane, kN * half);
        mma_row<false, T>(dp, ga[kk], vs, kk, at.lane, kN * half);
      }
      #pragma unroll
      for (int n = 0; n < kN; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * (kN * half + n) + 2 * t + e % 2;
          const bool keep = !masked || c <= diag + 8 * (e / 2);
          const float p = keep ? exp2f(s[n][e] * sl2 - li[e / 2]) : 0.0f;
          s[n][e] = p * (dp[n][e] - di[e / 2]);  // ds
        }
      mma_acc<T>(dq, s, ks, kN / 2 * half, at.lane);  // s holds ds
    }
  });
  #pragma unroll
  for (int n = 0; n < D / 8; ++n)
    #pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] *= scale;
  store_rows<T, D>(dq, sm.out[0], at.first, rows, dqkv + at.b * rows * at.stride + at.h * D, at.stride);
}

struct Dims {
  int64_t B, T, C, H, D;
};
Dims attention_dims(const Tensor& qkv, int64_t n_head) {
  if (qkv.dim() != 3 || n_head < 1 || qkv.size(2) % (3 * n_head) != 0)
    throw std::invalid_argument("attention: expected qkv [B, T, 3C] with C a multiple of " + std::to_string(n_head) +
                                " heads, got " + shape_str(qkv.shape()));
  const int64_t C = qkv.size(2) / 3;
  return {qkv.size(0), qkv.size(1), C, n_head, C / n_head};
}

void check_shape(const Tensor& t, const Shape& want, DType dtype, const char* what) {
  require_cuda(t, what);
  if (t.shape() != want || t.dtype() != dtype)
    throw std::invalid_argument(std::string("attention: ") + what + " must be " + shape_str(want) + " " +
                                dtype_name(dtype) + ", got " + shape_str(t.shape()) + " " + dtype_name(t.dtype()));
}

// Calls f(T{}, std::integral_constant<int, D>{}) for qkv's dtype and head size.
template <class F>
void dispatch_attention(DType dtype, int64_t head_dim, F&& f) {
  auto by_dim = [&](auto T_tag) {
    if (head_dim == 32) f(T_tag, std::integral_constant<int, 32>{});
    else f(T_tag, std::integral_constant<int, 64>{});
  };
  switch (dtype) {
    case DType::bf16: by_dim(BFloat16{}); break;
    case DType::f16: by_dim(Half{}); break;
    default: throw std::invalid_argument("attention: unsupported dtype");
  }
}

// The kernels read rows 8 elements (16 bytes) at a time.
void check_aligned(const Tensor& t, const char* what) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0)
    throw std::invalid_argument(std::string("attention: ") + what + " must start on a 16-byte boundary");
}

// Blocks of `warps` warps (16 rows each) over every row of every batch and head.
dim3 attention_grid(const Dims& d, int warps) {
  if (d.B * d.H > 65535) throw std::invalid_argument("attention: more than 65535 batch x heads");
  const int64_t rows = 16 * warps;
  return dim3(static_cast<unsigned>((d.T + rows - 1) / rows), static_cast<unsigned>(d.B * d.H));
}

// cuDNN's attention (cudnn_sdpa.h) for these dims on this device.
cudnn_sdpa::Shape sdpa_shape(const Dims& d, DType dtype, double scale) {
  return {d.B, d.T, d.H, d.D, dtype, static_cast<float>(scale), context().device()};
}

// The kernels `which` names can run this dtype and head size, or std::invalid_argument says why not.
void require_fused(const CudaBackend& be, FusedAttention which, DType dtype, int64_t D) {
  if (which == FusedAttention::cudnn) {
    const std::string why = be.cudnn_attention_unavailable(dtype, D);
    if (!why.empty()) throw std::invalid_argument("attention: " + why);
  } else if (!be.has_fused_attention(dtype, D)) {
    throw std::invalid_argument("attention: no fused kernel for this dtype and head size");
  }
}

}  // namespace

bool CudaBackend::has_fused_attention(DType dtype, int64_t head_dim) const {
  return (dtype == DType::bf16 || dtype == DType::f16) && (head_dim == 32 || head_dim == 64);
}

std::string CudaBackend::cudnn_attention_unavailable(DType dtype, int64_t head_dim) const {
  return cudnn_sdpa::unavailable(dtype, head_dim);
}

void CudaBackend::attention_forward(const Tensor& qkv, int64_t n_head, double scale, Tensor& y, Tensor& lse,
                                    FusedAttention which) {
  require_cuda(qkv, "attention: qkv");
  const Dims d = attention_dims(qkv, n_head);
  require_fused(*this, which, qkv.dtype(), d.D);
  check_shape(y, {d.B, d.T, d.C}, qkv.dtype(), "y");
  check_shape(lse, {d.B, d.H, d.T}, DType::f32, "lse");
  check_aligned(qkv, "qkv");
  check_aligned(y, "y");
  check_aligned(lse, "lse");
  if (d.B * d.T == 0) return;
  Context& ctx = context();
  if (which == FusedAttention::cudnn) {
    const cudnn_sdpa::Shape s = sdpa_shape(d, qkv.dtype(), scale);
    const Scratch workspace(cudnn_sdpa::forward_workspace(s, ctx.stream()));  // our allocator's (a graph's pool in a capture)
    cudnn_sdpa::forward(s, ctx.stream(), qkv.data_ptr(), y.data_ptr(), lse.data<float>(), workspace.as<void>());
    return;
  }
  dispatch_attention(qkv.dtype(), d.D, [&](auto T_tag, auto dim) { using T = decltype(T_tag);
    const int64_t es = static_cast<int64_t>(sizeof(T)), pairs = d.B * d.H * d.T * (d.T + 1) / 2;
    declare_launch_cost(3 * d.B * d.T * d.C * es, d.B * d.T * d.C * es + 4 * d.B * d.H * d.T, 4 * pairs * d.D);
    AMP_LAUNCH(attention_grid(d, kForwardWarps), 32 * kForwardWarps, 0, ctx.stream(), attention_forward_kernel<T, decltype(dim)::value>)(
        qkv.data<T>(), d.T, d.H, static_cast<float>(scale), y.data<T>(), lse.data<float>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::attention_backward(const Tensor& qkv, const Tensor& y, const Tensor& lse, const Tensor& gy,
                                     int64_t n_head, double scale, Tensor& dqkv, FusedAttention which) {
  require_cuda(qkv, "attention: qkv");
  const Dims d = attention_dims(qkv, n_head);
  require_fused(*this, which, qkv.dtype(), d.D);
  check_shape(y, {d.B, d.T, d.C}, qkv.dtype(), "y");
  check_shape(gy, {d.B, d.T, d.C}, qkv.dtype(), "gy");
  check_shape(lse, {d.B, d.H, d.T}, DType::f32, "lse");
  check_shape(dqkv, qkv.shape(), qkv.dtype(), "dqkv");
  for (const auto& [t, what] :
       {std::pair<const Tensor*, const char*>{&qkv, "qkv"}, {&y, "y"}, {&gy, "gy"}, {&lse, "lse"}, {&dqkv, "dqkv"}})
    check_aligned(*t, what);
  if (d.B * d.T == 0) return;
  Context& ctx = context();
  if (which == FusedAttention::cudnn) {
    const cudnn_sdpa::Shape s = sdpa_shape(d, qkv.dtype(), scale);
    const size_t bytes = cudnn_sdpa::backward_workspace(s, ctx.stream());
    std::optional<Scratch> workspace;
    try {
      workspace.emplace(bytes);
    } catch (const OutOfMemory& e) {  // at the step's peak, where the forward's trial run had room
      throw OutOfMemory(std::string(e.what()) + "; it was cuDNN's attention backward's workspace, " +
                        std::to_string(bytes >> 20) + " MiB for batch " + std::to_string(d.B) + " x block " +
                        std::to_string(d.T) + " x " + std::to_string(d.H) +
                        " heads (its deterministic algorithm keeps dS, batch x heads x block^2 x 2 bytes): " +
                        (has_fused_attention(qkv.dtype(), d.D)
                             ? "--attention fused needs no such workspace, and --attention auto falls back to it"
                             : "our fused kernels do not take head size " + std::to_string(d.D) +
                                   ", so a smaller --batch-size or --block-size is the way"));
    }
    cudnn_sdpa::backward(s, ctx.stream(), qkv.data_ptr(), y.data_ptr(), gy.data_ptr(), lse.data<float>(),
                         dqkv.data_ptr(), workspace->as<void>());
    return;
  }
  Scratch delta(sizeof(float) * static_cast<size_t>(d.B * d.H * d.T));
  dispatch_attention(qkv.dtype(), d.D, [&](auto T_tag, auto dim) { using T = decltype(T_tag);
    constexpr int D = decltype(dim)::value;
    const int64_t es = static_cast<int64_t>(sizeof(T)), BH = d.B * d.H, stats = 4 * BH * d.T;
    const int64_t rows = d.B * d.T * d.H;
    declare_launch_cost(2 * d.B * d.T * d.C * es, stats, 2 * d.B * d.T * d.C);
    AMP_LAUNCH(dim3(static_cast<unsigned>((rows + 255) / 256)), 256, 0, ctx.stream(), attention_delta_kernel<T, D>)(
        y.data<T>(), gy.data<T>(), rows, d.T, d.H, delta.as<float>());
    AMP_CUDA_CHECK_LAUNCH();
    // Keep dS's tiles where the batches the limit holds fill the GPU (ds_limit); groups of whole
    // batches, as even as they go, so that a group's tensors start at a batch's rows.
    const int64_t per_batch = d.H * ds_tiles(d.T) * kDsTileElems * es;  // dS's tiles for one batch
    const int64_t fits = ds_limit.load() / per_batch, blocks = d.H * ((d.T + kTile - 1) / kTile);  // a batch's
    const int64_t min_blocks = ds_min_blocks.load();
    const bool kept = fits > 0 && fits >= min_blocks / blocks + (min_blocks % blocks != 0);  // not on B: see above
    const int64_t most = std::min(d.B, fits), groups = kept ? (d.B + most - 1) / most : 0;
    const int64_t group = kept ? (d.B + groups - 1) / groups : 0;
    const Scratch ds(kept ? static_cast<size_t>(group * per_batch) : 0);
    const int64_t step = kept ? group : d.B;
    for (int64_t b0 = 0; b0 < d.B; b0 += step) {
      Dims g = d;  // the group's batches, from b0 on
      g.B = std::min(step, d.B - b0);
      const int64_t pairs = g.B * d.H * d.T * (d.T + 1) / 2, part = g.B * d.T * d.C * es, st = g.B * d.H * d.T;
      const T* q = qkv.data<T>() + b0 * d.T * 3 * d.C;
      const T* gyb = gy.data<T>() + b0 * d.T * d.C;
      const float *lseb = lse.data<float>() + b0 * d.H * d.T, *deltab = delta.as<float>() + b0 * d.H * d.T;
      T* dq = dqkv.data<T>() + b0 * d.T * 3 * d.C;
      declare_launch_cost(4 * part + 2 * 4 * st, 2 * part + (kept ? g.B * per_batch : 0), 8 * pairs * d.D);
      auto dkdv = [&](auto keep) {  // the kernel named where it launches (the emulated GPU's launch log)
        AMP_LAUNCH(attention_grid(g, kBackwardWarps), 32 * kBackwardWarps, 0, ctx.stream(),
                   attention_dkdv_kernel<T, D, decltype(keep)::value>)(q, lseb, gyb, deltab, d.T, d.H,
                                                                         static_cast<float>(scale), dq, ds.as<T>());
      };
      if (kept) dkdv(std::true_type{});
      else dkdv(std::false_type{});
      AMP_CUDA_CHECK_LAUNCH();
      if (kept) {
        declare_launch_cost(part + g.B * per_batch, part, 2 * pairs * d.D);
        AMP_LAUNCH(attention_grid(g, kBackwardWarps), 32 * kBackwardWarps, 0, ctx.stream(),
                   attention_dq_kept_kernel<T, D>)(q, ds.as<T>(), d.T, d.H, static_cast<float>(scale), dq);
      } else {
        declare_launch_cost(4 * part + 2 * 4 * st, part, 6 * pairs * d.D);
        AMP_LAUNCH(attention_grid(g, kBackwardWarps), 32 * kBackwardWarps, 0, ctx.stream(), attention_dq_kernel<T, D>)(
            q, lseb, gyb, deltab, d.T, d.H, static_cast<float>(scale), dq);
      }
      AMP_CUDA_CHECK_LAUNCH();
    }
  });
}

AttentionDsPolicy set_attention_ds_policy(AttentionDsPolicy policy) {
  return {ds_limit.exchange(std::max<int64_t>(policy.limit_bytes, 0)),
          ds_min_blocks.exchange(std::max<int64_t>(policy.min_blocks, 0))};
}

}  // namespace amp::cuda
