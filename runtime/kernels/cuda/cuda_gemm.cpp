// CUDA backend: GEMM on cuBLAS (cublasGemmEx, and cublasGemmStridedBatchedEx for batches). fp16/bf16 inputs use tensor cores with fp32
// accumulation and an fp16/bf16 or fp32 output, as the CPU backend emulates; fp32 is strict fp32
// (no TF32); fp64 is fp64. The workspace is set once on the handle (cuda_context.cpp).
#include <climits>
#include <stdexcept>
#include <string>

#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/gemm_check.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/gemm_layout.h"

namespace amp::cuda {

namespace {

cudaDataType_t cuda_dtype(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f64: return CUDA_R_64F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: throw std::invalid_argument(std::string("gemm: unsupported dtype ") + dtype_name(t));
  }
}

int as_int(int64_t v, const char* what) {
  if (v > INT_MAX) throw std::invalid_argument(std::string("gemm: ") + what + " = " + std::to_string(v) +
                                               " exceeds cuBLAS's 32-bit limit");
  return static_cast<int>(v);
}

}  // namespace

namespace {

// c[i] = alpha op(a[i]) op(b[i]) + beta c[i] for i < batch, a[i] `stride_a` elements apart (and so on):
// row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so b goes first.
void launch_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a, const Tensor& b,
                 float beta, Tensor& c, int64_t batch) {
  const ColumnMajorGemm g = column_major_gemm(ta, tb, m, n, k);
  const cublasOperation_t op_first = g.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = g.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int gm = as_int(g.m, "n"), gn = as_int(g.n, "m"), gk = as_int(g.k, "k");
  const int ld1 = as_int(g.ld_first, "ldb"), ld2 = as_int(g.ld_second, "lda"), ldc = as_int(g.ldc, "ldc");
  const cublasHandle_t handle = context().cublas();
  const cudaDataType_t in_type = cuda_dtype(a.dtype()), out_type = cuda_dtype(c.dtype());
  const bool f64 = a.dtype() == DType::f64;
  // fp32 accumulation for every narrower input: the tensor-core path for fp16/bf16.
  const double alpha64 = alpha, beta64 = beta;
  const void* pa = f64 ? static_cast<const void*>(&alpha64) : &alpha;
  const void* pb = f64 ? static_cast<const void*>(&beta64) : &beta;
  const cublasComputeType_t compute = f64                                              ? CUBLAS_COMPUTE_64F
                                      : a.dtype() == DType::f32 && context().allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                                          : CUBLAS_COMPUTE_32F;
  if (batch == 1) {
    AMP_CUBLAS_CHECK(cublasGemmEx(handle, op_first, op_second, gm, gn, gk, pa, b.data_ptr(), in_type, ld1,
                                  a.data_ptr(), in_type, ld2, pb, c.data_ptr(), out_type, ldc, compute,
                                  CUBLAS_GEMM_DEFAULT));
    return;
  }
  AMP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(handle, op_first, op_second, gm, gn, gk, pa, b.data_ptr(), in_type, ld1,
                                              k * n, a.data_ptr(), in_type, ld2, m * k, pb, c.data_ptr(), out_type, ldc,
                                              m * n, as_int(batch, "batch"), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void CudaBackend::gemm(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  require_cuda(a, "gemm: a");
  require_cuda(b, "gemm: b");
  require_cuda(c, "gemm: c");
  const auto [m, n, k] = check_gemm(ta, tb, a, b, c);
  if (gemm_is_trivial(*this, m, n, k, beta, c)) return;
  launch_gemm(ta, tb, m, n, k, alpha, a, b, beta, c, 1);
}

void CudaBackend::gemm_batched(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  require_cuda(a, "gemm_batched: a");
  require_cuda(b, "gemm_batched: b");
  require_cuda(c, "gemm_batched: c");
  const auto [m, n, k] = check_gemm_batched(ta, tb, a, b, c);
  if (a.shape()[0] == 0 || gemm_is_trivial(*this, m, n, k, beta, c)) return;
  launch_gemm(ta, tb, m, n, k, alpha, a, b, beta, c, a.shape()[0]);
}

}  // namespace amp::cuda
