#include "runtime/kernels/cuda/cuda_context.h"

#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/kernels/cuda/device_usage.h"

namespace amp::cuda {

Context::Context(int device) : device_(device) {
  AMP_CUDA_CHECK(cudaSetDevice(device));  // makes the device's primary context (CUDA 12 and newer)
  device_usage().start();                  // what the context took is not ours to count
  AMP_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
  // Non-blocking: the legacy default stream must not serialise us against other libraries' work.
  AMP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  AMP_CUBLAS_CHECK(cublasCreate(&cublas_));
  AMP_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  AMP_CUDA_CHECK(cudaMalloc(&workspace_, kCublasWorkspaceBytes));
  AMP_CUBLAS_CHECK(cublasSetWorkspace(cublas_, workspace_, kCublasWorkspaceBytes));
  AMP_CUBLAS_CHECK(cublasLtCreate(&cublas_lt_));
  // Strict fp32 for fp32 GEMMs (no TF32), so fp32 results match the CPU backend's semantics; and
  // no reduced-precision (fp16/bf16) reductions in split-K: fp32 accumulation, one rounding.
  // Freed blocks are filled with NaN with AMP_CUDA_POISON_FREED=1 (the cuda-emu preset's tests and
  // gpu_check.sh's test_cuda set it): a kernel that leaves part of its output unwritten then shows
  // in every comparison.
  const char* poison = std::getenv("AMP_CUDA_POISON_FREED");
  allocator_.set_poison_freed(poison != nullptr && std::string(poison) == "1", stream_);
  AMP_CUBLAS_CHECK(cublasSetMathMode(
      cublas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
}

namespace {
std::mutex g_mutex;
// Never destroyed: tensors held by static objects may be freed after main returns, and must still
// find the allocator. The driver reclaims everything at process exit.
Context* g_context = nullptr;
}  // namespace

Context& context() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_context == nullptr)
    throw std::runtime_error("the CUDA backend is used before cuda_init(local_rank) selected a device");
  return *g_context;
}

Context& init_context(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_context != nullptr) {
    if (g_context->device() != device)
      throw std::runtime_error("cuda_init: this process already drives device " + std::to_string(g_context->device()) +
                               " and cannot switch to device " + std::to_string(device));
    return *g_context;
  }
  g_context = new Context(device);
  return *g_context;
}

Event::Event() { AMP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
Event::~Event() {
  if (event_) AMP_CUDA_CHECK_NOTHROW(cudaEventDestroy(event_));
}
void Event::record(cudaStream_t s) { AMP_CUDA_CHECK(cudaEventRecord(event_, s)); }
void Event::block(cudaStream_t s) const { AMP_CUDA_CHECK(cudaStreamWaitEvent(s, event_, 0)); }
bool Event::query() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not-ready is reported through the last-error slot too
    return false;
  }
  AMP_CUDA_CHECK(err);
  return true;
}

Stream::Stream(int priority) {
  AMP_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority));
}
Stream::~Stream() {
  if (stream_) AMP_CUDA_CHECK_NOTHROW(cudaStreamDestroy(stream_));
}

}  // namespace amp::cuda
