#include "comm/ordered_sum.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/sum_tree.h"
#include "runtime/ops/ops.h"

namespace amp::comm {

void sum_rows_in_tree_order(const Tensor& rows, Tensor& out) {
  const int64_t R = rows.shape().at(0), n = out.numel();
  if (rows.numel() != R * n || rows.dtype() != out.dtype() || rows.device() != out.device())
    throw std::invalid_argument("sum_rows_in_tree_order: rows must be [R, n] of the output's dtype and device");
  // The rows are a private gather buffer: the partial sums are computed in it, the total copied out.
  auto tree = make_sum_tree<Tensor>([](Tensor& into, const Tensor& other) { add_(into, other); });
  for (int64_t r = 0; r < R; ++r) tree.push(rows.view(r * n, {n}));
  Tensor total = tree.fold();
  Tensor flat = out.view(0, {n});
  copy_(flat, total);
}

// The portable way: every rank gathers every rank's buffer and sums it in the tree's order. For two
// ranks the bytes received are a ring all-reduce's; each rank adds the whole buffer, not a shard.
std::unique_ptr<Work> Communicator::ordered_sum_async(Tensor& t) {
  if (size() == 1) return std::make_unique<CompletedWork>();
  const Tensor rows = all_gather(t);
  sum_rows_in_tree_order(rows, t);
  return std::make_unique<CompletedWork>();
}

namespace {
void require_shards(const Tensor& t, int ranks, const char* what) {
  if (ranks > 1 && !splits_into_shards(t.numel(), ranks))
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(t.numel()) + " elements do not split into " +
                                std::to_string(ranks) + " equal shards");
}
}  // namespace

std::unique_ptr<Work> Communicator::ordered_reduce_scatter_async(Tensor& t) {
  require_shards(t, size(), "ordered_reduce_scatter");
  return ordered_sum_async(t);  // every shard summed: this rank's among them
}

std::unique_ptr<Work> Communicator::all_gather_shards_async(Tensor& t) {
  require_shards(t, size(), "all_gather_shards");
  if (size() == 1) return std::make_unique<CompletedWork>();
  const int64_t shard = t.numel() / size();
  Tensor flat = t.view(0, {t.numel()});
  const Tensor rows = all_gather(flat.view(rank() * shard, {shard}));  // [R, shard]: the buffer's layout
  copy_(flat, rows.view(0, {t.numel()}));
  return std::make_unique<CompletedWork>();
}

}  // namespace amp::comm
