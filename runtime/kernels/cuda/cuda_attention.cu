// CUDA backend: causal self-attention without the [T, T] scores in memory, in FlashAttention-2's order
// (Dao, 2023: a tile of keys at a time, the softmax kept online as a running maximum and sum, the
// backward recomputing the scores from each row's log-sum-exp), its products on the tensor cores
// (mma.sync m16n8k16, fp32 accumulators: runtime/kernels/cuda/mma.cuh). q, k and v are read where the
// qkv projection wrote them ([B, T, 3C], heads side by side) and y is written as [B, T, C]: no head
// permutes. As FlashAttention does, the probabilities (and their gradients) are rounded to the input
// type before their product with v (k, q, gy); the softmax statistics and every sum are fp32. Every
// output element is written once (no atomics), so the results are deterministic.
//
// A block is kWarps warps over kRows consecutive rows (16 a warp: query rows in the forward and the
// dq pass, key rows in the dk/dv pass); tiles of kTile rows of the other side go through shared
// memory, as words of two elements, row-major or transposed, whichever the product's B fragment reads.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/cudnn_sdpa.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/mma.cuh"

namespace amp::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kRows = 16 * kWarps;
constexpr int kTile = 64;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

// A shared tile: R rows of N elements as N / 2 words, each row padded by 4 words so that the 8 rows
// of 16 bytes an ldmatrix phase reads fall in 32 distinct banks; rows start on 16-byte boundaries.
template <int R, int N>
struct alignas(16) Words {
  uint32_t w[R][N / 2 + 4];
};
template <int D>
using RowTile = Words<kTile, D>;  // kTile rows of D elements
template <int D>
using ColTile = Words<D, kTile>;  // the same, transposed

// Rows [first, first + kTile) of a matrix of `rows` rows (row stride `stride` elements, N columns from
// base, 16-byte aligned) into w, row-major, 8 elements a load; 0 past the end.
template <class T, int N>
__device__ void load_rows(const T* base, int64_t first, int64_t rows, int64_t stride, Words<kTile, N>& w) {
  constexpr int kQuads = N / 8;
  for (int e = static_cast<int>(threadIdx.x); e < kTile * kQuads; e += kThreads) {
    const int r = e / kQuads, c = 4 * (e % kQuads);
    const int64_t row = first + r;
    uint32_t q[4] = {0u, 0u, 0u, 0u};
    if (row < rows) load_quad(base + row * stride + 2 * c, q);
    #pragma unroll
    for (int i = 0; i < 4; ++i) w.w[r][c + i] = q[i];
  }
}

// The same rows transposed: wt[n][r / 2] holds elements (r, n) and (r + 1, n). A thread moves 2 rows
// x 8 columns; the 32 lanes of a warp take 32 row pairs, so their stores fall in 32 distinct banks.
template <class T, int N>
__device__ void load_rows_transposed(const T* base, int64_t first, int64_t rows, int64_t stride, Words<N, kTile>& wt) {
  constexpr int kQuads = N / 8;
  for (int e = static_cast<int>(threadIdx.x); e < kTile / 2 * kQuads; e += kThreads) {
    const int r = 2 * (e % (kTile / 2)), c = 4 * (e / (kTile / 2));
    const int64_t row = first + r;
    uint32_t q0[4] = {0u, 0u, 0u, 0u}, q1[4] = {0u, 0u, 0u, 0u};
    if (row < rows) load_quad(base + row * stride + 2 * c, q0);
    if (row + 1 < rows) load_quad(base + (row + 1) * stride + 2 * c, q1);
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      wt.w[2 * (c + i)][r / 2] = (q0[i] & 0xffffu) | (q1[i] << 16);
      wt.w[2 * (c + i) + 1][r / 2] = (q0[i] >> 16) | (q1[i] & 0xffff0000u);
    }
  }
}

// The B fragments of n-tiles n and n + 1 (n even; cols 8 n ..) at k-step kk (k = 16 kk ..), from a tile
// whose rows are B's columns (word (col, k / 2) holds B[k][col], B[k + 1][col]): one ldmatrix.
// b[0], b[1] for n; b[2], b[3] for n + 1.
template <int W>
__device__ __forceinline__ void b_frags(const uint32_t (*rows)[W], int n, int kk, int lane, uint32_t (&b)[4]) {
  const int i = lane / 8;
  ldmatrix_x4(b, &rows[8 * (n + i / 2) + lane % 8][8 * kk + 4 * (i % 2)]);
}

