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

namespace {
// Copies into pinned host memory on the compute stream, then an event: ready() polls the event.
class CudaReadback final : public Readback {
 public:
  explicit CudaReadback(const std::vector<Tensor>& scalars) : n_(scalars.size()) {
    AMP_CUDA_CHECK(cudaMallocHost(&host_, sizeof(float) * (n_ > 0 ? n_ : 1)));
    AMP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    const cudaStream_t s = context().stream();
    for (size_t i = 0; i < n_; ++i) {
      const Tensor& t = scalars[i];
      require_cuda(t, "readback tensor");
      if (t.dtype() != DType::f32 || t.numel() != 1)
        throw std::invalid_argument("readback: expected a 1-element float32 tensor");
      AMP_CUDA_CHECK(cudaMemcpyAsync(host_ + i, t.data_ptr(), sizeof(float), cudaMemcpyDeviceToHost, s));
    }
    AMP_CUDA_CHECK(cudaEventRecord(done_, s));
  }
  ~CudaReadback() override {
    AMP_CUDA_CHECK_NOTHROW(cudaEventSynchronize(done_));
    AMP_CUDA_CHECK_NOTHROW(cudaEventDestroy(done_));
    AMP_CUDA_CHECK_NOTHROW(cudaFreeHost(host_));
  }
  CudaReadback(const CudaReadback&) = delete;
  CudaReadback& operator=(const CudaReadback&) = delete;
  bool ready() override {
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    AMP_CUDA_CHECK(e);
    return true;
  }
  std::vector<double> values() override {
    AMP_CUDA_CHECK(cudaEventSynchronize(done_));  // waits for this copy only, not for later work
    return std::vector<double>(host_, host_ + n_);
  }

 private:
  size_t n_;
  float* host_ = nullptr;
  cudaEvent_t done_ = nullptr;
};
}  // namespace

std::unique_ptr<Readback> CudaBackend::start_readback(const std::vector<Tensor>& scalars) {
  return std::make_unique<CudaReadback>(scalars);
}

}  // namespace amp::cuda
