// 128-bit loads and stores for the contiguous element-wise kernels: N elements of T packed in one
// aligned struct, so that a thread moves 16 bytes (8 for a narrower side of a cast) per access
// instead of 2 or 4. A launcher takes the packed kernel only where every pointer is aligned to its
// pack (fresh tensors are; a view at an odd offset is not) and passes the element count; the
// kernel's packs cover the first n / N * N elements and its first threads the rest (the tail).
#pragma once
#include <cstdint>

#include "runtime/kernels/cuda/device_elem.cuh"

namespace amp::cuda {

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements per pack of a kernel reading S and writing D: 16 bytes of the wider of the two.
template <class S, class D = S>
inline constexpr int kPackOf = static_cast<int>(16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D)));

inline bool pack_aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0; }

// The launch of a packed kernel over n elements: packs of N, grid_for over the packs (at least one
// block, whose first threads also take the tail).
inline unsigned packed_grid(int64_t n, int pack, int sm_count) { return grid_for((n + pack - 1) / pack, sm_count); }

}  // namespace amp::cuda