// d[n] += a B for NT n-tiles of B from n-tile n0 on.
template <class T, int R, int N, int NT>
__device__ __forceinline__ void mma_row(float (&d)[NT][4], const uint32_t (&a)[4], const Words<R, N>& w, int kk, int lane,
                                        int n0 = 0) {
  #pragma unroll
  for (int n = 0; n < NT; n += 2) {
    uint32_t b[4];
    b_frags(w.w, n0 + n, kk, lane, b);
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
// from k-step kk0 on (P's columns are B's k).
template <class T, int NT, int DT, int R, int N>
__device__ __forceinline__ void mma_acc(float (&d)[DT][4], const float (&s)[NT][4], const Words<R, N>& w, int kk0,
                                        int lane) {
  #pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t a[4];
    c_to_a<T>(s[2 * kk], s[2 * kk + 1], a);
    mma_row<T>(d, a, w, kk0 + kk, lane);
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

// Where a thread stands: batch b and head h (blockIdx.y), the block's rows from `first`, its warp's
// rows from `base`, its fragment rows r0 = base + g and r0 + 8, and the head's D columns in qkv, whose
// rows hold q, k and v (C columns each: stride 3C). Causal rows cost in proportion to their number in
// the forward and the dq pass: there the first blocks take the last rows (`reversed`), so that the
// longest run first and the shortest fill the tail.
template <int D>
struct Frag {
  int lane, g, t;
  int64_t bh, b, h, C, stride, first, base, r0;
  __device__ Frag(int64_t heads, bool reversed)
      : lane(static_cast<int>(threadIdx.x) % 32), g(lane / 4), t(lane % 4), bh(blockIdx.y), b(bh / heads),
        h(bh % heads), C(heads * D), stride(3 * C),
        first(static_cast<int64_t>(reversed ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kRows),
        base(first + 16 * (static_cast<int>(threadIdx.x) / 32)), r0(base + g) {}
  // Row 0 of this batch's q (part 0), k (1) or v (2) for this head.
  template <class T>
  __device__ const T* head(const T* qkv, int64_t rows, int part) const {
    return qkv + b * rows * stride + part * C + h * D;
  }
};

// y[b, i, h] = softmax_j<=i(scale q_i . k_j) v_j, and lse[b, h, i] = log sum_j<=i exp(scale q_i . k_j).
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(const T* qkv, int64_t rows, int64_t heads, float scale, T* y, float* lse) {
  AMP_SHARED(RowTile<D>, ks);
  AMP_SHARED(ColTile<D>, vt);
  const Frag<D> at(heads, true);
  const int t = at.t;
  uint32_t qa[D / 16][4];
  a_frags<T, D>(at.head(qkv, rows, 0), at.r0, rows, at.stride, t, qa);
  const float sl2 = scale * kLog2e;  // scores in log2 units: exp2f
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[D / 8][4] = {};
  const int64_t last = (at.first + kRows < rows ? at.first + kRows : rows) - 1;
  for (int64_t j0 = 0; j0 <= last; j0 += kTile) {  // keys up to the block's last row
    __syncthreads();  // the last tile's reads are done
    load_rows<T, D>(at.head(qkv, rows, 1), j0, rows, at.stride, ks);
    load_rows_transposed<T, D>(at.head(qkv, rows, 2), j0, rows, at.stride, vt);
    __syncthreads();
    if (j0 > at.base + 15) continue;  // every key of the tile is after the warp's rows (the warp agrees)
    float s[kTile / 8][4] = {};
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) mma_row<T>(s, qa[kk], ks, kk, at.lane);
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
    mma_acc<T>(o, s, vt, 0, at.lane);
  }
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = group_sum(l[r]);
    const int64_t row = at.r0 + 8 * r;
    if (row >= rows) continue;
    T* out = y + (at.b * rows + row) * at.C + at.h * D + 2 * t;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      out[8 * n] = DevElem<T>::store(o[n][2 * r] / l[r]);
      out[8 * n + 1] = DevElem<T>::store(o[n][2 * r + 1] / l[r]);
    }
    if (t == 0) lse[at.bh * rows + row] = (m[r] + log2f(l[r])) / kLog2e;
  }
}

// The backward's first pass, a warp per 16 query rows: delta_i = gy_i . y_i (kept for the second
// pass), and dq_i = scale sum_j ds_ij k_j with p_ij = exp(scale q_i . k_j - lse_i),
// ds_ij = p_ij (gy_i . v_j - delta_i).
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(const T* qkv, const T* y, const float* lse, const T* gy, int64_t rows, int64_t heads,
                        float scale, float* delta, T* dqkv) {
  AMP_SHARED(RowTile<D>, ks);
  AMP_SHARED(RowTile<D>, vs);
  AMP_SHARED(ColTile<D>, kt);
  const Frag<D> at(heads, true);
  const int t = at.t;
  const T* gbase = gy + at.b * rows * at.C + at.h * D;
  const T* ybase = y + at.b * rows * at.C + at.h * D;
  uint32_t qa[D / 16][4], ga[D / 16][4], ya[D / 16][4];
  a_frags<T, D>(at.head(qkv, rows, 0), at.r0, rows, at.stride, t, qa);
  a_frags<T, D>(gbase, at.r0, rows, at.C, t, ga);
  a_frags<T, D>(ybase, at.r0, rows, at.C, t, ya);
  float di[2] = {0.0f, 0.0f}, li[2];
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    #pragma unroll
    for (int w = 0; w < 4; ++w)
      di[w % 2] += pair_lo<T>(ga[kk][w]) * pair_lo<T>(ya[kk][w]) + pair_hi<T>(ga[kk][w]) * pair_hi<T>(ya[kk][w]);
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = at.r0 + 8 * r;
    di[r] = group_sum(di[r]);
    li[r] = row < rows ? lse[at.bh * rows + row] * kLog2e : 0.0f;
  }
  const float sl2 = scale * kLog2e;
  float dq[D / 8][4] = {};
  const int64_t last = (at.first + kRows < rows ? at.first + kRows : rows) - 1;
  for (int64_t j0 = 0; j0 <= last; j0 += kTile) {
    __syncthreads();
    load_rows<T, D>(at.head(qkv, rows, 1), j0, rows, at.stride, ks);
    load_rows<T, D>(at.head(qkv, rows, 2), j0, rows, at.stride, vs);
    load_rows_transposed<T, D>(at.head(qkv, rows, 1), j0, rows, at.stride, kt);
    __syncthreads();
    if (j0 > at.base + 15) continue;
    float s[kTile / 8][4] = {}, dp[kTile / 8][4] = {};
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      mma_row<T>(s, qa[kk], ks, kk, at.lane);
      mma_row<T>(dp, ga[kk], vs, kk, at.lane);
    }
    const int diag = static_cast<int>(at.r0 - j0);
    const bool masked = j0 + kTile - 1 > at.base;
    #pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool keep = !masked || 8 * n + 2 * t + e % 2 <= diag + 8 * (e / 2);
        const float p = keep ? exp2f(s[n][e] * sl2 - li[e / 2]) : 0.0f;
        s[n][e] = p * (dp[n][e] - di[e / 2]);  // ds
      }
    mma_acc<T>(dq, s, kt, 0, at.lane);  // s holds ds
  }
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = at.r0 + 8 * r;
    if (row >= rows) continue;
    T* out = dqkv + (at.b * rows + row) * at.stride + at.h * D + 2 * t;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      out[8 * n] = DevElem<T>::store(dq[n][2 * r] * scale);
      out[8 * n + 1] = DevElem<T>::store(dq[n][2 * r + 1] * scale);
    }
    if (t == 0) delta[at.bh * rows + row] = di[r];
  }
}

