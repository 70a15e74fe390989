// The sum over ranks whose bits do not depend on the number of ranks' transport, the buffer's size
// or the rank that reads it: every element adds the ranks' values in the order of the tree of
// comm/sum_tree.h. This is what makes a step's gradients, losses and validation loss the same
// whatever split of the step's samples into ranks x micro-batches (README, "The same training on
// any number of ranks").
#pragma once
#include "runtime/core/tensor.h"

namespace amp::comm {

// The ring's way to the same sums, for a buffer of n elements that splits into R equal shards:
// rank j receives every rank's shard j (an all-to-all), adds those R rows in the tree's order into
// its own shard, and the shards are all-gathered. Each element is the same tree sum of the same
// numbers as the gather's, so the bits are the same; each rank sends 2 (R - 1) / R of the buffer,
// a ring all-reduce's bytes, instead of the gather's R - 1 buffers.
inline bool splits_into_shards(int64_t n, int ranks) { return ranks > 1 && n > 0 && n % ranks == 0; }

// out[i] = the tree sum over r of rows[r][i]: rows is [R, n] (any device), out n contiguous elements
// of the same dtype and device.
void sum_rows_in_tree_order(const Tensor& rows, Tensor& out);

}  // namespace amp::comm
