// Error formatting for the check macros of cuda_check.h.
#include "runtime/kernels/cuda/cuda_check.h"

#include <cstdio>
#include <stdexcept>
#include <string>

namespace amp::cuda {

namespace {
std::string where(const char* expr, const char* file, int line) {
  int device = -1;
  // Never throws, and cannot recurse: a failure here just leaves device = -1.
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  return std::string(expr) + " at " + file + ":" + std::to_string(line) + " (device " + std::to_string(device) + ")";
}
}  // namespace

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw std::runtime_error("CUDA error: " + where(expr, file, line) + ": " + cudaGetErrorName(err) + ": " +
                           cudaGetErrorString(err));
}

void log_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  std::fprintf(stderr, "CUDA error (ignored in destructor): %s: %s: %s\n", where(expr, file, line).c_str(),
               cudaGetErrorName(err), cudaGetErrorString(err));
}

void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line) {
  throw std::runtime_error("cuBLAS error: " + where(expr, file, line) + ": " + cublasGetStatusName(st) + ": " +
                           cublasGetStatusString(st));
}

}  // namespace amp::cuda