// The second pass, a warp per 16 key rows: dv_j = sum_i>=j p_ij gy_i, dk_j = scale sum_i>=j ds_ij q_i,
// from the transposed products (rows: keys, columns: queries).
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(const T* qkv, const float* lse, const T* gy, const float* delta, int64_t rows,
                          int64_t heads, float scale, T* dqkv) {
  AMP_SHARED(RowTile<D>, qs);
  AMP_SHARED(RowTile<D>, gs);
  AMP_SHARED(ColTile<D>, qt);
  AMP_SHARED(ColTile<D>, gt);
  AMP_SHARED(float[kTile], ls);
  AMP_SHARED(float[kTile], dl);
  const Frag<D> at(heads, false);
  const int t = at.t;
  const T* gbase = gy + at.b * rows * at.C + at.h * D;
  uint32_t ka[D / 16][4], va[D / 16][4];
  a_frags<T, D>(at.head(qkv, rows, 1), at.r0, rows, at.stride, t, ka);
  a_frags<T, D>(at.head(qkv, rows, 2), at.r0, rows, at.stride, t, va);
  const float sl2 = scale * kLog2e;
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int64_t i0 = at.first; i0 < rows; i0 += kTile) {  // queries from the block's first key row on
    __syncthreads();
    load_rows<T, D>(at.head(qkv, rows, 0), i0, rows, at.stride, qs);
    load_rows<T, D>(gbase, i0, rows, at.C, gs);
    load_rows_transposed<T, D>(at.head(qkv, rows, 0), i0, rows, at.stride, qt);
    load_rows_transposed<T, D>(gbase, i0, rows, at.C, gt);
    if (static_cast<int>(threadIdx.x) < kTile) {
      const int e = static_cast<int>(threadIdx.x);
      const int64_t r = i0 + e;
      ls[e] = r < rows ? lse[at.bh * rows + r] * kLog2e : 0.0f;
      dl[e] = r < rows ? delta[at.bh * rows + r] : 0.0f;
    }
    __syncthreads();
    const int diag = static_cast<int>(at.r0 - i0);  // queries of the tile from key r0 on: diag ..
    const int valid = static_cast<int>(rows - i0 < kTile ? rows - i0 : kTile);  // queries that exist
    const bool masked = i0 < at.base + 15 || valid < kTile;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {  // 32 queries at a time: fewer live registers
      constexpr int kN = kTile / 16;        // n-tiles of a half
      float s[kN][4] = {}, dp[kN][4] = {};
      #pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        mma_row<T>(s, ka[kk], qs, kk, at.lane, kN * half);
        mma_row<T>(dp, va[kk], gs, kk, at.lane, kN * half);
      }
      #pragma unroll
      for (int n = 0; n < kN; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * (kN * half + n) + 2 * t + e % 2;
          const bool keep = !masked || (c >= diag + 8 * (e / 2) && c < valid);
          const float p = keep ? exp2f(s[n][e] * sl2 - ls[c]) : 0.0f;
          s[n][e] = p;
          dp[n][e] = p * (dp[n][e] - dl[c]);  // ds
        }
      mma_acc<T>(dv, s, gt, kN / 2 * half, at.lane);
      mma_acc<T>(dk, dp, qt, kN / 2 * half, at.lane);  // dp holds ds
    }
  }
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = at.r0 + 8 * r;
    if (row >= rows) continue;
    T* out = dqkv + (at.b * rows + row) * at.stride + at.h * D + 2 * t;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      out[at.C + 8 * n] = DevElem<T>::store(dk[n][2 * r] * scale);
      out[at.C + 8 * n + 1] = DevElem<T>::store(dk[n][2 * r + 1] * scale);
      out[2 * at.C + 8 * n] = DevElem<T>::store(dv[n][2 * r]);
      out[2 * at.C + 8 * n + 1] = DevElem<T>::store(dv[n][2 * r + 1]);
    }
  }
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

