#include "comm/chunked_norm.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp::comm {

namespace {

int64_t chunks_of(int64_t n) { return (n + kNormChunk - 1) / kNormChunk; }

// The chunks' sums (in bucket then chunk order) summed in that order, as a 1-element f32.
Tensor sum_of_chunk_sums(const Tensor& partial) {
  Tensor acc = zeros({1}, DType::f32, partial.device());
  backend_for(partial.device()).norm_accumulate({partial}, 1.0, acc);  // the sums are >= 0 (or NaN): |x| is x
  return acc;
}

}  // namespace

Tensor chunked_sum_of_squares(const BucketLayout& layout, const std::vector<Tensor>& buffers, Communicator& comm,
                              bool sharded, const Tensor& grad_scale, const Tensor& found_inf) {
  if (buffers.empty() || buffers.size() != layout.used.size())
    throw std::invalid_argument("chunked_sum_of_squares: no buckets, or not the layout's");
  const Device device = buffers[0].device();
  int64_t total = 0;
  for (int64_t used : layout.used) total += chunks_of(used);
  Tensor partial = zeros({total}, DType::f32, device);  // chunk sums, in bucket then chunk order
  Backend& be = backend_for(device);
  const int64_t R = sharded ? comm.size() : 1, me = sharded ? comm.rank() : 0;
  int64_t base = 0;
  for (size_t b = 0; b < buffers.size(); ++b) {
    const Tensor& buf = buffers[b];
    const int64_t n = chunks_of(layout.used[b]);
    const int64_t shard = buf.numel() / R;  // a whole number of chunks when sharded
    if (sharded && shard % kNormChunk != 0)
      throw std::logic_error("chunked_sum_of_squares: a shard is not a whole number of chunks");
    const int64_t first = sharded ? std::min(n, me * shard / kNormChunk) : 0;
    const int64_t last = sharded ? std::min(n, (me + 1) * shard / kNormChunk) : n;
    if (last > first) {  // chunks [first, last): one launch
      const int64_t begin = first * kNormChunk, end = std::min(layout.used[b], last * kNormChunk);
      Tensor out = partial.view(base + first, {last - first});
      be.chunk_sums_of_squares(buf.view(begin, {end - begin}), kNormChunk, out, grad_scale, found_inf);
    }
    base += n;
  }
  if (R > 1) comm.ordered_sum(partial);  // each chunk's sum is nonzero on one rank only: exact
  return sum_of_chunk_sums(partial);
}

Tensor chunked_sum_of_squares_unbucketed(const BucketLayout& layout, const std::vector<Tensor>& params,
                                         const Tensor& grad_scale, const Tensor& found_inf) {
  if (params.empty() || layout.used.empty()) throw std::invalid_argument("chunked_sum_of_squares_unbucketed: no parameters");
  const Device device = params[0].device();
  int64_t total = 0;
  for (int64_t used : layout.used) total += chunks_of(used);
  Tensor partial = zeros({total}, DType::f32, device);
  Backend& be = backend_for(device);
  // The slots are in bucket order, each bucket's in ascending offsets (comm/reducer.h).
  std::vector<Tensor> pieces;
  std::vector<int64_t> offsets;
  int64_t base = 0;
  size_t s = 0;
  for (size_t b = 0; b < layout.used.size(); ++b) {
    pieces.clear();
    offsets.clear();
    for (; s < layout.slots.size() && layout.slots[s].bucket == b; ++s) {
      const SlotLayout& slot = layout.slots[s];
      const Tensor g = params.at(slot.param).grad();
      if (!g.defined()) continue;  // zeros, as finish() fills its slot
      pieces.push_back(g);
      offsets.push_back(slot.offset);
    }
    const int64_t n = chunks_of(layout.used[b]);
    Tensor out = partial.view(base, {n});
    if (n > 0) be.chunk_sums_of_squares_gathered(pieces, offsets, layout.used[b], kNormChunk, out, grad_scale, found_inf);
    base += n;
  }
  return sum_of_chunk_sums(partial);
}

}  // namespace amp::comm
