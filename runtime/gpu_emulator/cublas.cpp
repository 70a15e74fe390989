// The emulated GPU's cuBLAS (see cublas_v2.h for the checks and the arithmetic): handles hold a
// stream, a workspace and a math mode; cublasGemmEx validates at call time, reads alpha and beta
// from the host, and enqueues the GEMM as one operation on the handle's stream.
#include "cublas_v2.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
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
};

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
        put<Acc>(g.ctype, g.c, at, v);
      }
    }
  }
}

void execute(const Gemm& g) {
  // Still device memory when the GEMM runs (not freed after the call)?
  const auto gone = [](const void* p, size_t bytes) { return bytes != 0 && !is_device_range(p, bytes); };
  if ((g.k > 0 && (gone(g.a.p, g.a.elements() * type_size(g.a.type)) ||
                   gone(g.b.p, g.b.elements() * type_size(g.b.type)))) ||
      gone(g.c, (static_cast<size_t>(g.ldc) * static_cast<size_t>(g.n - 1) + static_cast<size_t>(g.m)) *
                    type_size(g.ctype)))
    return fault("cublasGemmEx: an operand was freed before the GEMM ran", cudaErrorIllegalAddress);
  if (g.fp64) run<double>(g);
  else run<float>(g);
}

bool check_range(const char* what, const void* p, size_t elements, cudaDataType t, const char* shape, int rows,
                 int cols, int ld) {
  const size_t bytes = elements * type_size(t);
  if (bytes == 0 || is_device_range(p, bytes)) return true;
  std::fprintf(stderr,
               "cublasGemmEx: operand %s (%s = %d x %d %s, leading dimension %d: %zu bytes at %p) is not inside one "
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
  if (launch_log_on()) {
    // Each operand read once and C written once (read too when beta != 0): what a tiled GEMM moves
    // at the least; 2 m n k FLOPs per GEMM.
    const auto mnb = [&](int r, int c, cudaDataType t) {
      return static_cast<int64_t>(r) * c * batch * static_cast<int64_t>(type_size(t));
    };
    const int64_t c_bytes = mnb(m, n, Ctype);
    const int64_t read = mnb(m, k, Atype) + mnb(k, n, Btype) + (g.beta != 0 ? c_bytes : 0);
    const int64_t flops = 2 * static_cast<int64_t>(m) * n * k * batch;
    log_line("gemm", std::string(",\"name\":\"") + name + "\",\"m\":" + std::to_string(m) + ",\"n\":" +
                         std::to_string(n) + ",\"k\":" + std::to_string(k) + ",\"batch\":" + std::to_string(batch) +
                         ",\"a\":\"" + type_name(Atype) + "\",\"b\":\"" + type_name(Btype) + "\",\"c\":\"" +
                         type_name(Ctype) + "\",\"compute\":\"" + (fp64 ? "64F" : tf32 ? "TF32" : "32F") +
                         "\",\"beta\":" + (g.beta != 0 ? "1" : "0") + ",\"read\":" + std::to_string(read) +
                         ",\"written\":" + std::to_string(c_bytes) + ",\"flops\":" + std::to_string(flops),
             handle->stream);
  }
  if (dry_run()) {  // recorded, not run (emu.h)
    if (enqueue(handle->stream, Op{name, [] { return true; }}) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    count_launch(handle->stream);
    return CUBLAS_STATUS_SUCCESS;
  }
  std::vector<Gemm> gemms;
  for (int i = 0; i < batch; ++i) {
    Gemm gi = g;
    gi.a.p = static_cast<const char*>(A) + static_cast<size_t>(i) * static_cast<size_t>(strideA) * type_size(Atype);
    gi.b.p = static_cast<const char*>(B) + static_cast<size_t>(i) * static_cast<size_t>(strideB) * type_size(Btype);
    gi.c = static_cast<char*>(C) + static_cast<size_t>(i) * static_cast<size_t>(strideC) * type_size(Ctype);
    gemms.push_back(gi);
  }
  if (enqueue(handle->stream, Op{name, [gemms] {
                for (const Gemm& gi : gemms) execute(gi);
                return true;
              }}) != cudaSuccess)
    return CUBLAS_STATUS_EXECUTION_FAILED;
  count_launch(handle->stream);
  return CUBLAS_STATUS_SUCCESS;
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
