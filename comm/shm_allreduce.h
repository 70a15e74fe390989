// Intra-node all-reduce through an MPI-3 shared-memory window, for the large CPU buffers of the
// gradient reducer. Open MPI's shared-memory all-reduce moves under 1 GB/s on the machines here;
// this one runs at memory speed.
//
// Per chunk: every rank copies its data into its own slot; after a barrier, rank r sums segment r
// over all slots in rank order and writes the sum into segment r of every slot; after a second
// barrier every rank copies its slot back. The sum of each element is taken in rank order whatever
// the chunking, so results are bitwise independent of bucket sizes and equal on every rank.
#pragma once
#include <mpi.h>

#include <functional>
#include <vector>

#include "runtime/tensor.h"

namespace amp::comm {

class ShmAllReduce {
 public:
  // Collective over node_comm (every rank on one node). slot_bytes: the window each rank owns.
  ShmAllReduce(MPI_Comm node_comm, size_t slot_bytes);
  ~ShmAllReduce();
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  // In-place sum (max when take_max) of a contiguous CPU f32 or f64 tensor, multiplied by scale
  // (1/size for an average: the same rounding as a sum followed by that multiplication, without a
  // pass of its own). barrier() must be a barrier over node_comm, bounded by the caller's timeout.
  void run(Tensor& t, bool take_max, double scale, const std::function<void()>& barrier);

 private:
  MPI_Win win_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1;
  size_t slot_bytes_;
  std::vector<char*> slots_;  // every rank's slot, mapped into this process
};

}  // namespace amp::comm
