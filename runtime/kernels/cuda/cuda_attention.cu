// CUDA backend: causal self-attention without the [T, T] scores in memory, in FlashAttention's order
// (Dao et al., 2022: a tile of keys at a time, the softmax kept online as a running maximum and sum,
// the backward recomputing the scores from each row's log-sum-exp). q, k and v are read where the
// qkv projection wrote them ([B, T, 3C], heads side by side) and y is written as [B, T, C]: no head
// permutes. Everything is fp32 inside; every output element is written once (no atomics), so the
// results are deterministic.
//
// A block is kWarps warps over kWarps consecutive rows (one warp a row: query rows in the forward
// and the dq pass, key rows in the dk/dv pass), sharing tiles of kTile rows of the other side in
// shared memory; lane l takes row l of the tile for the dot products over the head's D dims, and
// dims l, l + 32, ... for the sums into the row's outputs.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"

namespace amp::cuda {

namespace {

constexpr int kWarps = 8;
constexpr int kTile = 32;
constexpr int kThreads = 32 * kWarps;

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Rows [first, first + kTile) of one of q, k, v (col: 0, C or 2C) into a tile (0 past the end).
template <class T, int D>
__device__ void load_tile(const T* base, int64_t first, int64_t rows, int64_t stride, float (&tile)[kTile][D + 1]) {
  for (int e = static_cast<int>(threadIdx.x); e < kTile * D; e += kThreads) {
    const int r = e / D, d = e % D;
    const int64_t row = first + r;
    tile[r][d] = row < rows ? static_cast<float>(DevElem<T>::load(base[row * stride + d])) : 0.0f;
  }
}

// Where a block stands, a warp a row: batch b and head h (blockIdx.y), rows [first, first + kWarps)
// (blockIdx.x; last: the last of them that exists), the calling warp's row, and the head's D columns
// in qkv, whose rows hold q, k and v (C columns each: stride 3C).
template <int D>
struct BlockRows {
  int lane, warp;
  int64_t bh, b, h, C, stride, first, row, last;
  __device__ BlockRows(int64_t rows, int64_t heads)
      : lane(static_cast<int>(threadIdx.x) % 32), warp(static_cast<int>(threadIdx.x) / 32), bh(blockIdx.y),
        b(bh / heads), h(bh % heads), C(heads * D), stride(3 * C), first(static_cast<int64_t>(blockIdx.x) * kWarps),
        row(first + warp), last((first + kWarps < rows ? first + kWarps : rows) - 1) {}
  // Row 0 of this batch's q (part 0), k (1) or v (2) for this head.
  template <class T>
  __device__ const T* head(const T* qkv, int64_t rows, int part) const {
    return qkv + b * rows * stride + part * C + h * D;
  }
};

// D values into registers (0 for a row past the end).
template <class T, int D>
__device__ __forceinline__ void load_row(const T* p, bool valid, float (&out)[D]) {
  #pragma unroll
  for (int d = 0; d < D; ++d) out[d] = valid ? static_cast<float>(DevElem<T>::load(p[d])) : 0.0f;
}

// y[b, i, h] = softmax_j<=i(scale q_i . k_j) v_j, and lse[b, h, i] = log sum_j<=i exp(scale q_i . k_j).
template <class T, int DPL>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(const T* qkv, int64_t rows, int64_t heads, float scale, T* y, float* lse) {
  constexpr int D = 32 * DPL;
  AMP_SHARED(float[kTile][D + 1], ks);
  AMP_SHARED(float[kTile][D + 1], vs);
  const BlockRows<D> at(rows, heads);
  const int lane = at.lane;
  const int64_t i = at.row, stride = at.stride;
  float q[D];
  load_row<T, D>(at.head(qkv, rows, 0) + i * stride, i < rows, q);
  float m = -INFINITY, l = 0.0f, o[DPL];
  #pragma unroll
  for (int k = 0; k < DPL; ++k) o[k] = 0.0f;
  for (int64_t j0 = 0; j0 <= at.last; j0 += kTile) {  // keys up to the block's last row
    __syncthreads();  // the last tile's reads are done
    load_tile<T, D>(at.head(qkv, rows, 1), j0, rows, stride, ks);
    load_tile<T, D>(at.head(qkv, rows, 2), j0, rows, stride, vs);
    __syncthreads();
    const int64_t j = j0 + lane;
    float s = -INFINITY;
    if (i < rows && j <= i) {
      float dot = 0.0f;
      #pragma unroll
      for (int d = 0; d < D; ++d) dot += q[d] * ks[lane][d];
      s = dot * scale;
    }
    const float tile_max = warp_max(s);
    if (tile_max == -INFINITY) continue;  // every key of this tile is after row i (the whole warp agrees)
    const float m_new = fmaxf(m, tile_max);
    const float p = s == -INFINITY ? 0.0f : expf(s - m_new);
    const float rescale = expf(m - m_new);  // 0 on the first tile (m = -inf)
    l = l * rescale + warp_sum(p);
    #pragma unroll
    for (int k = 0; k < DPL; ++k) o[k] *= rescale;
    #pragma unroll
    for (int r = 0; r < kTile; ++r) {
      const float pr = __shfl_sync(0xffffffffu, p, r);
      #pragma unroll
      for (int k = 0; k < DPL; ++k) o[k] += pr * vs[r][lane + 32 * k];
    }
    m = m_new;
  }
  if (i < rows) {
    T* out = y + (at.b * rows + i) * at.C + at.h * D;
    #pragma unroll
    for (int k = 0; k < DPL; ++k) out[lane + 32 * k] = DevElem<T>::store(o[k] / l);
    if (lane == 0) lse[at.bh * rows + i] = m + logf(l);
  }
}

// The backward's first pass, a warp per query row i: delta_i = gy_i . y_i (kept for the second
// pass), and dq_i = scale sum_j ds_ij k_j with p_ij = exp(scale q_i . k_j - lse_i),
// ds_ij = p_ij (gy_i . v_j - delta_i).
template <class T, int DPL>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(const T* qkv, const T* y, const float* lse, const T* gy, int64_t rows, int64_t heads,
                        float scale, float* delta, T* dqkv) {
  constexpr int D = 32 * DPL;
  AMP_SHARED(float[kTile][D + 1], ks);
  AMP_SHARED(float[kTile][D + 1], vs);
  const BlockRows<D> at(rows, heads);
  const int lane = at.lane;
  const int64_t i = at.row, stride = at.stride, bh = at.bh;
  const int64_t yrow = (at.b * rows + i) * at.C + at.h * D;
  float q[D], g[D];
  load_row<T, D>(at.head(qkv, rows, 0) + i * stride, i < rows, q);
  load_row<T, D>(gy + yrow, i < rows, g);
  float part = 0.0f;
  #pragma unroll
  for (int k = 0; k < DPL; ++k)
    if (i < rows)  // gy re-read, not g[lane + ...]: a lane-dependent index would put g in local memory
      part += static_cast<float>(DevElem<T>::load(gy[yrow + lane + 32 * k])) *
              static_cast<float>(DevElem<T>::load(y[yrow + lane + 32 * k]));
  const float di = warp_sum(part);
  const float li = i < rows ? lse[bh * rows + i] : 0.0f;
  float dq[DPL];
  #pragma unroll
  for (int k = 0; k < DPL; ++k) dq[k] = 0.0f;
  for (int64_t j0 = 0; j0 <= at.last; j0 += kTile) {
    __syncthreads();
    load_tile<T, D>(at.head(qkv, rows, 1), j0, rows, stride, ks);
    load_tile<T, D>(at.head(qkv, rows, 2), j0, rows, stride, vs);
    __syncthreads();
    const int64_t j = j0 + lane;
    float ds = 0.0f;
    if (i < rows && j <= i) {
      float s = 0.0f, dp = 0.0f;
      #pragma unroll
      for (int d = 0; d < D; ++d) {
        s += q[d] * ks[lane][d];
        dp += g[d] * vs[lane][d];
      }
      ds = expf(s * scale - li) * (dp - di);
    }
    #pragma unroll
    for (int r = 0; r < kTile; ++r) {
      const float dsr = __shfl_sync(0xffffffffu, ds, r);
      #pragma unroll
      for (int k = 0; k < DPL; ++k) dq[k] += dsr * ks[r][lane + 32 * k];
    }
  }
  if (i < rows) {
    #pragma unroll
    for (int k = 0; k < DPL; ++k) dqkv[(at.b * rows + i) * stride + at.h * D + lane + 32 * k] = DevElem<T>::store(dq[k] * scale);
    if (lane == 0) delta[bh * rows + i] = di;
  }
}

// The second pass, a warp per key row j: dv_j = sum_i>=j p_ij gy_i, dk_j = scale sum_i>=j ds_ij q_i.
template <class T, int DPL>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(const T* qkv, const float* lse, const T* gy, const float* delta, int64_t rows,
                          int64_t heads, float scale, T* dqkv) {
  constexpr int D = 32 * DPL;
  AMP_SHARED(float[kTile][D + 1], qs);
  AMP_SHARED(float[kTile][D + 1], gs);
  AMP_SHARED(float[kTile], ls);
  AMP_SHARED(float[kTile], dl);
  const BlockRows<D> at(rows, heads);
  const int lane = at.lane;
  const int64_t j = at.row, stride = at.stride, bh = at.bh, C = at.C;
  const T* gbase = gy + at.b * rows * C + at.h * D;
  float kr[D], vr[D];
  load_row<T, D>(at.head(qkv, rows, 1) + j * stride, j < rows, kr);
  load_row<T, D>(at.head(qkv, rows, 2) + j * stride, j < rows, vr);
  float dk[DPL], dv[DPL];
  #pragma unroll
  for (int k = 0; k < DPL; ++k) dk[k] = dv[k] = 0.0f;
  for (int64_t i0 = at.first; i0 < rows; i0 += kTile) {  // queries from the block's first key row on
    __syncthreads();
    load_tile<T, D>(at.head(qkv, rows, 0), i0, rows, stride, qs);
    load_tile<T, D>(gbase, i0, rows, C, gs);
    if (static_cast<int>(threadIdx.x) < kTile) {
      const int t = static_cast<int>(threadIdx.x);
      const int64_t r = i0 + t;
      ls[t] = r < rows ? lse[bh * rows + r] : 0.0f;
      dl[t] = r < rows ? delta[bh * rows + r] : 0.0f;
    }
    __syncthreads();
    const int64_t i = i0 + lane;
    float p = 0.0f, ds = 0.0f;
    if (j < rows && i < rows && i >= j) {
      float s = 0.0f, dp = 0.0f;
      #pragma unroll
      for (int d = 0; d < D; ++d) {
        s += qs[lane][d] * kr[d];
        dp += gs[lane][d] * vr[d];
      }
      p = expf(s * scale - ls[lane]);
      ds = p * (dp - dl[lane]);
    }
    #pragma unroll
    for (int r = 0; r < kTile; ++r) {
      const float pr = __shfl_sync(0xffffffffu, p, r), dsr = __shfl_sync(0xffffffffu, ds, r);
      #pragma unroll
      for (int k = 0; k < DPL; ++k) {
        dv[k] += pr * gs[r][lane + 32 * k];
        dk[k] += dsr * qs[r][lane + 32 * k];
      }
    }
  }
  if (j < rows) {
    T* out = dqkv + (at.b * rows + j) * stride + at.h * D;
    #pragma unroll
    for (int k = 0; k < DPL; ++k) {
      out[C + lane + 32 * k] = DevElem<T>::store(dk[k] * scale);
      out[2 * C + lane + 32 * k] = DevElem<T>::store(dv[k]);
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

// Calls f(T{}, std::integral_constant<int, DPL>{}) for qkv's dtype and head size.
template <class F>
void dispatch_attention(DType dtype, int64_t head_dim, F&& f) {
  auto by_dim = [&](auto T_tag) {
    if (head_dim == 32) f(T_tag, std::integral_constant<int, 1>{});
    else f(T_tag, std::integral_constant<int, 2>{});
  };
  switch (dtype) {
    case DType::f32: by_dim(float{}); break;
    case DType::bf16: by_dim(BFloat16{}); break;
    case DType::f16: by_dim(Half{}); break;
    default: throw std::invalid_argument("attention: unsupported dtype");
  }
}

dim3 attention_grid(const Dims& d) {
  if (d.B * d.H > 65535) throw std::invalid_argument("attention: more than 65535 batch x heads");
  return dim3(static_cast<unsigned>((d.T + kWarps - 1) / kWarps), static_cast<unsigned>(d.B * d.H));
}

}  // namespace

bool CudaBackend::has_fused_attention(DType dtype, int64_t head_dim) const {
  return (dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16) && (head_dim == 32 || head_dim == 64);
}

void CudaBackend::attention_forward(const Tensor& qkv, int64_t n_head, double scale, Tensor& y, Tensor& lse) {
  require_cuda(qkv, "attention: qkv");
  const Dims d = attention_dims(qkv, n_head);
  if (!has_fused_attention(qkv.dtype(), d.D)) throw std::invalid_argument("attention: no fused kernel for this dtype and head size");
  check_shape(y, {d.B, d.T, d.C}, qkv.dtype(), "y");
  check_shape(lse, {d.B, d.H, d.T}, DType::f32, "lse");
  if (d.B * d.T == 0) return;
  Context& ctx = context();
  dispatch_attention(qkv.dtype(), d.D, [&](auto T_tag, auto dpl) { using T = decltype(T_tag);
    const int64_t es = static_cast<int64_t>(sizeof(T)), pairs = d.B * d.H * d.T * (d.T + 1) / 2;
    declare_launch_cost(3 * d.B * d.T * d.C * es, d.B * d.T * d.C * es + 4 * d.B * d.H * d.T, 4 * pairs * d.D);
    AMP_LAUNCH(attention_grid(d), kThreads, 0, ctx.stream(), attention_forward_kernel<T, decltype(dpl)::value>)(
        qkv.data<T>(), d.T, d.H, static_cast<float>(scale), y.data<T>(), lse.data<float>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::attention_backward(const Tensor& qkv, const Tensor& y, const Tensor& lse, const Tensor& gy,
                                     int64_t n_head, double scale, Tensor& dqkv) {
  require_cuda(qkv, "attention: qkv");
  const Dims d = attention_dims(qkv, n_head);
  if (!has_fused_attention(qkv.dtype(), d.D)) throw std::invalid_argument("attention: no fused kernel for this dtype and head size");
  check_shape(y, {d.B, d.T, d.C}, qkv.dtype(), "y");
  check_shape(gy, {d.B, d.T, d.C}, qkv.dtype(), "gy");
  check_shape(lse, {d.B, d.H, d.T}, DType::f32, "lse");
  check_shape(dqkv, qkv.shape(), qkv.dtype(), "dqkv");
  if (d.B * d.T == 0) return;
  Context& ctx = context();
  Scratch delta(sizeof(float) * static_cast<size_t>(d.B * d.H * d.T));
  dispatch_attention(qkv.dtype(), d.D, [&](auto T_tag, auto dpl) { using T = decltype(T_tag);
    const int64_t es = static_cast<int64_t>(sizeof(T)), pairs = d.B * d.H * d.T * (d.T + 1) / 2;
    const int64_t stats = 4 * d.B * d.H * d.T;
    declare_launch_cost(d.B * d.T * (2 * d.C + 2 * d.C) * es + stats, d.B * d.T * d.C * es + stats, 6 * pairs * d.D);
    AMP_LAUNCH(attention_grid(d), kThreads, 0, ctx.stream(), attention_dq_kernel<T, decltype(dpl)::value>)(
        qkv.data<T>(), y.data<T>(), lse.data<float>(), gy.data<T>(), d.T, d.H, static_cast<float>(scale),
        delta.as<float>(), dqkv.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
    declare_launch_cost(d.B * d.T * (3 * d.C + d.C) * es + 2 * stats, 2 * d.B * d.T * d.C * es, 8 * pairs * d.D);
    AMP_LAUNCH(attention_grid(d), kThreads, 0, ctx.stream(), attention_dkdv_kernel<T, decltype(dpl)::value>)(
        qkv.data<T>(), lse.data<float>(), gy.data<T>(), delta.as<float>(), d.T, d.H, static_cast<float>(scale),
        dqkv.data<T>());
    AMP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace amp::cuda
