// CUDA backend: memory and copies. Kernels live in the .cu files named in cuda_backend.h.
#include "runtime/kernels/cuda/cuda_backend.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_usage.h"
#include "runtime/kernels/cuda/host_staging.h"

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
size_t CudaBackend::device_peak_bytes() {
  device_usage().sample();
  return device_usage().peak_bytes();
}

// Through pinned slots (host_staging.h): the caller may reuse src at once, and the host never waits
// for the device here (from pageable memory the driver may).
void CudaBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  static HostStaging* staging = new HostStaging;  // never destroyed, like the context
  staging->copy(dst, src, bytes, context().stream());
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

// Pinned slots for read-backs, made once and reused: cudaMallocHost is slow and cudaFreeHost
// synchronises the whole device, so neither may happen in a training step. A slot is taken by a
// read-back and given back by its destructor; when no free slot holds that many values the ring grows
// by one, of at least kMinCapacity (a multi-task step reads back a loss a task: a fixed 16 refused
// every step of more than 11 tasks).
struct ReadbackSlot {
  static constexpr size_t kMinCapacity = 16;  // floats
  size_t capacity = 0;
  float* host = nullptr;
  std::unique_ptr<Event> done;
  bool busy = false;
};

class ReadbackRing {
 public:
  ReadbackSlot* acquire(size_t values) {
    std::lock_guard<std::mutex> lock(mutex_);
    // The smallest free slot that fits: a step's small read-back leaves the large one to the read-back
    // that needs it (else that one would make a slot, cudaMallocHost, inside a step).
    ReadbackSlot* best = nullptr;
    for (auto& s : slots_)
      if (!s->busy && s->capacity >= values && (!best || s->capacity < best->capacity)) best = s.get();
    if (best) {
      best->busy = true;
      return best;
    }
    auto s = std::make_unique<ReadbackSlot>();
    s->capacity = std::max(values, ReadbackSlot::kMinCapacity);
    AMP_CUDA_CHECK(cudaMallocHost(&s->host, sizeof(float) * s->capacity));
    s->done = std::make_unique<Event>();
    s->busy = true;
    slots_.push_back(std::move(s));
    return slots_.back().get();
  }
  void release(ReadbackSlot* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    s->busy = false;  // later copies into it are queued after this one's on the same stream
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<ReadbackSlot>> slots_;  // never freed: see above
};

ReadbackRing& readback_ring() {
  static ReadbackRing* ring = new ReadbackRing;  // never destroyed, like the context
  return *ring;
}

// Copies into a pinned slot on the compute stream, then records the slot's event: ready() polls it.
class CudaReadback final : public Readback {
 public:
  explicit CudaReadback(const std::vector<Tensor>& scalars) : n_(scalars.size()) {
    for (const Tensor& t : scalars) {
      require_cuda(t, "readback tensor");
      if (t.dtype() != DType::f32 || t.numel() != 1)
        throw std::invalid_argument("readback: expected a 1-element float32 tensor");
    }
    slot_ = readback_ring().acquire(n_);  // after every check: nothing to give back on a throw
    const cudaStream_t s = context().stream();
    try {
      for (size_t i = 0; i < n_; ++i)
        AMP_CUDA_CHECK(cudaMemcpyAsync(slot_->host + i, scalars[i].data_ptr(), sizeof(float), cudaMemcpyDeviceToHost, s));
      slot_->done->record(s);
    } catch (...) {
      readback_ring().release(slot_);
      throw;
    }
  }
  ~CudaReadback() override { readback_ring().release(slot_); }
  CudaReadback(const CudaReadback&) = delete;
  CudaReadback& operator=(const CudaReadback&) = delete;
  // Event::query clears the NotReady that cudaEventQuery also leaves in the last-error slot.
  bool ready() override { return slot_->done->query(); }
  std::vector<double> values() override {
    AMP_CUDA_CHECK(cudaEventSynchronize(slot_->done->get()));  // this copy only, not later work
    return std::vector<double>(slot_->host, slot_->host + n_);
  }

 private:
  size_t n_;
  ReadbackSlot* slot_ = nullptr;
};
}  // namespace

std::unique_ptr<Readback> CudaBackend::start_readback(const std::vector<Tensor>& scalars) {
  return std::make_unique<CudaReadback>(scalars);
}

}  // namespace amp::cuda
