// The emulated GPU's cuBLAS: the subset of the cuBLAS v2 API the project calls (handles, streams,
// workspace, math mode, cublasGemmEx), with the real names and values.
//
// cublasGemmEx checks its arguments as cuBLAS does (CUBLAS_STATUS_INVALID_VALUE for bad sizes and
// leading dimensions, NOT_SUPPORTED for type combinations cuBLAS does not offer) and, beyond cuBLAS,
// that the exact extents of A, B and C lie inside device memory (INVALID_VALUE, with a message on
// stderr naming the operand). The GEMM itself runs later, as an operation on the handle's stream.
// Arithmetic: fp16/bf16/fp32 inputs in fp32 (each output element summed over k in order, then
// alpha * sum + beta * C, rounded once into C's type), fp64 in fp64. As in BLAS, beta == 0 means C
// is not read (NaN there does not propagate), and k == 0 means C = beta * C.
//
// Reduced-precision reduction: under a math mode without CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
// real cuBLAS may split k for an fp16/bf16 output and add the partial results in the output type.
// The emulator does so whenever C is fp16/bf16 and k >= 64: each half of k is summed in fp32,
// scaled by alpha and rounded to C's type, the two are added and rounded, then beta * C is added and
// rounded again. A program that needs one rounding must set the DISALLOW flag in its math mode.
#pragma once
#include <cstddef>

#include "cuda_runtime.h"

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16
} cublasStatus_t;

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;

// Flags combine with |: callers write static_cast<cublasMath_t>(A | B).
typedef enum {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_TENSOR_OP_MATH = 1,
  CUBLAS_PEDANTIC_MATH = 2,
  CUBLAS_TF32_TENSOR_OP_MATH = 3,
  CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16
} cublasMath_t;

typedef enum {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77
} cublasComputeType_t;

// Algorithms 0..23 and 99..115 exist; the emulator accepts them all and runs the same code.
typedef enum {
  CUBLAS_GEMM_DEFAULT = -1,
  CUBLAS_GEMM_ALGO0 = 0,
  CUBLAS_GEMM_ALGO23 = 23,
  CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99,
  CUBLAS_GEMM_ALGO15_TENSOR_OP = 115
} cublasGemmAlgo_t;

cublasStatus_t cublasCreate(cublasHandle_t* handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t streamId);
cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* streamId);
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t workspaceSizeInBytes);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode);

// C = alpha * op(A) * op(B) + beta * C, column-major, C m x n, inner dimension k; alpha and beta
// are host pointers (float for CUBLAS_COMPUTE_32F, double for CUBLAS_COMPUTE_64F).
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo);

// The same for batchCount GEMMs whose matrices lie strideA, strideB and strideC elements apart:
// one launch.
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t algo);

const char* cublasGetStatusName(cublasStatus_t status);
const char* cublasGetStatusString(cublasStatus_t status);
