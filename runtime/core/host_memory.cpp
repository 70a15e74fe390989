// The CPU's memory: a caching allocator over aligned_alloc, copies, fills and read-backs.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>

#include "runtime/core/device_memory.h"
#include "runtime/core/dtype_dispatch.h"

namespace amp {

namespace {
// Blocks are 64-byte aligned and rounded up to a 4 KiB multiple (small ones to 64 bytes), so that
// sizes that differ by a few bytes share a bin.
size_t block_size(size_t bytes) { return bytes <= 4096 ? (bytes + 63) / 64 * 64 : (bytes + 4095) / 4096 * 4096; }
constexpr size_t kMaxCachedBytes = size_t{8} << 30;

// On the CPU the values are already there.
struct HostReadback final : Readback {
  std::vector<double> v;
  bool ready() override { return true; }
  std::vector<double> values() override { return v; }
};

class HostMemory final : public DeviceMemory {
 public:

  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    const size_t size = block_size(bytes);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_blocks_.find(size);
      if (it != free_blocks_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= size;
      }
    }
    if (p == nullptr) {
      p = std::aligned_alloc(64, size);
      if (p == nullptr) {
        empty_cache();
        p = std::aligned_alloc(64, size);
        if (p == nullptr) throw std::bad_alloc();
      }
    }
    const size_t now = current_.fetch_add(size) + size;
    size_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return p;
  }

  void deallocate(void* p, size_t bytes) override {
    if (p == nullptr) return;
    const size_t size = block_size(bytes);
    current_.fetch_sub(size);
    std::lock_guard<std::mutex> lock(mutex_);
    if (cached_bytes_ + size > kMaxCachedBytes) {
      std::free(p);
      return;
    }
    free_blocks_[size].push_back(p);
    cached_bytes_ += size;
  }

  size_t peak_bytes() const override { return peak_.load(); }
  size_t current_bytes() const override { return current_.load(); }
  void reset_peak_bytes() override { peak_.store(current_.load()); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override { if (bytes) std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { if (bytes) std::memcpy(dst, src, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override { if (bytes) std::memcpy(dst, src, bytes); }
  void synchronize() override {}

  void fill(Tensor& t, double value) override {
    const long n = static_cast<long>(t.numel());
    if (t.dtype() == DType::i64) {
      std::fill_n(t.data<int64_t>(), n, static_cast<int64_t>(value));
      return;
    }
    dispatch_float(t.dtype(), [&](auto T_tag) { using T = decltype(T_tag);
      const T v = Elem<T>::store(static_cast<typename Elem<T>::Compute>(value));
      std::fill_n(t.data<T>(), n, v);
    });
  }

  std::unique_ptr<Readback> start_readback(const std::vector<Tensor>& scalars) override {
    auto r = std::make_unique<HostReadback>();
    for (const Tensor& t : scalars) {
      if (t.dtype() != DType::f32 || t.numel() != 1)
        throw std::invalid_argument("readback: expected a 1-element float32 tensor, got " +
                                    std::string(dtype_name(t.dtype())) + " " + shape_str(t.shape()));
      r->v.push_back(t.data<float>()[0]);
    }
    return r;
  }

 private:
  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [size, blocks] : free_blocks_)
      for (void* p : blocks) std::free(p);
    free_blocks_.clear();
    cached_bytes_ = 0;
  }

  // Freed blocks are kept by size and handed out again, so the tensors of each training step reuse
  // memory that is already mapped (no page faults, no zeroing by the OS). current/peak count bytes
  // held by tensors, not the cache.
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_blocks_;
  size_t cached_bytes_ = 0;
  std::atomic<size_t> current_{0};
  std::atomic<size_t> peak_{0};
};

std::array<DeviceMemory*, 2>& registry() {
  static std::array<DeviceMemory*, 2> r{};
  return r;
}
}  // namespace

DeviceMemory& host_memory() {
  // Never destroyed: a tensor held by a static (a test's fixture cache, a user's global) is freed
  // during exit, possibly after every function-local static of this library is gone.
  static HostMemory* const m = new HostMemory;
  return *m;
}

void register_memory(DeviceType t, DeviceMemory* m) { registry()[static_cast<size_t>(t)] = m; }

DeviceMemory& memory_for(Device d) {
  if (d.is_cpu()) return host_memory();
  DeviceMemory* m = registry()[static_cast<size_t>(d.type)];
  if (m == nullptr)
    throw std::runtime_error("no memory for device " + d.str() +
                             (d.is_cuda() ? ": this build has no CUDA backend (configure with AMP_WITH_CUDA=ON), or "
                                            "CUDA was not initialised (amp::cuda_init)"
                                          : ""));
  return *m;
}

}  // namespace amp
