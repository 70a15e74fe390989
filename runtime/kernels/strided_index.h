// The offset of element `linear` (in row-major order) of a strided view: dim d has extent size[d]
// and steps stride[d] elements through the underlying storage. Permutes and the reductions' kept
// and summed dims use it, on the CPU and in kernels (built on the host, passed by value).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/core/hd.h"

namespace amp::math {

template <int kMax>
struct StridedIndex {
  int n = 0;
  int64_t size[kMax] = {};
  int64_t stride[kMax] = {};
  AMP_HD int64_t offset(int64_t linear) const {
    int64_t off = 0;
    for (int d = n - 1; d >= 0; --d) {
      off += (linear % size[d]) * stride[d];
      linear /= size[d];
    }
    return off;
  }
};

// The view of a row-major tensor of `shape` with its dims permuted: out dim d is dim perm[d].
// Throws std::invalid_argument for more than kMax dims.
template <int kMax>
StridedIndex<kMax> permuted(const std::vector<int64_t>& shape, const std::vector<int64_t>& perm) {
  const int n = static_cast<int>(perm.size());
  if (n > kMax || n != static_cast<int>(shape.size()))
    throw std::invalid_argument("permute: expected a permutation of " + std::to_string(shape.size()) + " dims (at most " +
                                std::to_string(kMax) + ")");
  std::vector<int64_t> stride(static_cast<size_t>(n), 1);
  for (int d = n - 2; d >= 0; --d) stride[static_cast<size_t>(d)] = stride[static_cast<size_t>(d) + 1] * shape[static_cast<size_t>(d) + 1];
  StridedIndex<kMax> index;
  index.n = n;
  for (int d = 0; d < n; ++d) {
    index.size[d] = shape[static_cast<size_t>(perm[static_cast<size_t>(d)])];
    index.stride[d] = stride[static_cast<size_t>(perm[static_cast<size_t>(d)])];
  }
  return index;
}

}  // namespace amp::math
