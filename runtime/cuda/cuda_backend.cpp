// CUDA backend: memory and copies. Kernels live in the .cu files named in cuda_backend.h.
#include "runtime/cuda/cuda_backend.h"

#include <stdexcept>
#include <string>

#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_context.h"

namespace amp::cuda {

CudaBackend& cuda_backend() {
  static CudaBackend* b = new CudaBackend;  // never destroyed, like the context (see cuda_context.cpp)
  return *b;
}

void require_cuda(const Tensor& t, const char* what) {
  if (!t.defined()) throw std::invalid_argument(std::string(what) + " is undefined");
  if (!t.device().is_cuda())
    throw std::invalid_argument(std::string(what) + " is on " + t.device().str() + ", expected a CUDA tensor");
}

void* CudaBackend::allocate(size_t bytes) { return context().allocator().allocate(bytes); }
void CudaBackend::deallocate(void* p, size_t bytes) { context().allocator().deallocate(p, bytes); }
size_t CudaBackend::peak_bytes() const { return context().allocator().peak_bytes(); }
size_t CudaBackend::current_bytes() const { return context().allocator().current_bytes(); }
void CudaBackend::reset_peak_bytes() { context().allocator().reset_peak_bytes(); }

// From pageable memory cudaMemcpyAsync returns once the source is staged, so the caller may reuse
// src at once and the host never waits for the device here.
void CudaBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  AMP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, context().stream()));
}

// The caller reads dst next, so this waits for the stream: the one synchronising copy.
void CudaBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  const cudaStream_t s = context().stream();
  AMP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  AMP_CUDA_CHECK(cudaStreamSynchronize(s));
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  AMP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, context().stream()));
}

void CudaBackend::synchronize() { AMP_CUDA_CHECK(cudaStreamSynchronize(context().stream())); }

}  // namespace amp::cuda
