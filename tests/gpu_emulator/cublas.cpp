// The emulated GPU's cuBLAS (see cublas_v2.h for the checks and the arithmetic): handles hold a
// stream, a workspace and a math mode; cublasGemmEx validates at call time, reads alpha and beta
// from the host, and enqueues the GEMM as one operation on the handle's stream.
#include "cublas_v2.h"
#include "cublasLt.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "device.h"
#include "emu.h"
#include "launch_log.h"
#include "runtime/core/half.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t mode = CUBLAS_DEFAULT_MATH;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

namespace amp::emu {
namespace {

std::mutex g_mutex;
std::set<cublasContext*> g_handles;  // live handles: a destroyed one is NOT_INITIALIZED

bool live(cublasHandle_t h) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return h != nullptr && g_handles.count(h) != 0;
}

size_t type_size(cudaDataType t) { return t == CUDA_R_64F ? 8 : t == CUDA_R_32F ? 4 : 2; }
const char* type_name(cudaDataType t) {
  switch (t) {
    case CUDA_R_16F: return "f16";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_32F: return "f32";
    case CUDA_R_64F: return "f64";
  }
  return "?";
}

// Element i of an array of type t, widened (fp16/bf16/fp32 to float, fp64 to double).
template <class Acc>
Acc get(cudaDataType t, const void* p, size_t i) {
  switch (t) {
    case CUDA_R_16F: return static_cast<Acc>(f16_bits_to_f32(static_cast<const uint16_t*>(p)[i]));
    case CUDA_R_16BF: return static_cast<Acc>(bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]));
    case CUDA_R_32F: return static_cast<Acc>(static_cast<const float*>(p)[i]);
    case CUDA_R_64F: return static_cast<Acc>(static_cast<const double*>(p)[i]);
  }
  return Acc{};
}
template <class Acc>
void put(cudaDataType t, void* p, size_t i, Acc v) {
  switch (t) {
    case CUDA_R_16F: static_cast<uint16_t*>(p)[i] = f32_to_f16_bits(static_cast<float>(v)); return;
    case CUDA_R_16BF: static_cast<uint16_t*>(p)[i] = f32_to_bf16_bits(static_cast<float>(v)); return;
    case CUDA_R_32F: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case CUDA_R_64F: static_cast<double*>(p)[i] = static_cast<double>(v); return;
  }
}
// v rounded to type t (and widened back).
float round_to(cudaDataType t, float v) {
  if (t == CUDA_R_16F) return f16_bits_to_f32(f32_to_f16_bits(v));
  if (t == CUDA_R_16BF) return bf16_bits_to_f32(f32_to_bf16_bits(v));
  return v;
}

// v with its mantissa rounded to TF32's 10 bits, to nearest with ties away from zero (PTX's
// cvt.rna.tf32.f32): what CUBLAS_COMPUTE_32F_FAST_TF32 feeds the tensor cores. inf and NaN pass.
float round_to_tf32(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u) return v;
  bits = (bits + 0x1000u) & ~0x1fffu;
  std::memcpy(&v, &bits, 4);
  return v;
}

// One operand: op(X) is rows x cols, X column-major with leading dimension ld.
struct Operand {
  const void* p;
  cudaDataType type;
  bool trans;
  int rows, cols, ld;  // of op(X)
  size_t elements() const {  // the extent of X in memory
    const size_t stored_rows = static_cast<size_t>(trans ? cols : rows), stored_cols = trans ? rows : cols;
    return stored_rows == 0 || stored_cols == 0 ? 0 : static_cast<size_t>(ld) * (stored_cols - 1) + stored_rows;
  }
  // op(X) as a row-major rows x cols buffer.
  template <class Acc>
  std::vector<Acc> gather() const {
    std::vector<Acc> out(static_cast<size_t>(rows) * static_cast<size_t>(cols));
    for (size_t c = 0; c < static_cast<size_t>(cols); ++c)
      for (size_t r = 0; r < static_cast<size_t>(rows); ++r)
        out[r * static_cast<size_t>(cols) + c] = get<Acc>(type, p, trans ? c + r * ld : r + c * ld);
    return out;
  }
};

