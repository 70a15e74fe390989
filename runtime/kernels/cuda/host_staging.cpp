#include "runtime/kernels/cuda/host_staging.h"

#include <cstring>
#include <stdexcept>

#include "runtime/kernels/cuda/cuda_check.h"

namespace amp::cuda {

namespace {
// Slots of at least 64 KiB, in powers of two: a step's uploads of one size share them.
size_t slot_size(size_t bytes) {
  size_t s = size_t{64} << 10;
  while (s < bytes) s *= 2;
  return s;
}
}  // namespace

HostStaging::~HostStaging() {
  for (Slot& s : slots_) AMP_CUDA_CHECK_NOTHROW(cudaFreeHost(s.host));  // after the device's work (cudaFreeHost waits)
}

void HostStaging::copy(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes == 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  AMP_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    throw std::logic_error("a host-to-device copy while the stream captures a CUDA graph: every replay would copy "
                           "the staging memory again, not this data (stage the step's inputs before the capture)");
  if (bytes > kMaxStagedBytes) {
    AMP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Slot* slot = nullptr;
  for (Slot& c : slots_)
    if (c.bytes >= bytes && c.done->query() && (slot == nullptr || c.bytes < slot->bytes)) slot = &c;
  if (slot == nullptr) {
    Slot fresh;
    fresh.bytes = slot_size(bytes);
    AMP_CUDA_CHECK(cudaMallocHost(&fresh.host, fresh.bytes));
    fresh.done = std::make_unique<Event>();
    slots_.push_back(std::move(fresh));
    slot = &slots_.back();
  }
  std::memcpy(slot->host, src, bytes);
  AMP_CUDA_CHECK(cudaMemcpyAsync(dst, slot->host, bytes, cudaMemcpyHostToDevice, s));
  slot->done->record(s);
}

size_t HostStaging::slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.size();
}

}  // namespace amp::cuda
