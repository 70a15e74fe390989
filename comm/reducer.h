// GradientReducer: DDP-style bucketed gradient averaging.
//
// Parameters are packed into buckets in reverse order (the order backward produces gradients):
// the first bucket holds about first_bucket_bytes, the rest about bucket_bytes each. A leaf's
// post-accumulate hook copies its final gradient into its bucket; a full bucket is all-reduced at
// once with a non-blocking collective (an average, or with ReducerOptions::ordered_sum a sum in the
// fixed order of comm/sum_tree.h) while backward goes on. Every rank launches buckets in
// the same fixed order. Micro-batches other than the last run with sync off (no communication);
// their gradients join the tree of comm/sum_tree.h, and the last one's complete it before launch.
// After finish() each .grad is a view of its slice of a bucket, so the reduced gradients are not
// copied back; buckets come from Communicator::make_buffer (shared memory on one node). With a
// single rank and one micro-batch the reducer does nothing at all (no copies).
#pragma once
#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace amp::comm {

struct ReducerOptions {
  size_t bucket_bytes = 25u << 20;
  size_t first_bucket_bytes = 1u << 20;
  bool overlap = true;  // false: launch every bucket only in finish(), after backward
  // The micro-batches of a step: with several, each one's gradients are kept apart and summed in
  // the tree's order (comm/sum_tree.h), one rank included, so that the sum is the same whatever the
  // split of the step into ranks x micro-batches.
  int64_t micro_batches = 1;
  // false: the gradients are averaged over ranks (DDP's semantics). true: summed over ranks in the
  // tree's order (Communicator::ordered_sum_async) with nothing divided, for losses that carry
  // 1/(ranks x micro-batches) themselves: amp_train's rank-invariant step.
  bool ordered_sum = false;
  // ZeRO-1 (with ordered_sum): each bucket is only reduce-scattered (Communicator::
  // ordered_reduce_scatter_async): after finish() this rank's shard of every bucket holds the
  // summed gradients, the rest of the bucket is unspecified. See shard() and gather_shards().
  bool shard = false;
  // Each bucket's shards are a whole number of this many elements (a multiple of 4), so that fixed
  // chunks of the bucket (comm/chunked_norm.h) never straddle two ranks.
  size_t shard_align = 4;
  // false: buckets even for one rank and one micro-batch, where nothing is summed (ZeRO-1's shards
  // are the buckets' pieces). The chunked norm needs none (comm/chunked_norm.h reads the gradients at
  // their planned slots).
  bool passthrough = true;
};

// Where one parameter lies in the buckets: elements [offset, offset + numel) of bucket `bucket`,
// a multiple of 4 from its start. `param` indexes the constructor's list.
struct SlotLayout {
  size_t param;
  size_t bucket;
  int64_t offset;
  int64_t numel;
};

// The buckets' layout: bucket b holds numel[b] elements; used[b] is its extent over its slots, a
// multiple of 4 that does not depend on the number of ranks (only the zero padding after it does).
struct BucketLayout {
  std::vector<int64_t> numel;
  std::vector<int64_t> used;
  std::vector<SlotLayout> slots;  // in bucket order (the parameters' reverse order)
};

// The layout a GradientReducer over params with these options makes on `ranks` ranks (no buffers,
// no communication: ZeRO-1 plans its shards before the reducer exists).
BucketLayout plan_buckets(const std::vector<Tensor>& params, const ReducerOptions& options, int ranks);

class GradientReducer {
 public:
  GradientReducer(std::vector<Tensor> params, Communicator& comm, ReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Call before a backward. sync=false (no_sync): gradients only accumulate locally.
  void prepare_for_backward(bool sync);
  // After the synced backward: launches what is left, waits for every bucket, and writes the
  // reduced gradients back into .grad.
  void finish();

  size_t num_buckets() const;
  // Empty when the reducer passes gradients through (one rank, one micro-batch, passthrough).
  BucketLayout layout() const;
  // The buckets' layout whether or not they exist: where each gradient lies, or would lie when the
  // reducer passes them through (then no buffer, and nothing held between steps).
  const BucketLayout& plan() const;
  bool passthrough() const;
  std::vector<Tensor> buffers() const;  // the buckets, as layout() lists them

  // Buckets launched from inside backward (by the hooks) during the last synced backward.
  size_t launched_during_backward() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace amp::comm
