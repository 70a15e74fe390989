// Per-process CUDA state: the device this process drives, its compute stream, cuBLAS with its
// workspace, and the caching allocator. One device per process (mpirun starts one rank per GPU), so
// a Device's index does not pick a GPU: cuda_init(local_rank) does, once.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "runtime/kernels/cuda/caching_allocator.h"

namespace amp::cuda {

class Context {
 public:
  explicit Context(int device);
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  // Every kernel, copy and GEMM of the backend runs on this stream, in order.
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t cublas() const { return cublas_; }
  // cuBLASLt, for GEMMs with an epilogue (a linear layer's bias); it shares cuBLAS's workspace
  // (both run on stream(), in order).
  cublasLtHandle_t cublas_lt() const { return cublas_lt_; }
  void* workspace() const { return workspace_; }
  CachingAllocator& allocator() { return allocator_; }
  int sm_count() const { return sm_count_; }
  // fp32 GEMMs on the tensor cores with their inputs rounded to TF32 (10 mantissa bits), as
  // torch.backends.cuda.matmul.allow_tf32; off by default, as PyTorch's.
  bool allow_tf32() const { return allow_tf32_; }
  void set_allow_tf32(bool on) { allow_tf32_ = on; }

  // cuBLAS needs scratch space for split-K and Hopper kernels; giving it our own keeps it out of
  // the default pool and makes GEMMs capturable in CUDA graphs.
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

 private:
  int device_;
  int sm_count_ = 0;
  bool allow_tf32_ = false;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cublasLtHandle_t cublas_lt_ = nullptr;
  void* workspace_ = nullptr;
  CachingAllocator allocator_;
};

// The context made by cuda_init. Throws std::runtime_error if cuda_init has not run.
Context& context();
// Creates the context for `device` (first call) or checks that it is the same device.
Context& init_context(int device);

// RAII wrappers; events carry no timing, which makes record and wait cheaper.
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t s);
  void block(cudaStream_t s) const;  // s waits for this event on the device; the host does not wait
  bool query() const;               // true once the recorded work is done; throws on a device error
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Temporary device memory from the caching allocator, released (stream-ordered) at scope exit.
class Scratch {
 public:
  explicit Scratch(size_t bytes) : bytes_(bytes), p_(context().allocator().allocate(bytes)) {}
  ~Scratch() { context().allocator().deallocate(p_, bytes_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p_); }

 private:
  size_t bytes_;
  void* p_;
};

class Stream {
 public:
  explicit Stream(int priority = 0);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace amp::cuda
