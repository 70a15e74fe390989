// Broadcast indexing shared by the element-wise and reduction kernels: an operand of shape `in`
// read at every index of shape `out` has stride 0 along the dims it is broadcast over. Built on the
// host, passed to kernels by value. Plain C++ with AMP_HD, so the host tests check it without a GPU.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "runtime/core/hd.h"
#include "runtime/core/tensor.h"

namespace amp::cuda {

inline constexpr int kMaxDims = 8;

struct BroadcastIndex {
  int ndim = 0;
  int64_t out_shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // element strides of the operand, 0 where broadcast
  bool identity = false;           // operand already has out's shape: offset == linear index
  bool scalar = false;             // operand has one element: offset == 0

  // Offset of the operand's element that output index `linear` reads.
  AMP_HD int64_t offset(int64_t linear) const {
    if (identity) return linear;
    if (scalar) return 0;
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t idx = linear % out_shape[d];
      linear /= out_shape[d];
      off += idx * strides[d];
    }
    return off;
  }
};

// Throws the CPU backend's messages for shapes that do not broadcast.
inline BroadcastIndex make_broadcast_index(const Shape& in, const Shape& out) {
  if (in.size() > out.size())
    throw std::invalid_argument("shape " + shape_str(in) + " has more dims than " + shape_str(out));
  if (out.size() > static_cast<size_t>(kMaxDims))
    throw std::invalid_argument("CUDA backend: broadcasting supports at most 8 dims, got " + shape_str(out));
  BroadcastIndex b;
  b.ndim = static_cast<int>(out.size());
  int64_t stride = 1;
  for (size_t k = 0; k < in.size(); ++k) {
    const size_t di = in.size() - 1 - k;
    const size_t dout = out.size() - 1 - k;
    if (in[di] != 1 && in[di] != out[dout])
      throw std::invalid_argument("shape " + shape_str(in) + " cannot broadcast to " + shape_str(out));
    if (in[di] != 1) b.strides[dout] = stride;
    stride *= in[di];
  }
  for (size_t d = 0; d < out.size(); ++d) b.out_shape[d] = out[d];
  b.identity = in == out;
  b.scalar = shape_numel(in) == 1;
  return b;
}

}  // namespace amp::cuda
