// Communicator: the collectives that data-parallel training needs. Implementations:
// MpiCommunicator (CPU tensors), NcclCommunicator (device tensors), LocalCommunicator (one process).
//
// Every wait is bounded by timeout(): a collective that does not finish in time throws CommError
// naming the operation, the rank and the context (for example "step 12"), so that main can abort
// the job instead of hanging.
#pragma once
#include <memory>
#include <stdexcept>
#include <string>

#include "runtime/core/tensor.h"

namespace amp::comm {

enum class ReduceOp { sum, avg, max };
const char* reduce_op_name(ReduceOp op);

class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The one wording of a timed-out collective, for every communicator: "rank 1: all_reduce/avg(...)
// did not complete within 0.5 s at step 3; a peer has stopped answering or died".
inline std::string timeout_message(int rank, const std::string& what, double seconds, const std::string& context) {
  std::string s = std::to_string(seconds);
  s.erase(s.find_last_not_of('0') + 1);  // 3.000000 -> 3., 0.500000 -> 0.5
  if (!s.empty() && s.back() == '.') s.pop_back();
  return "rank " + std::to_string(rank) + ": " + what + " did not complete within " + s + " s" +
         (context.empty() ? "" : " at " + context) + "; a peer has stopped answering or died";
}

// A collective in flight. wait() blocks (at most the communicator's timeout); test() polls.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool test() = 0;
};

// A collective that finished before its call returned.
class CompletedWork final : public Work {
 public:
  void wait() override {}
  bool test() override { return true; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int local_rank() const = 0;  // rank among the processes of this node
  virtual int local_size() const = 0;
  virtual std::string name() const = 0;

  // In-place all-reduce of a contiguous tensor (avg divides by size() in the tensor's dtype).
  virtual std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) = 0;
  void all_reduce(Tensor& t, ReduceOp op) { all_reduce_async(t, op)->wait(); }
  // In-place sum in which every element adds the ranks' values in the fixed order of
  // comm/sum_tree.h's tree over ranks, whatever the transport or the buffer's size; nothing is
  // divided. The default gathers and sums on every rank (comm/ordered_sum.cpp); MPI and NCCL send a
  // ring all-reduce's bytes when the buffer splits into size() equal shards (ordered_sum.h).
  virtual std::unique_ptr<Work> ordered_sum_async(Tensor& t);
  void ordered_sum(Tensor& t) { ordered_sum_async(t)->wait(); }
  // The ordered sum's two halves, for a buffer that splits into size() equal shards
  // (splits_into_shards; ZeRO-1's gradients and parameters). ordered_reduce_scatter_async leaves in
  // this rank's shard (shard rank() of t) the bits ordered_sum_async would, and the other shards
  // unspecified; all_gather_shards_async copies every rank's shard into its place on every rank.
  // The defaults sum the whole buffer, and gather the shards through all_gather().
  virtual std::unique_ptr<Work> ordered_reduce_scatter_async(Tensor& t);
  virtual std::unique_ptr<Work> all_gather_shards_async(Tensor& t);
  // Throws the failure a collective met in the background (a timeout, a dead peer), if any: values
  // read back after it are not the peers' and must not be acted on as if every rank saw them.
  virtual void raise_if_failed() {}
  // A launch of a CUDA graph holding this communicator's collectives was just issued on the compute
  // stream: a communicator that bounds its collectives' time bounds the launch instead (their events
  // are graph nodes, which no one may query). `what` names it in a timeout's message.
  virtual void watch_graph_launch(const std::string& /*what*/) {}
  virtual void broadcast(Tensor& t, int root) = 0;
  // Returns [size(), ...t.shape()]: every rank's tensor, in rank order.
  virtual Tensor all_gather(const Tensor& t) = 0;
  virtual void barrier() = 0;
  // A zero-filled 1-D buffer that this communicator all-reduces fastest (in place, no staging copy
  // on single-node MPI jobs). Collective: every rank allocates the same buffers in the same order.
  // It must not outlive the communicator.
  virtual Tensor make_buffer(int64_t numel, DType dtype, Device device) { return zeros({numel}, dtype, device); }

  // Bytes this rank has sent in collectives so far, counted from the sizes as a bandwidth-optimal
  // algorithm sends them (comm_bytes.h), whatever the transport does underneath: the figure that
  // the metrics' comm_bytes and the cost model compare.
  uint64_t bytes_sent() const { return bytes_sent_; }

  double timeout() const { return timeout_s_; }
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  // Describes where the program is, for error messages ("step 12").
  const std::string& context() const { return context_; }
  void set_context(std::string c) { context_ = std::move(c); }

 protected:
  void count_sent(uint64_t bytes) { bytes_sent_ += bytes; }
  double timeout_s_ = 300.0;
  std::string context_;
  uint64_t bytes_sent_ = 0;
};

}  // namespace amp::comm
