// Intra-node all-reduce through an MPI-3 shared-memory window. Open MPI's shared-memory all-reduce
// moves under 1 GB/s on the machines here; this one runs at memory speed.
//
// Each rank owns one slot of the window. A reduction: after a barrier, rank r sums segment r over
// all slots in rank order and writes the result into segment r of every slot; after a second
// barrier every slot holds the result. Each element is summed in the order of the tree over ranks
// (comm/sum_tree.h) whatever the buffer's size, so results are bitwise independent of bucket sizes,
// equal on every rank, and those of the other transports' ordered sums.
//
// Two ways in: run() copies any tensor through the slot in chunks; buffer() hands out the slot
// itself as a tensor, which reduce_in_place() then reduces with no copy at all (the gradient
// reducer's buckets live there).
#pragma once
#include <mpi.h>

#include <functional>
#include <vector>

#include "runtime/core/tensor.h"

namespace amp::comm {

class ShmAllReduce {
 public:
  // Collective over node_comm (every rank on one node). slot_bytes: the window each rank owns.
  ShmAllReduce(MPI_Comm node_comm, size_t slot_bytes);
  ~ShmAllReduce();  // collective (MPI_Win_free)
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  using Barrier = std::function<void()>;  // a barrier over node_comm, bounded by the caller's timeout

  // In-place sum (max when take_max) of a contiguous CPU f32 or f64 tensor, multiplied by scale
  // (1/size for an average: the rounding of a sum followed by that multiplication, in one pass).
  void run(Tensor& t, bool take_max, double scale, const Barrier& barrier);
  // This rank's slot as a zero-filled tensor of numel elements (valid while this object lives).
  Tensor buffer(int64_t numel, DType dtype);
  // Reduces the first numel elements of every slot in place.
  void reduce_in_place(int64_t numel, DType dtype, bool take_max, double scale, const Barrier& barrier);
  // The sum's reduce-scatter half: segment r of the first numel elements (numel / size of them,
  // numel a multiple of size) summed over every slot into slot r alone, in the same order and so to
  // the same bits; the rest of this rank's slot is left as it was. A rank sums, and writes, 1/size
  // of what reduce_in_place writes.
  void reduce_scatter_in_place(int64_t numel, DType dtype, const Barrier& barrier);
  bool owns(const Tensor& t) const { return t.data_ptr() == slots_[static_cast<size_t>(rank_)]; }

 private:
  // into: the slot that takes each segment's result, or -1 for every slot.
  void reduce(int64_t numel, DType dtype, bool take_max, double scale, int into, const Barrier& barrier);

  MPI_Win win_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1;
  size_t slot_bytes_;
  std::vector<char*> slots_;  // every rank's slot, mapped into this process
};

}  // namespace amp::comm
