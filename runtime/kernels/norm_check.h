// The arguments of norm_accumulate_each and chunk_sums_of_squares_gathered, checked alike by every
// backend.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"

namespace amp {

inline void check_norms_output(const std::vector<Tensor>& xs, const Tensor& out) {
  if (out.dtype() != DType::f32 || out.numel() != static_cast<int64_t>(xs.size()))
    throw std::invalid_argument("norm_accumulate_each: the output must be a float32 tensor of " +
                                std::to_string(xs.size()) + " elements (one per tensor)");
  for (const Tensor& x : xs)
    if (x.device() != out.device())
      throw std::invalid_argument("norm_accumulate_each: every tensor must be on the output's device");
}

// chunk_sums_of_squares_gathered's pieces: float32 on out's device, in order and apart within [0, n).
inline void check_gathered_pieces(const std::vector<Tensor>& pieces, const std::vector<int64_t>& offsets, int64_t n,
                                  const Tensor& out) {
  const std::string what = "chunk_sums_of_squares_gathered: ";
  if (pieces.size() != offsets.size())
    throw std::invalid_argument(what + std::to_string(pieces.size()) + " pieces but " + std::to_string(offsets.size()) +
                                " offsets");
  int64_t end = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Tensor& p = pieces[i];
    if (!p.defined() || p.dtype() != DType::f32 || p.device() != out.device())
      throw std::invalid_argument(what + "piece " + std::to_string(i) + " is not a float32 tensor on the output's device");
    if (offsets[i] < end || offsets[i] > n - p.numel())
      throw std::invalid_argument(what + "piece " + std::to_string(i) + " at " + std::to_string(offsets[i]) + " (" +
                                  std::to_string(p.numel()) + " elements) overlaps the one before it or ends past " +
                                  std::to_string(n));
    end = offsets[i] + p.numel();
  }
}

}  // namespace amp
