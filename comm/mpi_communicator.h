// Communicator over MPI for CPU tensors: non-blocking MPI_Iallreduce polled with MPI_Test, so every
// wait is bounded by the timeout. When every rank is on one node, float all-reduces go through a
// shared-memory window instead (shm_allreduce.h), and make_buffer() places the gradient buckets in
// windows of their own so they reduce with no copy; AMP_COMM_SHM=0 keeps MPI's own all-reduce.
#pragma once
#include <mpi.h>

#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/shm_allreduce.h"

namespace amp::comm {

// One request of a collective that MpiWork issues in turn (mpi_communicator.cpp): start() issues
// it; then() runs once it has completed (may be empty); `what` names it in a timeout.
struct MpiStage {
  std::string what;
  std::function<void(MPI_Request*)> start;
  std::function<void()> then;
};

class MpiCommunicator final : public Communicator {
 public:
  // comm is borrowed (usually MPI_COMM_WORLD); the node-local rank comes from a shared-memory split.
  explicit MpiCommunicator(MPI_Comm comm);
  ~MpiCommunicator() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  std::string name() const override { return "mpi"; }
  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override;
  std::unique_ptr<Work> ordered_sum_async(Tensor& t) override;
  std::unique_ptr<Work> ordered_reduce_scatter_async(Tensor& t) override;
  std::unique_ptr<Work> all_gather_shards_async(Tensor& t) override;
  void broadcast(Tensor& t, int root) override;
  Tensor all_gather(const Tensor& t) override;
  void barrier() override;
  Tensor make_buffer(int64_t numel, DType dtype, Device device) override;

  // Waits for req, polling; throws CommError naming the operation after timeout() seconds.
  void wait_bounded(MPI_Request* req, const std::string& what);

 private:
  MPI_Comm comm_;
  MPI_Comm local_comm_ = MPI_COMM_NULL;
  std::unique_ptr<ShmAllReduce> shm_;                   // staging slot; single-node jobs only
  std::vector<std::unique_ptr<ShmAllReduce>> buffers_;  // make_buffer()'s windows
  std::function<void()> bounded_barrier(const std::string& what);
  // The ordered sum's halves on a buffer that splits into size_ shards; `op` prefixes their names.
  MpiStage reduce_scatter_stage(const Tensor& t, const std::string& op);
  MpiStage all_gather_stage(const Tensor& t, const std::string& op);
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
};

}  // namespace amp::comm