struct Gemm {
  Operand a, b;  // op(A) m x k, op(B) k x n
  void* c;
  cudaDataType ctype;
  int m, n, k, ldc;
  double alpha, beta;  // exact copies of the float or double scalars
  bool fp64, split_k;
  bool tf32 = false;  // fp32 inputs rounded to TF32 first (CUBLAS_COMPUTE_32F_FAST_TF32)
  const void* bias = nullptr;  // cuBLASLt's bias epilogue: bias[i] added to row i before the rounding
  cudaDataType bias_type = CUDA_R_32F;
  // cuBLASLt's GELU epilogues, on the fp32 value (after the bias): gelu writes that value to aux (in
  // D's type) and D = gelu(value); dgelu reads aux and D = value * gelu'(aux). aux is m x n, ld aux_ld.
  enum class Gelu : uint8_t { none, gelu, dgelu } gelu = Gelu::none;
  void* aux = nullptr;
  int64_t aux_ld = 0;
  // cuBLASLt's BGRADB epilogue: bgrad[j] = sum over p of op(B)[p, j], in fp32 in p's order (the
  // operands' values, before alpha), rounded once to bias_type (D's).
  void* bgrad = nullptr;
};

// cuBLASLt's GELU, the tanh form, in fp32: gelu(x) = x / 2 (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3).
float gelu_tanh(float x) {
  const float u = 0.7978845608f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(u));
}
float gelu_tanh_slope(float x) {
  const float u = 0.7978845608f * (x + 0.044715f * x * x * x), t = std::tanh(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
}

// row[j - j0] += sum over p in [p0, p1) of a[i, p] * b[p, j], p ascending: each element's sum keeps
// its order while the loop over j vectorises.
template <class Acc>
void accumulate(const std::vector<Acc>& a, const std::vector<Acc>& b, const Gemm& g, size_t i, size_t p0, size_t p1,
                size_t j0, size_t j1, Acc* row) {
  const size_t k = static_cast<size_t>(g.k), n = static_cast<size_t>(g.n);
  std::fill(row, row + (j1 - j0), Acc(0));
  for (size_t p = p0; p < p1; ++p) {
    const Acc x = a[i * k + p];
    const Acc* bp = &b[p * n];
    for (size_t j = j0; j < j1; ++j) row[j - j0] += x * bp[j];
  }
}

template <class Acc>
void run(const Gemm& g) {
  std::vector<Acc> a = g.a.gather<Acc>(), b = g.b.gather<Acc>();
  if constexpr (std::is_same_v<Acc, float>)
    if (g.tf32) {
      for (float& x : a) x = round_to_tf32(x);
      for (float& x : b) x = round_to_tf32(x);
    }
  const Acc alpha = static_cast<Acc>(g.alpha), beta = static_cast<Acc>(g.beta);
  const size_t m = static_cast<size_t>(g.m), n = static_cast<size_t>(g.n), k = static_cast<size_t>(g.k);
  if (g.bgrad != nullptr)
    for (size_t j = 0; j < n; ++j) {
      Acc sum = 0;
      for (size_t p = 0; p < k; ++p) sum += b[p * n + j];
      put<Acc>(g.bias_type, g.bgrad, j, sum);
    }
  const size_t half = k / 2, block = 256;  // columns of C per pass: a block of B stays in cache
  std::vector<Acc> row(block), row2(block);
  for (size_t j0 = 0; j0 < n; j0 += block) {
    const size_t j1 = std::min(n, j0 + block);
    for (size_t i = 0; i < m; ++i) {
      accumulate(a, b, g, i, 0, g.split_k ? half : k, j0, j1, row.data());
      if (g.split_k) accumulate(a, b, g, i, half, k, j0, j1, row2.data());
      for (size_t j = j0; j < j1; ++j) {
        const size_t at = i + j * static_cast<size_t>(g.ldc);
        Acc v;
        if (g.split_k) {  // Acc is float here: partials rounded to C's type, added, rounded
          const float r1 = round_to(g.ctype, alpha * row[j - j0]), r2 = round_to(g.ctype, alpha * row2[j - j0]);
          v = round_to(g.ctype, r1 + r2);
        } else {
          v = alpha * row[j - j0];
        }
        if (g.beta != 0) v = v + beta * get<Acc>(g.ctype, g.c, at);  // beta == 0: C is not read
        if (g.bias != nullptr) v = v + get<Acc>(g.bias_type, g.bias, i);
        if (g.gelu != Gemm::Gelu::none) {  // fp32 GEMMs only (Acc is float): describe()
          const size_t aux_at = i + j * static_cast<size_t>(g.aux_ld);
          if (g.gelu == Gemm::Gelu::gelu) {
            put<Acc>(g.ctype, g.aux, aux_at, v);
            v = static_cast<Acc>(gelu_tanh(static_cast<float>(v)));
          } else {
            v = static_cast<Acc>(static_cast<float>(v) * gelu_tanh_slope(static_cast<float>(get<Acc>(g.ctype, g.aux, aux_at))));
          }
        }
        put<Acc>(g.ctype, g.c, at, v);
      }
    }
  }
}

size_t aux_elements(const Gemm& g) {
  return static_cast<size_t>(g.aux_ld) * static_cast<size_t>(g.n - 1) + static_cast<size_t>(g.m);
}

void execute(const Gemm& g) {
  // Still device memory when the GEMM runs (not freed after the call)?
  const auto gone = [](const void* p, size_t bytes) { return bytes != 0 && !is_device_range(p, bytes); };
  if ((g.k > 0 && (gone(g.a.p, g.a.elements() * type_size(g.a.type)) ||
                   gone(g.b.p, g.b.elements() * type_size(g.b.type)))) ||
      gone(g.c, (static_cast<size_t>(g.ldc) * static_cast<size_t>(g.n - 1) + static_cast<size_t>(g.m)) *
                    type_size(g.ctype)) ||
      (g.bias != nullptr && gone(g.bias, static_cast<size_t>(g.m) * type_size(g.bias_type))) ||
      (g.aux != nullptr && gone(g.aux, aux_elements(g) * type_size(g.ctype))) ||
      (g.bgrad != nullptr && gone(g.bgrad, static_cast<size_t>(g.n) * type_size(g.bias_type))))
    return fault("cuBLAS: an operand of a GEMM was freed before the GEMM ran", cudaErrorIllegalAddress);
  if (g.fp64) run<double>(g);
  else run<float>(g);
}

bool check_range(const char* what, const void* p, size_t elements, cudaDataType t, const char* shape, int rows,
                 int cols, int ld) {
  const size_t bytes = elements * type_size(t);
  if (bytes == 0 || is_device_range(p, bytes)) return true;
  std::fprintf(stderr,
               "cuBLAS: GEMM operand %s (%s = %d x %d %s, leading dimension %d: %zu bytes at %p) is not inside one "
               "device allocation\n",
               what, shape, rows, cols, type_name(t), ld, bytes, p);
  return false;
}

}  // namespace
}  // namespace amp::emu

