// The emulated GPU's cuBLASLt: the subset of its API the project calls (a handle, matmul and layout
// descriptors, preferences, the heuristic and cublasLtMatmul with the bias epilogue), with the real
// names and values. The arithmetic is cublasGemmEx's (cublas_v2.h): each element summed in fp32 in
// order, then alpha * sum + beta * C + bias[row], rounded once into D's type.
//
// Checked as cuBLASLt does, and beyond it:
// - the heuristic answers NOT_SUPPORTED (no algorithm) for type combinations cuBLASLt lacks, an
//   epilogue other than DEFAULT and BIAS, and a bias type other than D's;
// - the algorithm it returns remembers the pointer alignments the preference declared
//   (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES, 256 when not set, as in cuBLASLt) and the bias
//   pointer's own (which cuBLASLt's heuristic reads): cublasLtMatmul refuses (NOT_SUPPORTED, with a
//   message on stderr) pointers less aligned than that, where a real GPU may fault or read the wrong
//   elements;
// - A, B, C, D and the bias must lie inside device memory (INVALID_VALUE, naming the operand).
// Split-K in D's type (INPLACE or OUTPUT_TYPE reductions, allowed unless the preference's
// CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK excludes them) is emulated as cublasGemmEx's without
// CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cublas_v2.h"
#include "cuda_runtime.h"

struct cublasLtContext;
typedef struct cublasLtContext* cublasLtHandle_t;
struct cublasLtMatmulDescOpaque_t;
typedef cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;
struct cublasLtMatrixLayoutOpaque_t;
typedef cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;
struct cublasLtMatmulPreferenceOpaque_t;
typedef cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;

typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;

typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;

typedef enum {
  CUBLASLT_MATMUL_DESC_TRANSA = 3,          // int32_t cublasOperation_t
  CUBLASLT_MATMUL_DESC_TRANSB = 4,          // int32_t cublasOperation_t
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,        // uint32_t cublasLtEpilogue_t
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,    // const void*: a device vector of D's rows (BGRADB: D's columns, written)
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,  // void*: GELU's input, D's type (written forward, read backward)
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,       // int64_t: its leading dimension, a multiple of 8, >= D's rows
  CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26  // int32_t cudaDataType; -1 (default): D's type
} cublasLtMatmulDescAttributes_t;

// The epilogues emulated. GELU is the tanh form.
typedef enum {
  CUBLASLT_EPILOGUE_DEFAULT = 1,
  CUBLASLT_EPILOGUE_BIAS = 4,
  CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,  // D = gelu(sum + bias), aux = sum + bias
  CUBLASLT_EPILOGUE_DGELU = 64 | 128,              // D = sum * gelu'(aux)
  CUBLASLT_EPILOGUE_BGRADB = 512                   // bias (D's type, n) = op(B) summed over k
} cublasLtEpilogue_t;

typedef enum {
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,    // uint64_t
  CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = 3,  // uint32_t of cublasLtReductionScheme_t bits
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,  // uint32_t
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
} cublasLtMatmulPreferenceAttributes_t;

typedef enum {
  CUBLASLT_REDUCTION_SCHEME_NONE = 0,
  CUBLASLT_REDUCTION_SCHEME_INPLACE = 1,
  CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE = 2,
  CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE = 4,
  CUBLASLT_REDUCTION_SCHEME_MASK = 0x7
} cublasLtReductionScheme_t;

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t sizeInBytes);
// A column-major rows x cols matrix with leading dimension ld (>= rows).
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t sizeInBytes);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int* returnAlgoCount);
// D = alpha * op(A) op(B) + beta * C (+ bias), column-major; alpha and beta are host floats (the
// default pointer mode) for every compute type but CUBLAS_COMPUTE_64F (doubles).
cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspaceSizeInBytes, cudaStream_t stream);
