// CPU GEMMs: oneDNN for fp32 and bf16 (fp32 accumulate; its JIT kernels beat OpenBLAS's on the
// transformer's small shapes by a third), a plain loop for fp64 (tests only), and fp16 emulated like a
// tensor core: inputs are already fp16, products are accumulated in fp32, the output is rounded once.

#include <algorithm>
#include <dnnl.hpp>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "runtime/kernels/cpu/cpu_backend.h"
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

// oneDNN primitives are costly to create: one per problem, cached for the life of the process.
// A batch of GEMMs is one primitive over 3-D operands: oneDNN spreads the batch over the threads,
// where a loop of small GEMMs would fork and join the threads once per GEMM.
struct DnnlGemmCache {
  using dt = dnnl::memory::data_type;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // in, out and bias (undef: none) types, trans_a, trans_b, batch, m, n, k, alpha, beta
  using Key = std::tuple<dt, dt, dt, bool, bool, int64_t, int64_t, int64_t, int64_t, float, float>;
  struct Entry {
    dnnl::matmul::primitive_desc pd;
    dnnl::matmul prim;
  };
  std::map<Key, Entry> primitives;
  std::mutex mutex;

  const Entry& get(const Key& key) {
    auto it = primitives.find(key);
    if (it != primitives.end()) return it->second;
    const auto [in, out, bias, ta, tb, batch, m, n, k, alpha, beta] = key;
    // Row-major [rows, cols] operands, transposed ones read through swapped strides; a batch adds
    // a leading dimension of whole matrices.
    auto desc = [batch = batch](int64_t rows, int64_t cols, bool t, dt type) {
      const dnnl::memory::dims strides = t ? dnnl::memory::dims{1, rows} : dnnl::memory::dims{cols, 1};
      if (batch == 1) return dnnl::memory::desc({rows, cols}, type, strides);
      return dnnl::memory::desc({batch, rows, cols}, type, {rows * cols, strides[0], strides[1]});
    };
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    const dnnl::matmul::desc d = bias == dt::undef
                                     ? dnnl::matmul::desc(desc(m, k, ta, in), desc(k, n, tb, in), desc(m, n, false, out))
                                     : dnnl::matmul::desc(desc(m, k, ta, in), desc(k, n, tb, in), desc(1, n, false, bias),
                                                          desc(m, n, false, out));
    const dnnl::matmul::primitive_desc pd(d, attr, engine);
    return primitives.emplace(key, Entry{pd, dnnl::matmul(pd)}).first->second;
  }

  // oneDNN's bf16 kernels need AVX-512 (avx512_core): on another CPU (AVX2 only) creating the
  // primitive fails, and the GEMM runs as the fp32 GEMM of the widened operands (exact), which
  // accumulates in fp32 as the bf16 kernels do, its bf16 output rounded once.
  std::map<Key, bool> bf16_kernel;
  bool has_kernel(const Key& key) {
    auto it = bf16_kernel.find(key);
    if (it != bf16_kernel.end()) return it->second;
    bool ok = true;
    try {
      get(key);
    } catch (const dnnl::error&) {
      ok = false;
    }
    return bf16_kernel.emplace(key, ok).first->second;
  }
  void run(const Key& key, const void* a, const void* b, void* c, const void* bias = nullptr) {
    std::lock_guard<std::mutex> lock(mutex);
    if (std::get<0>(key) == dt::bf16 && !has_kernel(key)) return run_widened(key, a, b, c, bias);
    execute(key, a, b, c, bias);
  }

 private:
  static std::vector<float> widened(const void* p, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    const auto* s = static_cast<const BFloat16*>(p);
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = Elem<BFloat16>::load(s[i]);
    return out;
  }
  void run_widened(const Key& key, const void* a, const void* b, void* c, const void* bias) {
    const auto [in, out, bias_t, ta, tb, batch, m, n, k, alpha, beta] = key;
    const std::vector<float> wa = widened(a, batch * m * k), wb = widened(b, batch * k * n);
    const std::vector<float> wbias = bias ? widened(bias, n) : std::vector<float>();
    const Key wide{dt::f32, dt::f32, bias ? dt::f32 : dt::undef, ta, tb, batch, m, n, k, alpha, beta};
    if (out == dt::f32) return execute(wide, wa.data(), wb.data(), c, bias ? wbias.data() : nullptr);
    const int64_t total = batch * m * n;
    std::vector<float> wc = beta != 0.0f ? widened(c, total) : std::vector<float>(static_cast<size_t>(total));
    execute(wide, wa.data(), wb.data(), wc.data(), bias ? wbias.data() : nullptr);
    auto* dst = static_cast<BFloat16*>(c);
#pragma omp parallel for schedule(static) if (total > cpu::kParallelGrain)
    for (int64_t i = 0; i < total; ++i) dst[i] = Elem<BFloat16>::store(wc[static_cast<size_t>(i)]);
  }
  void execute(const Key& key, const void* a, const void* b, void* c, const void* bias) {
    const auto& [pd, prim] = get(key);
    std::unordered_map<int, dnnl::memory> args = {{DNNL_ARG_SRC, {pd.src_desc(), engine, const_cast<void*>(a)}},
                                                  {DNNL_ARG_WEIGHTS, {pd.weights_desc(), engine, const_cast<void*>(b)}},
                                                  {DNNL_ARG_DST, {pd.dst_desc(), engine, c}}};
    if (bias) args.insert({DNNL_ARG_BIAS, {pd.bias_desc(), engine, const_cast<void*>(bias)}});
    prim.execute(stream, args);
    stream.wait();
  }
};