dim3 attention_grid(const Dims& d) {
  if (d.B * d.H > 65535) throw std::invalid_argument("attention: more than 65535 batch x heads");
  return dim3(static_cast<unsigned>((d.T + kRows - 1) / kRows), static_cast<unsigned>(d.B * d.H));
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
    AMP_LAUNCH(attention_grid(d), kThreads, 0, ctx.stream(), attention_forward_kernel<T, decltype(dim)::value>)(
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
  for (const auto& [t, what] : {std::pair<const Tensor*, const char*>{&qkv, "qkv"}, {&y, "y"}, {&gy, "gy"}, {&dqkv, "dqkv"}})
    check_aligned(*t, what);
  if (d.B * d.T == 0) return;
  Context& ctx = context();
  if (which == FusedAttention::cudnn) {
    const cudnn_sdpa::Shape s = sdpa_shape(d, qkv.dtype(), scale);
    const Scratch workspace(cudnn_sdpa::backward_workspace(s, ctx.stream()));
    cudnn_sdpa::backward(s, ctx.stream(), qkv.data_ptr(), y.data_ptr(), gy.data_ptr(), lse.data<float>(),
                         dqkv.data_ptr(), workspace.as<void>());
    return;
  }
  Scratch delta(sizeof(float) * static_cast<size_t>(d.B * d.H * d.T));
  dispatch_attention(qkv.dtype(), d.D, [&](auto T_tag, auto dim) { using T = decltype(T_tag);
    const int64_t es = static_cast<int64_t>(sizeof(T)), pairs = d.B * d.H * d.T * (d.T + 1) / 2;
    const int64_t stats = 4 * d.B * d.H * d.T;
    declare_launch_cost(d.B * d.T * (2 * d.C + 2 * d.C) * es + stats, d.B * d.T * d.C * es + stats, 6 * pairs * d.D);
    AMP_LAUNCH(attention_grid(d), kThreads, 0, ctx.stream(), attention_dq_kernel<T, decltype(dim)::value>)(
        qkv.data<T>(), y.data<T>(), lse.data<float>(), gy.data<T>(), d.T, d.H, static_cast<float>(scale),
        delta.as<float>(), dqkv.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
    declare_launch_cost(d.B * d.T * (3 * d.C + d.C) * es + 2 * stats, 2 * d.B * d.T * d.C * es, 8 * pairs * d.D);
    AMP_LAUNCH(attention_grid(d), kThreads, 0, ctx.stream(), attention_dkdv_kernel<T, decltype(dim)::value>)(
        qkv.data<T>(), lse.data<float>(), gy.data<T>(), delta.as<float>(), d.T, d.H, static_cast<float>(scale),
        dqkv.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace amp::cuda
