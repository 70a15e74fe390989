// CPU GEMMs: fp32 on oneDNN's kernels (its JIT kernels beat OpenBLAS's on the transformer's small
// shapes by a third), cut by the shape so that any thread count gives the same bits
// (cpu_tiled_gemm.h); bf16 in oneDNN's bf16 kernels where the CPU has them (AVX-512), elsewhere and
// fp16 as a tensor core computes them: inputs widened to fp32 (exact), products accumulated in fp32,
// the output rounded once; fp64 a plain loop (tests only).

#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/kernels/cpu/cpu_backend.h"
#include "runtime/kernels/cpu/cpu_tiled_gemm.h"
#include "runtime/kernels/cpu/dispatch.h"
#include "runtime/kernels/gemm_check.h"

namespace amp {

namespace {
// fp64 GEMM, c = alpha op(a) op(b) + beta c, row-major: the dtype of gradient checks and test
// oracles (no training step runs it), so a plain loop, rows of c in parallel, each accumulated over
// k in order. beta = 0 ignores c (NaN there does not propagate), as BLAS does.
void dgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, const double* b,
           double beta, double* c) {
  const int64_t lda = ta ? m : k, ldb = tb ? k : n;
#pragma omp parallel if (m * n * k > cpu::kParallelGrain)
  {
    std::vector<double> acc(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? a[p * lda + i] : a[i * lda + p];
        if (tb) {
          for (int64_t j = 0; j < n; ++j) acc[static_cast<size_t>(j)] += av * b[j * ldb + p];
        } else {
          const double* row = b + p * ldb;
          for (int64_t j = 0; j < n; ++j) acc[static_cast<size_t>(j)] += av * row[j];
        }
      }
      double* out = c + i * n;
      for (int64_t j = 0; j < n; ++j)
        out[j] = alpha * acc[static_cast<size_t>(j)] + (beta == 0.0 ? 0.0 : beta * out[j]);
    }
  }
}

// Narrow inputs widened to fp32 (exact), and fp32 results rounded once into a narrow output.
template <class T>
std::vector<float> widen(const T* s, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = Elem<T>::load(s[i]);
  return out;
}
template <class T>
void narrow(const std::vector<float>& s, T* d) {
  const int64_t n = static_cast<int64_t>(s.size());
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
  for (int64_t i = 0; i < n; ++i) d[i] = Elem<T>::store(s[static_cast<size_t>(i)]);
}

// c = alpha op(a) op(b) + beta c (+ bias) for each of `batch` products, a and b of a narrow type T
// widened to fp32 (exact), multiplied and summed in fp32, c (fp32 or T) rounded once, as a tensor
// core computes them; bias (beta = 0) T.
template <class T>
void widened_gemm(bool ta, bool tb, int64_t batch, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a,
                  const Tensor& b, float beta, Tensor& c, const Tensor* bias) {
  using cpu::GemmType;
  const std::vector<float> wa = widen(a.data<T>(), a.numel()), wb = widen(b.data<T>(), b.numel());
  const std::vector<float> wbias = bias ? widen(bias->data<T>(), bias->numel()) : std::vector<float>();
  const float* pbias = bias ? wbias.data() : nullptr;
  if (c.dtype() == DType::f32)
    return cpu::tiled_gemm(GemmType::f32, GemmType::f32, ta, tb, batch, m, n, k, alpha, wa.data(), wb.data(), beta,
                           c.data_ptr(), pbias);
  std::vector<float> wc = beta != 0.0f ? widen(c.data<T>(), c.numel()) : std::vector<float>(static_cast<size_t>(c.numel()));
  cpu::tiled_gemm(GemmType::f32, GemmType::f32, ta, tb, batch, m, n, k, alpha, wa.data(), wb.data(), beta, wc.data(), pbias);
  narrow(wc, c.data<T>());
}

// fp32 and bf16 in oneDNN's kernels (bf16 where this CPU has them: AVX-512), fp16 widened.
void float_gemm(bool ta, bool tb, int64_t batch, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a,
                const Tensor& b, float beta, Tensor& c, const Tensor* bias = nullptr) {
  using cpu::GemmType;
  const void* pbias = bias ? bias->data_ptr() : nullptr;
  switch (a.dtype()) {
    case DType::f32:
      return cpu::tiled_gemm(GemmType::f32, GemmType::f32, ta, tb, batch, m, n, k, alpha, a.data_ptr(), b.data_ptr(),
                             beta, c.data_ptr(), pbias);
    case DType::bf16:
      if (!cpu::has_bf16_gemm()) return widened_gemm<BFloat16>(ta, tb, batch, m, n, k, alpha, a, b, beta, c, bias);
      return cpu::tiled_gemm(GemmType::bf16, c.dtype() == DType::f32 ? GemmType::f32 : GemmType::bf16, ta, tb, batch, m,
                             n, k, alpha, a.data_ptr(), b.data_ptr(), beta, c.data_ptr(), pbias);
    case DType::f16:
      return widened_gemm<Half>(ta, tb, batch, m, n, k, alpha, a, b, beta, c, bias);
    default:
      throw std::invalid_argument(std::string("gemm: unsupported dtype ") + dtype_name(a.dtype()));
  }
}

}  // namespace

void CpuBackend::gemm_batched(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  const auto [m, n, k] = check_gemm_batched(ta, tb, a, b, c);
  const int64_t batch = a.shape()[0];
  if (a.dtype() != DType::f64) return float_gemm(ta, tb, batch, m, n, k, alpha, a, b, beta, c);
  const Shape as(a.shape().begin() + 1, a.shape().end()), bs(b.shape().begin() + 1, b.shape().end());
  for (int64_t i = 0; i < batch; ++i) {
    Tensor ci = c.view(i * m * n, {m, n});
    gemm(ta, tb, alpha, a.view(i * m * k, as), b.view(i * k * n, bs), beta, ci);
  }
}

// The bias is added to the fp32 sum before y's one rounding, as broadcasting it into y and
// accumulating the product onto it does, without that pass over y. (Not always the same bits: where
// oneDNN sums k in several blocks, the accumulation adds the bias before the later blocks.)
void CpuBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  const auto [m, n, k] = check_gemm(false, true, x, w, y);
  const DType t = x.dtype();
  const bool supported = (t == DType::f32 || t == DType::bf16 || t == DType::f16) && y.dtype() == t &&
                         bias.dtype() == t && bias.numel() == n && m * n * k > 0;
  if (!supported) return Backend::linear_forward(x, w, bias, y);
  float_gemm(false, true, 1, m, n, k, 1.0f, x, w, 0.0f, y, &bias);
}

void CpuBackend::gemm(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  const auto [m, n, k] = check_gemm(ta, tb, a, b, c);
  if (gemm_is_trivial(*this, m, n, k, beta, c)) return;
  if (a.dtype() != DType::f64) return float_gemm(ta, tb, 1, m, n, k, alpha, a, b, beta, c);
  dgemm(ta, tb, m, n, k, alpha, a.data<double>(), b.data<double>(), beta, c.data<double>());
}

}  // namespace amp
