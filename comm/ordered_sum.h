// The sum over ranks whose bits do not depend on the number of ranks' transport, the buffer's size
// or the rank that reads it: every element adds the ranks' values in the order of the tree of
// comm/sum_tree.h. This is what makes a step's gradients, losses and validation loss the same
// whatever split of the step's samples into ranks x micro-batches (README, "The same training on
// any number of ranks").
#pragma once
#include "runtime/core/tensor.h"

namespace amp::comm {

// out[i] = the tree sum over r of rows[r][i]: rows is [R, n] (any device), out n contiguous elements
// of the same dtype and device.
void sum_rows_in_tree_order(const Tensor& rows, Tensor& out);

}  // namespace amp::comm