DnnlGemmCache& dnnl_cache() {
  static DnnlGemmCache c;
  return c;
}

// fp16 or other narrow inputs widened to fp32 (exact), for the emulated tensor-core GEMM.
template <class T>
std::vector<float> widen(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  const T* s = t.data<T>();
  const long n = static_cast<long>(t.numel());
#pragma omp parallel for schedule(static) if (n > cpu::kParallelGrain)
  for (long i = 0; i < n; ++i) out[static_cast<size_t>(i)] = Elem<T>::load(s[i]);
  return out;
}

using dt = dnnl::memory::data_type;
// oneDNN's type for the dtypes it multiplies here (f32 and bf16); undef for the rest.
dt dnnl_type(DType t) { return t == DType::f32 ? dt::f32 : t == DType::bf16 ? dt::bf16 : dt::undef; }

// c = alpha op(a) op(b) + beta c in oneDNN, one matrix (fp32 inputs: also the widened fp16 GEMM).
void dnnl_gemm(dt in, dt out, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
               const void* b, float beta, void* c) {
  dnnl_cache().run({in, out, dt::undef, ta, tb, 1, m, n, k, alpha, beta}, a, b, c);
}

}  // namespace

void CpuBackend::gemm_batched(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  const auto [m, n, k] = check_gemm_batched(ta, tb, a, b, c);
  const int64_t batch = a.shape()[0];
  if (dnnl_type(a.dtype()) != dt::undef && batch > 0 && m * n * k > 0) {
    dnnl_cache().run({dnnl_type(a.dtype()), dnnl_type(c.dtype()), dt::undef, ta, tb, batch, m, n, k, alpha, beta},
                     a.data_ptr(), b.data_ptr(), c.data_ptr());
    return;
  }
  const Shape as(a.shape().begin() + 1, a.shape().end()), bs(b.shape().begin() + 1, b.shape().end());
  for (int64_t i = 0; i < batch; ++i) {
    Tensor ci = c.view(i * m * n, {m, n});
    gemm(ta, tb, alpha, a.view(i * m * k, as), b.view(i * k * n, bs), beta, ci);
  }
}

// oneDNN adds the bias to the fp32 accumulator before y's one rounding: the numbers of broadcasting
// it into y and accumulating onto it, without that pass over y.
void CpuBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  const auto [m, n, k] = check_gemm(false, true, x, w, y);
  const dt t = dnnl_type(x.dtype());
  const bool supported = t != dt::undef && y.dtype() == x.dtype() && bias.dtype() == x.dtype() && bias.numel() == n &&
                         m * n * k > 0;
  if (!supported) return Backend::linear_forward(x, w, bias, y);
  dnnl_cache().run({t, t, t, false, true, 1, m, n, k, 1.0f, 0.0f}, x.data_ptr(), w.data_ptr(), y.data_ptr(), bias.data_ptr());
}

void CpuBackend::gemm(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  const auto [m, n, k] = check_gemm(ta, tb, a, b, c);
  if (gemm_is_trivial(*this, m, n, k, beta, c)) return;
  switch (a.dtype()) {
    case DType::f32:
    case DType::bf16:  // fp32 accumulate; c is a's dtype or fp32
      dnnl_gemm(dnnl_type(a.dtype()), dnnl_type(c.dtype()), ta, tb, m, n, k, alpha, a.data_ptr(), b.data_ptr(), beta,
                c.data_ptr());
      return;
    case DType::f64:
      dgemm(ta, tb, m, n, k, alpha, a.data<double>(), b.data<double>(), beta, c.data<double>());
      return;
    case DType::f16: {
      const std::vector<float> wa = widen<Half>(a), wb = widen<Half>(b);
      if (c.dtype() == DType::f32) {
        dnnl_gemm(dt::f32, dt::f32, ta, tb, m, n, k, alpha, wa.data(), wb.data(), beta, c.data<float>());
        return;
      }
      std::vector<float> wc = beta != 0.0f ? widen<Half>(c) : std::vector<float>(static_cast<size_t>(m * n));
      dnnl_gemm(dt::f32, dt::f32, ta, tb, m, n, k, alpha, wa.data(), wb.data(), beta, wc.data());
      Half* out = c.data<Half>();
      const long total = static_cast<long>(m * n);
#pragma omp parallel for schedule(static) if (total > cpu::kParallelGrain)
      for (long i = 0; i < total; ++i) out[i] = Elem<Half>::store(wc[static_cast<size_t>(i)]);
      return;
    }
    default:
      throw std::invalid_argument(std::string("gemm: unsupported dtype ") + dtype_name(a.dtype()));
  }
}


}  // namespace amp
