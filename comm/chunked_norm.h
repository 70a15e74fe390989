// The gradient norm whose bits depend neither on the number of ranks nor on ZeRO-1's sharding.
// torch.nn.utils.clip_grad_norm_ takes each tensor's norm, then the norm of those: with sharded
// gradients a tensor's elements are split between ranks at places that move with the number of
// ranks, so that grouping cannot be kept. Here the unit is a fixed chunk of kNormChunk elements of a
// gradient bucket (the buckets' layout does not depend on the ranks, comm/reducer.h): each chunk's
// sum of squares, then the sum of the chunks' sums in bucket and chunk order. A chunk never
// straddles two ranks' shards (ReducerOptions::shard_align = kNormChunk), so one rank computes
// each chunk's sum, and the sum over ranks of the partial sums (zero on every other rank) is exact.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "comm/reducer.h"

namespace amp::comm {

constexpr int64_t kNormChunk = 1024;

// The sum of squares of every gradient in the buckets, as a 1-element float32 tensor on their
// device (its square root is the L2 norm). sharded: this rank holds only its shard of each bucket
// (ZeRO-1); a collective then. Otherwise each rank reads whole buckets, and nothing is sent.
// grad_scale (a 1-element f32 on their device, or undefined): the gradients still carry that loss
// scale, and the sum is the one of the unscaled gradients, bit for bit, without writing them
// (Backend::chunk_sums_of_squares). found_inf (a 1-element f32 on their device, or undefined): set
// to 1 where a gradient this rank reads is not finite unscaled, in the same read (the loss scaler's
// check, GradScaler::check_inf_ with a fused pass); this rank's verdict, not summed over the ranks.
Tensor chunked_sum_of_squares(const BucketLayout& layout, const std::vector<Tensor>& buffers, Communicator& comm,
                              bool sharded, const Tensor& grad_scale, const Tensor& found_inf = Tensor());

// The same sum where there are no buckets (one rank, one micro-batch: the reducer passes the
// gradients through, GradientReducer::passthrough): each parameter's gradient is read where it
// lies, at its slot of `layout` (GradientReducer::plan), zeros between them and for a parameter
// without a gradient; bit for bit the sum over the buckets the reducer would have filled, whose
// memory (4 bytes a parameter, held from one step to the next) the run does not hold
// (Backend::chunk_sums_of_squares_gathered). params: the reducer's, in the order the layout's slots
// index.
// found_inf: as chunked_sum_of_squares'.
Tensor chunked_sum_of_squares_unbucketed(const BucketLayout& layout, const std::vector<Tensor>& params,
                                         const Tensor& grad_scale, const Tensor& found_inf = Tensor());

}  // namespace amp::comm
