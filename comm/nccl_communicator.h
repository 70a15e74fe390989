// NcclCommunicator: the Communicator for CUDA tensors (docs/DESIGN.md §8).
//
// - Rank 0's ncclUniqueId is broadcast over MPI; the NCCL communicator is non-blocking, so that no
//   NCCL call can hang the host and a stuck one can be aborted.
// - Collectives run on a dedicated communication stream, ordered against the compute stream by
//   events in both directions: the compute stream's work queued before a call (the gradients) is
//   done before the collective reads it, and Work::wait() makes the compute stream wait for the
//   collective before it runs anything queued later (the unscale). wait() does not block the host.
// - A watchdog thread polls ncclCommGetAsyncError and the age of every collective in flight. On an
//   error or a timeout it calls ncclCommAbort, prints one line naming the rank, the operation and
//   the context ("step 12"), and the next call into this communicator (or into its Work) throws
//   CommError with that message. If the program never calls in again, the watchdog ends the process
//   with a non-zero status after a grace period, so that mpirun tears the job down: no rank hangs.
// - Inside a CUDA graph capture of the compute stream, the collectives are recorded into the graph
//   (the communication stream joins the capture through the events); their events stand for graph
//   nodes, which no one may query, so the watchdog does not watch them: watch_graph_launch() hands it
//   each launch of the graph instead.
#pragma once
#include <cuda_runtime.h>
#include <mpi.h>

#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace amp::comm {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over comm: every rank of comm must call it. Selects the device with
  // cuda_init(local_rank) if that has not happened yet.
  NcclCommunicator(MPI_Comm comm, int local_rank);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  int local_rank() const override;
  int local_size() const override;
  std::string name() const override { return "nccl"; }

  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override;
  // One ncclGroupStart/End around all of them: the reducer's gradient buckets, launched together.
  std::unique_ptr<Work> all_reduce_coalesced_async(std::vector<Tensor>& ts, ReduceOp op);
  void broadcast(Tensor& t, int root) override;
  Tensor all_gather(const Tensor& t) override;
  std::unique_ptr<Work> ordered_sum_async(Tensor& t) override;
  std::unique_ptr<Work> ordered_reduce_scatter_async(Tensor& t) override;
  std::unique_ptr<Work> all_gather_shards_async(Tensor& t) override;
  void raise_if_failed() override;
  // Waits on the host (at most timeout()) until every rank has arrived.
  void barrier() override;
  // A launch of a CUDA graph that holds collectives of this communicator, just issued on the compute
  // stream: the watchdog bounds it by timeout() as it does a collective, and names it `what`.
  void watch_graph_launch(const std::string& what) override;
  // The stream the collectives run on: the device's highest priority, so that a bucket's all-reduce
  // starts as soon as its gradients are ready, ahead of the backward's next kernels.
  cudaStream_t comm_stream() const;

  struct State;  // NCCL handles, streams and the watchdog; shared with the Work objects

 private:
  // The ordered sum's halves on a buffer that splits into size() shards; `name` prefixes their names.
  void reduce_scatter(Tensor& t, const char* name);
  std::unique_ptr<Work> all_gather_shards(Tensor& t, const char* name);
  std::shared_ptr<State> state_;
};

// The factory that launch/ uses; MPI must be initialised.
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int local_rank);

}  // namespace amp::comm