using namespace amp::emu;

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(g_mutex);
  *handle = new cublasContext;
  g_handles.insert(*handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (handle == nullptr || g_handles.erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;  // queued GEMMs hold copies of what they need
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t streamId) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = streamId;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* streamId) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (streamId == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *streamId = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

// The workspace must be device memory aligned to 256 bytes, as cuBLAS requires; the emulator does not use it.
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t workspaceSizeInBytes) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (workspaceSizeInBytes != 0 && (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0 ||
                                    !is_device_range(workspace, workspaceSizeInBytes))) {
    std::fprintf(stderr, "cublasSetWorkspace: %zu bytes at %p are not 256-byte aligned device memory\n",
                 workspaceSizeInBytes, workspace);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->workspace = workspace;
  handle->workspace_bytes = workspaceSizeInBytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if ((mode & ~(0xf | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)) != 0 || (mode & 0xf) > 3)
    return CUBLAS_STATUS_INVALID_VALUE;
  handle->mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->mode;
  return CUBLAS_STATUS_SUCCESS;
}

namespace {

// Logs the validated GEMMs (one operation: a batch, or cuBLASLt's one matmul) and enqueues them on
// the stream; in the dry run they are logged and not run.
cublasStatus_t submit(const char* name, cudaStream_t stream, std::vector<Gemm> gemms, const char* compute) {
  const Gemm& g = gemms.front();
  const int64_t batch = static_cast<int64_t>(gemms.size());
  if (launch_log_on()) {
    // Each operand read once and C written once (read too when beta != 0), the bias read once: what
    // a tiled GEMM moves at the least; 2 m n k FLOPs per GEMM.
    const auto mnb = [&](int r, int c, cudaDataType t) {
      return static_cast<int64_t>(r) * c * batch * static_cast<int64_t>(type_size(t));
    };
    // The GELU epilogues move aux (D's size) too: written forward, read backward.
    const int64_t c_bytes = mnb(g.m, g.n, g.ctype);
    const int64_t read = mnb(g.m, g.k, g.a.type) + mnb(g.k, g.n, g.b.type) + (g.beta != 0 ? c_bytes : 0) +
                         (g.bias != nullptr ? mnb(g.m, 1, g.bias_type) : 0) +
                         (g.gelu == Gemm::Gelu::dgelu ? c_bytes : 0);
    const int64_t written = c_bytes + (g.gelu == Gemm::Gelu::gelu ? c_bytes : 0) +
                            (g.bgrad != nullptr ? mnb(1, g.n, g.bias_type) : 0);
    const char* epilogue = g.gelu == Gemm::Gelu::gelu    ? ",\"epilogue\":\"gelu_aux_bias\""
                           : g.gelu == Gemm::Gelu::dgelu ? ",\"epilogue\":\"dgelu\""
                           : g.bias != nullptr           ? ",\"epilogue\":\"bias\""
                           : g.bgrad != nullptr          ? ",\"epilogue\":\"bgradb\""
                                                         : "";
    const int64_t flops = 2 * static_cast<int64_t>(g.m) * g.n * g.k * batch;
    log_line("gemm", std::string(",\"name\":\"") + name + "\",\"m\":" + std::to_string(g.m) + ",\"n\":" +
                         std::to_string(g.n) + ",\"k\":" + std::to_string(g.k) + ",\"batch\":" + std::to_string(batch) +
                         ",\"a\":\"" + type_name(g.a.type) + "\",\"b\":\"" + type_name(g.b.type) + "\",\"c\":\"" +
                         type_name(g.ctype) + "\",\"compute\":\"" + compute + "\",\"beta\":" +
                         (g.beta != 0 ? "1" : "0") + epilogue + ",\"read\":" + std::to_string(read) +
                         ",\"written\":" + std::to_string(written) +
                         ",\"flops\":" + std::to_string(flops),
             stream);
  }
  if (dry_run()) {  // recorded, not run (emu.h)
    if (enqueue(stream, Op{name, [] { return true; }}) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    count_launch(stream);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (enqueue(stream, Op{name, [gemms = std::move(gemms)] {
                for (const Gemm& gi : gemms) execute(gi);
                return true;
              }}) != cudaSuccess)
    return CUBLAS_STATUS_EXECUTION_FAILED;
  count_launch(stream);
  return CUBLAS_STATUS_SUCCESS;
}

// cublasGemmEx (batch 1) and cublasGemmStridedBatchedEx: validated at call time, enqueued as one
// operation that runs the batch's GEMMs in order.
cublasStatus_t gemm_strided(const char* name, cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                            int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype, int lda,
                            long long strideA, const void* B, cudaDataType Btype, int ldb, long long strideB,
                            const void* beta, void* C, cudaDataType Ctype, int ldc, long long strideC, int batch,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  const auto valid_op = [](cublasOperation_t op) {
    return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C;
  };
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;  // OP_C is OP_T for real types
  if (!valid_op(transa) || !valid_op(transb) || m < 0 || n < 0 || k < 0 || batch < 0 || strideA < 0 || strideB < 0 ||
      strideC < 0 || lda < std::max(1, ta ? k : m) || ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m) ||
      !(algo == CUBLAS_GEMM_DEFAULT || (algo >= CUBLAS_GEMM_ALGO0 && algo <= CUBLAS_GEMM_ALGO23) ||
        (algo >= CUBLAS_GEMM_DEFAULT_TENSOR_OP && algo <= CUBLAS_GEMM_ALGO15_TENSOR_OP)))
    return CUBLAS_STATUS_INVALID_VALUE;
  const bool narrow_or_f32 = Atype == CUDA_R_16F || Atype == CUDA_R_16BF || Atype == CUDA_R_32F;
  const bool fp32 = computeType == CUBLAS_COMPUTE_32F && narrow_or_f32 && Btype == Atype &&
                    (Ctype == Atype || Ctype == CUDA_R_32F);
  const bool tf32 = computeType == CUBLAS_COMPUTE_32F_FAST_TF32 && Atype == CUDA_R_32F && Btype == CUDA_R_32F &&
                    Ctype == CUDA_R_32F;
  const bool fp64 = computeType == CUBLAS_COMPUTE_64F && Atype == CUDA_R_64F && Btype == CUDA_R_64F &&
                    Ctype == CUDA_R_64F;
  if (!fp32 && !fp64 && !tf32) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;

  Gemm g{Operand{A, Atype, ta, m, k, lda}, Operand{B, Btype, tb, k, n, ldb}, C, Ctype, m, n, k, ldc, 0, 0, fp64, false};
  g.alpha = fp64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  g.beta = fp64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  g.tf32 = tf32;
  // The whole batch must lie in device memory: the last matrix ends (batch - 1) strides further.
  const size_t last = static_cast<size_t>(batch - 1);
  const size_t c_elements = static_cast<size_t>(ldc) * static_cast<size_t>(n - 1) + static_cast<size_t>(m);
  if ((k > 0 && (!check_range("A", A, g.a.elements() + last * static_cast<size_t>(strideA), Atype,
                              ta ? "op(A) = A^T" : "op(A) = A", m, k, lda) ||
                 !check_range("B", B, g.b.elements() + last * static_cast<size_t>(strideB), Btype,
                              tb ? "op(B) = B^T" : "op(B) = B", k, n, ldb))) ||
      !check_range("C", C, c_elements + last * static_cast<size_t>(strideC), Ctype, "C", m, n, ldc))
    return CUBLAS_STATUS_INVALID_VALUE;
  // Split-K with the partial sums added in C's type: what cuBLAS may do without the DISALLOW flag.
  g.split_k = (handle->mode & CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION) == 0 &&
              (Ctype == CUDA_R_16F || Ctype == CUDA_R_16BF) && k >= 64;
  std::vector<Gemm> gemms;
  for (int i = 0; i < batch; ++i) {
    Gemm gi = g;
    gi.a.p = static_cast<const char*>(A) + static_cast<size_t>(i) * static_cast<size_t>(strideA) * type_size(Atype);
    gi.b.p = static_cast<const char*>(B) + static_cast<size_t>(i) * static_cast<size_t>(strideB) * type_size(Btype);
    gi.c = static_cast<char*>(C) + static_cast<size_t>(i) * static_cast<size_t>(strideC) * type_size(Ctype);
    gemms.push_back(gi);
  }
  return submit(name, handle->stream, std::move(gemms), fp64 ? "64F" : tf32 ? "TF32" : "32F");
}

}  // namespace

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  return gemm_strided("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta,
                      C, Ctype, ldc, 0, 1, computeType, algo);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t algo) {
  return gemm_strided("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B,
                      Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo);
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "an error was detected when checking the current licensing";
  }
  return "unknown error";
}

