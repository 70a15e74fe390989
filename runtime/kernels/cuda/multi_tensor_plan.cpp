#include "runtime/kernels/cuda/multi_tensor_plan.h"

#include <stdexcept>

namespace amp::cuda {

std::vector<MultiTensorLaunch> plan_multi_tensor(const std::vector<int64_t>& numels, int64_t chunk_size,
                                                 int max_tensors, int max_blocks) {
  if (chunk_size <= 0 || max_tensors <= 0 || max_blocks <= 0)
    throw std::invalid_argument("plan_multi_tensor: chunk size and limits must be positive");
  // The launches that max_blocks needs, each given an equal share of the chunks (a last launch of a
  // few blocks would leave most SMs idle while it streams its chunks).
  int64_t total = 0;
  for (int64_t n : numels) total += (n + chunk_size - 1) / chunk_size;
  if (total > max_blocks) {
    const int64_t launches = (total + max_blocks - 1) / max_blocks;
    max_blocks = static_cast<int>((total + launches - 1) / launches);
  }
  std::vector<MultiTensorLaunch> plan;
  MultiTensorLaunch cur;
  auto flush = [&] {
    if (!cur.block_slot.empty()) plan.push_back(std::move(cur));
    cur = MultiTensorLaunch{};
  };
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t chunks = (numels[t] + chunk_size - 1) / chunk_size;
    if (chunks > INT32_MAX) throw std::invalid_argument("plan_multi_tensor: tensor too large for 32-bit chunk indices");
    for (int64_t c = 0; c < chunks; ++c) {
      if (static_cast<int>(cur.block_slot.size()) == max_blocks) flush();
      if (cur.tensors.empty() || cur.tensors.back() != static_cast<int>(t)) {
        if (static_cast<int>(cur.tensors.size()) == max_tensors) flush();
        cur.tensors.push_back(static_cast<int>(t));
      }
      cur.block_slot.push_back(static_cast<int>(cur.tensors.size()) - 1);
      cur.block_chunk.push_back(static_cast<int32_t>(c));
    }
  }
  flush();
  return plan;
}

int64_t element_wise_chunk_size(const std::vector<int64_t>& numels, int64_t bytes_per_element, int sms,
                                int64_t chunk_size, int64_t min_chunk, int max_tensors, int max_blocks,
                                int64_t min_bytes) {
  // A plan shares its blocks evenly among the launches it needs, so each has at least half the limit:
  // asking for more SMs than that would shrink the chunks of a call that fills every launch.
  if (sms > max_blocks / 2) sms = max_blocks / 2;
  for (;; chunk_size /= 2) {
    if (chunk_size / 2 < min_chunk) return chunk_size;
    bool thin = false;
    for (const MultiTensorLaunch& launch : plan_multi_tensor(numels, chunk_size, max_tensors, max_blocks)) {
      int64_t elements = 0;
      for (size_t b = 0; b < launch.block_slot.size(); ++b) {
        const int64_t numel = numels[static_cast<size_t>(launch.tensors[static_cast<size_t>(launch.block_slot[b])])];
        const int64_t begin = static_cast<int64_t>(launch.block_chunk[b]) * chunk_size;
        elements += numel - begin < chunk_size ? numel - begin : chunk_size;
      }
      if (elements * bytes_per_element > min_bytes && static_cast<int>(launch.block_slot.size()) < sms) thin = true;
    }
    if (!thin) return chunk_size;
  }
}

std::vector<ChunkedGroup> element_wise_groups(const std::vector<int64_t>& numels, int64_t bytes_per_element, int sms,
                                              int64_t chunk_size, int64_t min_chunk, int max_tensors, int max_blocks) {
  ChunkedGroup large{{}, chunk_size}, small{{}, chunk_size};
  std::vector<int64_t> small_numels;
  for (size_t t = 0; t < numels.size(); ++t) {
    if (numels[t] > chunk_size) {
      large.tensors.push_back(static_cast<int>(t));
    } else {
      small.tensors.push_back(static_cast<int>(t));
      small_numels.push_back(numels[t]);
    }
  }
  small.chunk_size = element_wise_chunk_size(small_numels, bytes_per_element, sms, chunk_size, min_chunk, max_tensors,
                                             max_blocks);
  if (small.chunk_size == chunk_size) {  // nothing to spread: one plan, as the tensors came
    ChunkedGroup all{{}, chunk_size};
    for (size_t t = 0; t < numels.size(); ++t) all.tensors.push_back(static_cast<int>(t));
    return all.tensors.empty() ? std::vector<ChunkedGroup>{} : std::vector<ChunkedGroup>{all};
  }
  std::vector<ChunkedGroup> groups;
  for (ChunkedGroup* g : {&large, &small})
    if (!g->tensors.empty()) groups.push_back(std::move(*g));
  return groups;
}

int64_t multi_tensor_block_count(const std::vector<int64_t>& numels, int64_t chunk_size) {
  int64_t blocks = 0;
  for (int64_t n : numels) blocks += (n + chunk_size - 1) / chunk_size;
  return blocks;
}

}  // namespace amp::cuda
