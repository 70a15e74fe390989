#include "comm/shm_allreduce.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "comm/sum_tree.h"

namespace amp::comm {

ShmAllReduce::ShmAllReduce(MPI_Comm node_comm, size_t slot_bytes) : slot_bytes_(slot_bytes) {
  MPI_Comm_rank(node_comm, &rank_);
  MPI_Comm_size(node_comm, &size_);
  char* mine = nullptr;
  if (MPI_Win_allocate_shared(static_cast<MPI_Aint>(slot_bytes), 1, MPI_INFO_NULL, node_comm, &mine, &win_) !=
      MPI_SUCCESS)
    throw std::runtime_error("MPI_Win_allocate_shared of " + std::to_string(slot_bytes) + " bytes failed");
  slots_.resize(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    MPI_Aint size = 0;
    int disp = 0;
    void* base = nullptr;
    MPI_Win_shared_query(win_, r, &size, &disp, &base);
    slots_[static_cast<size_t>(r)] = static_cast<char*>(base);
  }
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win_);  // one passive epoch; MPI_Win_sync orders the accesses
}

ShmAllReduce::~ShmAllReduce() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || win_ == MPI_WIN_NULL) return;
  MPI_Win_unlock_all(win_);
  MPI_Win_free(&win_);
}

namespace {

// Below this many elements a reduction runs on one thread.
constexpr long kParallelGrain = 1 << 15;

// Reduces [first, first + count) over every slot into every slot, or into slot `into` alone (>= 0).
template <class T>
void reduce_segment(const std::vector<char*>& slots, int into, size_t first, size_t count, bool take_max, double scale) {
  const T k = static_cast<T>(scale);
  const long n = static_cast<long>(count);
  std::vector<T*> src;
  for (char* s : slots) src.push_back(reinterpret_cast<T*>(s) + first);
  if (!take_max && src.size() == 2) {
    // The common case (two ranks, a sum or an average), written so that it vectorises.
    if (into >= 0) {
      const T* a = src[0];
      const T* b = src[1];
      T* d = src[static_cast<size_t>(into)];  // a or b: each element is read before it is written
#pragma omp parallel for simd schedule(static) if (n > kParallelGrain)
      for (long i = 0; i < n; ++i) d[i] = (a[i] + b[i]) * k;
      return;
    }
    T* __restrict a = src[0];
    T* __restrict b = src[1];
#pragma omp parallel for simd schedule(static) if (n > kParallelGrain)
    for (long i = 0; i < n; ++i) {
      const T v = (a[i] + b[i]) * k;  // k == 1 leaves the sum as it is
      a[i] = v;
      b[i] = v;
    }
    return;
  }
  // A sum adds in the order of the tree over ranks (sum_tree.h), which for two or three ranks is
  // rank order: the bits are those of every other transport's ordered sum (ordered_sum.h).
  const int64_t R = static_cast<int64_t>(src.size());
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (long i = 0; i < n; ++i) {
    T acc = src[0][i];
    if (take_max)
      for (size_t r = 1; r < src.size(); ++r) acc = std::max(acc, src[r][i]);
    else
      acc = tree_sum<T>(R, [&](int64_t r) { return src[static_cast<size_t>(r)][i]; });
    if (scale != 1.0) acc = acc * k;
    for (size_t r = 0; r < src.size(); ++r)
      if (into < 0 || static_cast<int>(r) == into) src[r][i] = acc;
  }
}

}  // namespace

void ShmAllReduce::reduce_in_place(int64_t numel, DType dtype, bool take_max, double scale, const Barrier& barrier) {
  reduce(numel, dtype, take_max, scale, -1, barrier);
}

void ShmAllReduce::reduce_scatter_in_place(int64_t numel, DType dtype, const Barrier& barrier) {
  if (numel % size_ != 0)
    throw std::invalid_argument("shared-memory reduce-scatter: " + std::to_string(numel) + " elements do not split into " +
                                std::to_string(size_) + " shards");
  reduce(numel, dtype, false, 1.0, rank_, barrier);
}

void ShmAllReduce::reduce(int64_t numel, DType dtype, bool take_max, double scale, int into, const Barrier& barrier) {
  const size_t n = static_cast<size_t>(numel);
  if (n * dtype_size(dtype) > slot_bytes_) throw std::invalid_argument("shared-memory all-reduce: buffer exceeds the slot");
  MPI_Win_sync(win_);
  barrier();  // every slot is filled
  MPI_Win_sync(win_);
  const size_t seg = (n + static_cast<size_t>(size_) - 1) / static_cast<size_t>(size_);
  const size_t first = std::min(n, seg * static_cast<size_t>(rank_));
  const size_t count = std::min(seg, n - first);
  if (dtype == DType::f32) reduce_segment<float>(slots_, into, first, count, take_max, scale);
  else reduce_segment<double>(slots_, into, first, count, take_max, scale);
  MPI_Win_sync(win_);
  barrier();  // every segment is reduced (and no slot is refilled while a peer still reads it)
  MPI_Win_sync(win_);
}

void ShmAllReduce::run(Tensor& t, bool take_max, double scale, const Barrier& barrier) {
  if (!t.device().is_cpu() || (t.dtype() != DType::f32 && t.dtype() != DType::f64))
    throw std::invalid_argument("shared-memory all-reduce takes CPU float32/float64 tensors");
  const size_t elem = dtype_size(t.dtype());
  const size_t per_chunk = slot_bytes_ / elem;
  char* data = static_cast<char*>(t.data_ptr());
  const size_t total = static_cast<size_t>(t.numel());
  for (size_t done = 0; done < total; done += per_chunk) {
    const size_t n = std::min(per_chunk, total - done);
    std::memcpy(slots_[static_cast<size_t>(rank_)], data + done * elem, n * elem);
    reduce_in_place(static_cast<int64_t>(n), t.dtype(), take_max, scale, barrier);
    std::memcpy(data + done * elem, slots_[static_cast<size_t>(rank_)], n * elem);
  }
  // The next call's first barrier also keeps peers from overwriting a slot before it is read.
}

Tensor ShmAllReduce::buffer(int64_t numel, DType dtype) {
  if (static_cast<size_t>(numel) * dtype_size(dtype) > slot_bytes_)
    throw std::invalid_argument("shared-memory buffer larger than its slot");
  // The window outlives the tensor by contract (see the header): no ownership to share.
  Tensor t = from_external(slots_[static_cast<size_t>(rank_)], {numel}, dtype, kCPU,
                           std::shared_ptr<void>(this, [](void*) {}));
  std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

}  // namespace amp::comm
