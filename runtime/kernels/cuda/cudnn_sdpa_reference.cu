// cudnn_sdpa.h on the emulated GPU (preset cuda-emu, where CMake picks this file): a stand-in for
// the library, so that the trainer's path, CUDA graphs and determinism are tested in CI. Exact
// causal attention as plain kernels, one thread a query (or key) row: the scores, their softmax and
// the products in double, each result rounded once to float, then to the dtype. Deterministic by
// construction (no atomics; every sum in a fixed order). The backward takes a workspace, each row's
// dO . O (what cuDNN's backward keeps), so that the backend's workspace from its allocator is used.
// The library's rules for a shape's graphs are kept: built at its first call, never during a
// capture, no sequences of one token. Its kernels are named cudnn_reference_*: the cost model prices
// them at cuDNN's measured rates.
//
// AMP_EMU_CUDNN=0 makes the library absent (the tests of --attention auto's fallback and of
// --attention cudnn's refusal).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/cudnn_sdpa.h"
#include "runtime/kernels/cuda/device_elem.cuh"

namespace amp::cudnn_sdpa {
namespace {

using cuda::DevElem;

constexpr int kMaxHead = 128;

bool switched_off() {
  const char* v = std::getenv("AMP_EMU_CUDNN");
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// Where element d of row t, head h, lies: in qkv's part p (0 q, 1 k, 2 v), or in a [B, T, C] tensor.
struct Layout {
  int64_t T, H, D;
  __device__ int64_t in(int64_t b, int64_t t, int64_t p, int64_t h, int64_t d) const {
    return (b * T + t) * 3 * H * D + p * H * D + h * D + d;
  }
  __device__ int64_t out(int64_t b, int64_t t, int64_t h, int64_t d) const { return (b * T + t) * H * D + h * D + d; }
};

template <class T>
__device__ double ld(const T* p, int64_t i) {
  return static_cast<double>(DevElem<T>::load(p[i]));
}
template <class T>
__device__ void st(T* p, int64_t i, double v) {
  p[i] = DevElem<T>::store(static_cast<float>(v));
}

// The scaled score of query i and key j.
template <class T>
__device__ double score(const T* qkv, const Layout& L, int64_t b, int64_t h, int64_t i, int64_t j, double scale) {
  double dot = 0.0;
  for (int64_t d = 0; d < L.D; ++d) dot += ld(qkv, L.in(b, i, 0, h, d)) * ld(qkv, L.in(b, j, 1, h, d));
  return scale * dot;
}

template <class T>
__global__ void cudnn_reference_forward_kernel(const T* qkv, int64_t B, Layout L, double scale, T* y, float* stats) {
  AMP_GRID_STRIDE(row, B * L.H * L.T) {
    const int64_t b = row / (L.H * L.T), h = row / L.T % L.H, i = row % L.T;
    double m = -INFINITY, l = 0.0, acc[kMaxHead] = {};
    for (int64_t j = 0; j <= i; ++j) m = fmax(m, score(qkv, L, b, h, i, j, scale));
    for (int64_t j = 0; j <= i; ++j) {
      const double p = exp(score(qkv, L, b, h, i, j, scale) - m);
      l += p;
      for (int64_t d = 0; d < L.D; ++d) acc[d] += p * ld(qkv, L.in(b, j, 2, h, d));
    }
    stats[row] = static_cast<float>(m + log(l));
    for (int64_t d = 0; d < L.D; ++d) st(y, L.out(b, i, h, d), acc[d] / l);
  }
}

// Row i's dO . O, into the workspace.
template <class T>
__global__ void cudnn_reference_backward_delta_kernel(const T* y, const T* gy, int64_t B, Layout L, float* delta) {
  AMP_GRID_STRIDE(row, B * L.H * L.T) {
    const int64_t b = row / (L.H * L.T), h = row / L.T % L.H, i = row % L.T;
    double s = 0.0;
    for (int64_t d = 0; d < L.D; ++d) s += ld(gy, L.out(b, i, h, d)) * ld(y, L.out(b, i, h, d));
    delta[row] = static_cast<float>(s);
  }
}

// p_ij from the forward's stats, and ds_ij = p_ij (dO_i . v_j - delta_i).
template <class T>
__device__ void probability(const T* qkv, const T* gy, const float* stats, const float* delta, const Layout& L,
                            int64_t b, int64_t h, int64_t i, int64_t j, double scale, double* p, double* ds) {
  const int64_t r = (b * L.H + h) * L.T + i;
  *p = exp(score(qkv, L, b, h, i, j, scale) - static_cast<double>(stats[r]));
  double dp = 0.0;
  for (int64_t d = 0; d < L.D; ++d) dp += ld(gy, L.out(b, i, h, d)) * ld(qkv, L.in(b, j, 2, h, d));
  *ds = *p * (dp - static_cast<double>(delta[r]));
}

// dq_i = scale sum_{j <= i} ds_ij k_j.
template <class T>
__global__ void cudnn_reference_backward_dq_kernel(const T* qkv, const T* gy, const float* stats, const float* delta,
                                                   int64_t B, Layout L, double scale, T* dqkv) {
  AMP_GRID_STRIDE(row, B * L.H * L.T) {
    const int64_t b = row / (L.H * L.T), h = row / L.T % L.H, i = row % L.T;
    double acc[kMaxHead] = {};
    for (int64_t j = 0; j <= i; ++j) {
      double p, ds;
      probability(qkv, gy, stats, delta, L, b, h, i, j, scale, &p, &ds);
      for (int64_t d = 0; d < L.D; ++d) acc[d] += ds * ld(qkv, L.in(b, j, 1, h, d));
    }
    for (int64_t d = 0; d < L.D; ++d) st(dqkv, L.in(b, i, 0, h, d), scale * acc[d]);
  }
}

// dk_j = scale sum_{i >= j} ds_ij q_i; dv_j = sum_{i >= j} p_ij dO_i.
template <class T>
__global__ void cudnn_reference_backward_dkdv_kernel(const T* qkv, const T* gy, const float* stats, const float* delta,
                                                     int64_t B, Layout L, double scale, T* dqkv) {
  AMP_GRID_STRIDE(row, B * L.H * L.T) {
    const int64_t b = row / (L.H * L.T), h = row / L.T % L.H, j = row % L.T;
    double dk[kMaxHead] = {}, dv[kMaxHead] = {};
    for (int64_t i = j; i < L.T; ++i) {
      double p, ds;
      probability(qkv, gy, stats, delta, L, b, h, i, j, scale, &p, &ds);
      for (int64_t d = 0; d < L.D; ++d) {
        dk[d] += ds * ld(qkv, L.in(b, i, 0, h, d));
        dv[d] += p * ld(gy, L.out(b, i, h, d));
      }
    }
    for (int64_t d = 0; d < L.D; ++d) {
      st(dqkv, L.in(b, j, 1, h, d), scale * dk[d]);
      st(dqkv, L.in(b, j, 2, h, d), dv[d]);
    }
  }
}

template <class F>
void dispatch(DType dtype, F&& f) {
  if (dtype == DType::bf16) f(BFloat16{});
  else if (dtype == DType::f16) f(Half{});
  else throw std::invalid_argument("cuDNN (emulated): bf16 or fp16 only");
}

// The library's rules for a shape's graphs (cudnn_sdpa.h).
void build_rules(const Shape& s, cudaStream_t stream) {
  static std::mutex mutex;
  static std::vector<Shape> built;
  if (s.T == 1) throw std::runtime_error("cuDNN's attention: its backward does not take sequences of one token");
  std::lock_guard<std::mutex> lock(mutex);
  if (std::find(built.begin(), built.end(), s) != built.end()) return;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone)
    throw std::runtime_error("cuDNN's attention: a shape first met while a CUDA graph is captured (B " +
                             std::to_string(s.B) + ", T " + std::to_string(s.T) +
                             "): its graphs are built in an eager step before the capture");
  built.push_back(s);
}

int64_t pairs(const Shape& s) { return s.B * s.H * s.T * (s.T + 1) / 2; }

}  // namespace

std::string unavailable(DType dtype, int64_t head_dim) {
  if (switched_off()) return "libcudnn.so.9 was not found (the emulated GPU's stand-in is off: AMP_EMU_CUDNN=0)";
  return unsupported_shape(dtype, head_dim);
}

std::string describe() {
  return switched_off() ? "no cuDNN (the emulated GPU's stand-in is off: AMP_EMU_CUDNN=0)"
                        : "cuDNN stand-in (the emulated GPU: exact attention in double)";
}

size_t forward_workspace(const Shape& s, cudaStream_t stream) {
  build_rules(s, stream);
  return 0;
}

// The library's: each row's dO . O (B H T floats, at its start; the stand-in's kernels use only
// these), then the deterministic backward's dS, B H T^2 elements of 2 bytes (T padded to 64): on a
// Hopper GPU, cudnn-frontend 1.19 (launch/setup.sh's pin) builds a deterministic backward by keeping
// dS in the workspace and taking dQ as a product of its own. So the emulated GPU's step holds what a
// GPU's would, and the dry run's memory is the GPU's.
size_t backward_workspace(const Shape& s, cudaStream_t stream) {
  build_rules(s, stream);
  const int64_t padded = (s.T + 63) / 64 * 64;
  return static_cast<size_t>(s.B * s.H * s.T) * sizeof(float) + static_cast<size_t>(s.B * s.H * padded * padded) * 2;
}

void forward(const Shape& s, cudaStream_t stream, const void* qkv, void* y, float* stats, void*) {
  const Layout L{s.T, s.H, s.D};
  const int64_t rows = s.B * s.H * s.T, C = s.H * s.D, tokens = s.B * s.T;
  dispatch(s.dtype, [&](auto tag) { using T = decltype(tag);
    cuda::declare_launch_cost(3 * tokens * C * 2, tokens * C * 2 + 4 * rows, 4 * pairs(s) * s.D);
    AMP_LAUNCH(cuda::grid_for(rows, cuda::context().sm_count()), cuda::kBlock, 0, stream, cudnn_reference_forward_kernel<T>)(
        static_cast<const T*>(qkv), s.B, L, static_cast<double>(s.scale), static_cast<T*>(y), stats);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

void backward(const Shape& s, cudaStream_t stream, const void* qkv, const void* y, const void* gy, const float* stats,
              void* dqkv, void* workspace) {
  const Layout L{s.T, s.H, s.D};
  const int64_t rows = s.B * s.H * s.T, C = s.H * s.D, tokens = s.B * s.T;
  const unsigned grid = cuda::grid_for(rows, cuda::context().sm_count());
  float* delta = static_cast<float*>(workspace);
  dispatch(s.dtype, [&](auto tag) { using T = decltype(tag);
    const T *x = static_cast<const T*>(qkv), *g = static_cast<const T*>(gy);
    T* dx = static_cast<T*>(dqkv);
    cuda::declare_launch_cost(2 * tokens * C * 2, 4 * rows, 2 * rows * s.D);
    AMP_LAUNCH(grid, cuda::kBlock, 0, stream, cudnn_reference_backward_delta_kernel<T>)(
        static_cast<const T*>(y), g, s.B, L, delta);
    AMP_CUDA_CHECK_LAUNCH();
    // The library's traffic, not the stand-in's: its dk/dv kernel writes dS (2 bytes a causal pair),
    // and its dQ product reads it back.
    const int64_t dS = 2 * pairs(s);
    cuda::declare_launch_cost(tokens * (3 * C + C) * 2 + 8 * rows + dS, tokens * C * 2, 4 * pairs(s) * s.D);
    AMP_LAUNCH(grid, cuda::kBlock, 0, stream, cudnn_reference_backward_dq_kernel<T>)(x, g, stats, delta, s.B, L,
                                                                                    static_cast<double>(s.scale), dx);
    AMP_CUDA_CHECK_LAUNCH();
    cuda::declare_launch_cost(tokens * (3 * C + C) * 2 + 8 * rows, 2 * tokens * C * 2 + dS, 6 * pairs(s) * s.D);
    AMP_LAUNCH(grid, cuda::kBlock, 0, stream, cudnn_reference_backward_dkdv_kernel<T>)(x, g, stats, delta, s.B, L,
                                                                                      static_cast<double>(s.scale), dx);
    AMP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace amp::cudnn_sdpa