// --- cuBLASLt (cublasLt.h)

struct cublasLtContext {};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int32_t bias_type = -1;  // D's type
  void* aux = nullptr;  // the GELU epilogues' GELU input
  int64_t aux_ld = 0;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t max_workspace = 0;
  uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_MASK;
  uint32_t alignment[4] = {256, 256, 256, 256};  // A, B, C, D
};

namespace amp::emu {
namespace {

constexpr uint64_t kLtAlgoMagic = 0x656d754c74416c67ull;  // what the emulator's heuristic writes in data[0]

// Whether the type combination is one cuBLAS(Lt) runs (cublasGemmEx's table), and which arithmetic.
bool supported(cublasComputeType_t compute, cudaDataType a, cudaDataType b, cudaDataType c, bool* fp64, bool* tf32) {
  const bool narrow_or_f32 = a == CUDA_R_16F || a == CUDA_R_16BF || a == CUDA_R_32F;
  const bool fp32 = compute == CUBLAS_COMPUTE_32F && narrow_or_f32 && b == a && (c == a || c == CUDA_R_32F);
  *tf32 = compute == CUBLAS_COMPUTE_32F_FAST_TF32 && a == CUDA_R_32F && b == CUDA_R_32F && c == CUDA_R_32F;
  *fp64 = compute == CUBLAS_COMPUTE_64F && a == CUDA_R_64F && b == CUDA_R_64F && c == CUDA_R_64F;
  return fp32 || *fp64 || *tf32;
}

// The matmul the descriptors describe, checked: INVALID_VALUE for shapes that do not fit together,
// NOT_SUPPORTED for what cuBLASLt does not offer (or the emulator does not: C other than D with beta).
cublasStatus_t describe(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                        cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D, Gemm* g) {
  if (op == nullptr || A == nullptr || B == nullptr || C == nullptr || D == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = op->transa != CUBLAS_OP_N, tb = op->transb != CUBLAS_OP_N;
  const uint64_t m = ta ? A->cols : A->rows, k = ta ? A->rows : A->cols;
  const uint64_t kb = tb ? B->cols : B->rows, n = tb ? B->rows : B->cols;
  if (k != kb || D->rows != m || D->cols != n || C->rows != m || C->cols != n || C->type != D->type ||
      C->ld != D->ld || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX)
    return CUBLAS_STATUS_INVALID_VALUE;
  bool fp64 = false, tf32 = false;
  if (!supported(op->compute, A->type, B->type, D->type, &fp64, &tf32)) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool gelu = op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS, dgelu = op->epilogue == CUBLASLT_EPILOGUE_DGELU;
  const bool bgradb = op->epilogue == CUBLASLT_EPILOGUE_BGRADB;
  if (op->epilogue != CUBLASLT_EPILOGUE_DEFAULT && op->epilogue != CUBLASLT_EPILOGUE_BIAS && !gelu && !dgelu && !bgradb)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const cudaDataType bias_type = op->bias_type < 0 ? D->type : static_cast<cudaDataType>(op->bias_type);
  if ((op->epilogue == CUBLASLT_EPILOGUE_BIAS || gelu || bgradb) && bias_type != D->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (bgradb && fp64) return CUBLAS_STATUS_NOT_SUPPORTED;  // the bias gradient: fp32 arithmetic only
  // The GELU epilogues: fp32 arithmetic (not fp64); aux's leading dimension a multiple of 8, at least m.
  if ((gelu || dgelu) && (fp64 || op->aux_ld % 8 != 0 || op->aux_ld < static_cast<int64_t>(std::max<uint64_t>(1, m))))
    return fp64 ? CUBLAS_STATUS_NOT_SUPPORTED : CUBLAS_STATUS_INVALID_VALUE;
  *g = Gemm{Operand{nullptr, A->type, ta, static_cast<int>(m), static_cast<int>(k), static_cast<int>(A->ld)},
            Operand{nullptr, B->type, tb, static_cast<int>(k), static_cast<int>(n), static_cast<int>(B->ld)},
            nullptr, D->type, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), static_cast<int>(D->ld),
            0, 0, fp64, false};
  g->tf32 = tf32;
  g->bias_type = bias_type;
  g->gelu = gelu ? Gemm::Gelu::gelu : dgelu ? Gemm::Gelu::dgelu : Gemm::Gelu::none;
  g->aux_ld = op->aux_ld;
  if (static_cast<uint64_t>(A->ld) < std::max<uint64_t>(1, A->rows) ||
      static_cast<uint64_t>(B->ld) < std::max<uint64_t>(1, B->rows) ||
      static_cast<uint64_t>(D->ld) < std::max<uint64_t>(1, D->rows))
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

// The largest power of two (up to 256) that divides the address.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

template <class T>
cublasStatus_t set_value(T* field, const void* buf, size_t size) {
  if (buf == nullptr || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(field, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace amp::emu

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *lightHandle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType) {
  if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *matmulDesc = new cublasLtMatmulDescOpaque_t{computeType, scaleType};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  delete matmulDesc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  if (d == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
      int32_t v = 0;
      if (set_value(&v, buf, size) != CUBLAS_STATUS_SUCCESS || v < CUBLAS_OP_N || v > CUBLAS_OP_C)
        return CUBLAS_STATUS_INVALID_VALUE;
      (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->transa : d->transb) = static_cast<cublasOperation_t>(v);
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return set_value(&d->epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return set_value(&d->bias, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return set_value(&d->bias_type, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return set_value(&d->aux, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return set_value(&d->aux_ld, buf, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (layout == nullptr || ld < 0) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
  if (p == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return set_value(&p->max_workspace, buf, size);
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK: return set_value(&p->reduction_mask, buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      return set_value(&p->alignment[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

// One algorithm (no workspace) when the matmul is supported: it records the alignments it may assume
// and whether split-K in D's type is allowed.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                                              cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (pref == nullptr || requested < 1 || results == nullptr || returned == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  Gemm g{};
  const cublasStatus_t st = describe(op, A, B, C, D, &g);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  cublasLtMatmulHeuristicResult_t r{};
  r.algo.data[0] = kLtAlgoMagic;
  for (int i = 0; i < 4; ++i) r.algo.data[1 + i] = pref->alignment[i];
  r.algo.data[5] = (pref->reduction_mask & (CUBLASLT_REDUCTION_SCHEME_INPLACE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE)) != 0;
  // As cuBLASLt's heuristic, it reads the bias pointer's alignment (the pointer is set before it).
  const bool bias = op->epilogue == CUBLASLT_EPILOGUE_BIAS || op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
                    op->epilogue == CUBLASLT_EPILOGUE_BGRADB;
  r.algo.data[6] = bias ? alignment_of(op->bias) : 1;
  r.algo.data[7] = g.gelu != Gemm::Gelu::none ? alignment_of(op->aux) : 1;  // and the aux pointer's
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  results[0] = r;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void*, size_t,
                              cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (alpha == nullptr || beta == nullptr || algo == nullptr || algo->data[0] != kLtAlgoMagic)
    return CUBLAS_STATUS_INVALID_VALUE;
  Gemm g{};
  const cublasStatus_t st = describe(op, Adesc, Bdesc, Cdesc, Ddesc, &g);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  g.a.p = A;
  g.b.p = B;
  g.c = D;
  g.alpha = g.fp64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  g.beta = g.fp64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  if (g.beta != 0 && C != D) return CUBLAS_STATUS_NOT_SUPPORTED;  // the emulator adds C in place only
  if (g.gelu != Gemm::Gelu::none) {
    if (op->aux == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (alignment_of(op->aux) < algo->data[7]) {
      std::fprintf(stderr, "cublasLtMatmul: the epilogue's aux at %p is %u-byte aligned, but the algorithm was chosen for "
                   "a %llu-byte aligned one\n", op->aux, alignment_of(op->aux), static_cast<unsigned long long>(algo->data[7]));
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    g.aux = op->aux;
  }
  const bool bgradb = op->epilogue == CUBLASLT_EPILOGUE_BGRADB;
  if (op->epilogue == CUBLASLT_EPILOGUE_BIAS || op->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || bgradb) {
    if (op->bias == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (alignment_of(op->bias) < algo->data[6]) {
      std::fprintf(stderr, "cublasLtMatmul: the bias at %p is %u-byte aligned, but the algorithm was chosen for a %llu-byte "
                   "aligned bias\n", op->bias, alignment_of(op->bias), static_cast<unsigned long long>(algo->data[6]));
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (bgradb) g.bgrad = const_cast<void*>(op->bias);
    else g.bias = op->bias;
  }
  if (g.m == 0 || g.n == 0) return CUBLAS_STATUS_SUCCESS;
  const void* pointers[4] = {A, B, C, D};
  for (int i = 0; i < 4; ++i)
    if (alignment_of(pointers[i]) < algo->data[1 + i]) {
      std::fprintf(stderr,
                   "cublasLtMatmul: %c at %p is %u-byte aligned, but the algorithm was chosen for %llu-byte alignment "
                   "(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES)\n",
                   "ABCD"[i], pointers[i], alignment_of(pointers[i]), static_cast<unsigned long long>(algo->data[1 + i]),
                   "ABCD"[i]);
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
  const size_t d_elements = static_cast<size_t>(g.ldc) * static_cast<size_t>(g.n - 1) + static_cast<size_t>(g.m);
  if ((g.k > 0 && (!check_range("A", A, g.a.elements(), g.a.type, g.a.trans ? "op(A) = A^T" : "op(A) = A", g.m, g.k,
                                g.a.ld) ||
                   !check_range("B", B, g.b.elements(), g.b.type, g.b.trans ? "op(B) = B^T" : "op(B) = B", g.k, g.n,
                                g.b.ld))) ||
      !check_range("D", D, d_elements, g.ctype, "D", g.m, g.n, g.ldc) ||
      (g.bias != nullptr && !check_range("bias", g.bias, static_cast<size_t>(g.m), g.bias_type, "bias", g.m, 1, g.m)) ||
      (g.aux != nullptr && !check_range("aux", g.aux, aux_elements(g), g.ctype, "aux", g.m, g.n, static_cast<int>(g.aux_ld))) ||
      (g.bgrad != nullptr && !check_range("bias", g.bgrad, static_cast<size_t>(g.n), g.bias_type, "bias gradient", 1, g.n, 1)))
    return CUBLAS_STATUS_INVALID_VALUE;
  g.split_k = algo->data[5] != 0 && (g.ctype == CUDA_R_16F || g.ctype == CUDA_R_16BF) && g.k >= 64;
  return submit("cublasLtMatmul", stream, {g}, g.fp64 ? "64F" : g.tf32 ? "TF32" : "32F");
}
