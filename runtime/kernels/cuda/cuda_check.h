// Checked CUDA and cuBLAS calls. AMP_CUDA_CHECK(expr) throws std::runtime_error naming the call
// (#expr), file:line, CUDA's error string and the current device; the *_NOTHROW variants only log
// (for destructors, which must not throw).
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace amp::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
void log_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line);

}  // namespace amp::cuda

#define AMP_CUDA_CHECK(expr)                                                            \
  do {                                                                                  \
    const cudaError_t amp_err_ = (expr);                                                \
    if (amp_err_ != cudaSuccess) ::amp::cuda::throw_cuda_error(amp_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define AMP_CUDA_CHECK_NOTHROW(expr)                                                  \
  do {                                                                                \
    const cudaError_t amp_err_ = (expr);                                              \
    if (amp_err_ != cudaSuccess) ::amp::cuda::log_cuda_error(amp_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define AMP_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                         \
    const cublasStatus_t amp_st_ = (expr);                                                     \
    if (amp_st_ != CUBLAS_STATUS_SUCCESS) ::amp::cuda::throw_cublas_error(amp_st_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports a bad launch configuration at the call site, not at a later sync.
#define AMP_CUDA_CHECK_LAUNCH() AMP_CUDA_CHECK(cudaGetLastError())
