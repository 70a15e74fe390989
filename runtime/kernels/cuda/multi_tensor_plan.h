// The host half of the multi-tensor launcher (multi_tensor_apply.cuh), in the spirit of apex's
// multi_tensor_apply: the tensors of one call are cut into fixed-size chunks, one thread block per
// chunk, and as many chunks as fit in one kernel's parameter block go into one launch. A call over
// all gradients of a model therefore costs a handful of launches, not one per tensor.
//
// Plain C++, so the host tests check the plan without a GPU.
#pragma once
#include <cstdint>
#include <vector>

namespace amp::cuda {

struct MultiTensorLaunch {
  std::vector<int> tensors;         // the caller's tensor indices, one per slot of this launch
  std::vector<int> block_slot;      // per block: the slot of the tensor it works on
  std::vector<int32_t> block_chunk; // per block: which chunk of that tensor
};

// Every element of every tensor is covered by exactly one block. A tensor whose chunks do not fit
// in one launch continues in the next one. Empty tensors get no block. When the chunks need several
// launches, they are shared out evenly (as few launches as max_blocks allows, of equal size where
// max_tensors does not cut one short).
std::vector<MultiTensorLaunch> plan_multi_tensor(const std::vector<int64_t>& numels, int64_t chunk_size,
                                                 int max_tensors, int max_blocks);

// The number of blocks a plan has in total (the size of per-block partial results).
int64_t multi_tensor_block_count(const std::vector<int64_t>& numels, int64_t chunk_size);

// The chunk size for an element-wise call (one whose blocks leave no per-block results): chunk_size,
// halved down to min_chunk while a launch of its plan moves more than min_bytes (at bytes_per_element)
// on fewer blocks than the GPU has SMs. Small tensors take one chunk each and a launch at most
// max_tensors of them (its parameter block's limit): such a launch would stream its bytes through
// a few SMs. A call that has enough blocks keeps chunk_size.
int64_t element_wise_chunk_size(const std::vector<int64_t>& numels, int64_t bytes_per_element, int sms,
                                int64_t chunk_size, int64_t min_chunk, int max_tensors, int max_blocks,
                                int64_t min_bytes = int64_t{1} << 20);

// An element-wise call's tensors in groups, each launched at its own chunk size: the tensors of more
// than one chunk at chunk_size, the others (one chunk each: a model's biases and LayerNorm weights)
// at element_wise_chunk_size's for them alone, so that they spread over the SMs without
// multiplying the large tensors' launches; one group of all at chunk_size when the small ones need
// no smaller chunk. Indices into numels; empty groups are left out.
struct ChunkedGroup {
  std::vector<int> tensors;
  int64_t chunk_size;
};
std::vector<ChunkedGroup> element_wise_groups(const std::vector<int64_t>& numels, int64_t bytes_per_element, int sms,
                                              int64_t chunk_size, int64_t min_chunk, int max_tensors, int max_blocks);

}  // namespace amp::cuda
