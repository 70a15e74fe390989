// ZeRO-1's bookkeeping. With ReducerOptions::shard each rank keeps only its shard of every gradient
// bucket; a parameter's slot may lie in one rank's shard, or straddle several. This rank's piece of a
// parameter is the part of its slot inside this rank's shard: the optimizer runs on the pieces (so
// its moments exist for them only: optimizer memory per rank divided by the ranks), then every
// rank's updated pieces are gathered, bucket by bucket, into every rank's parameters.
//
// The optimizer's state keeps its unsharded form outside: full_state_dict() gathers it into the
// state_dict an unsharded optimizer over the same groups would return (PyTorch's layout, the same
// checkpoint files byte for byte), and shard_state_dict() takes this rank's pieces of one.
#pragma once
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/reducer.h"
#include "runtime/nn/module.h"
#include "runtime/optim/optimizer.h"

namespace amp::comm {

class ZeroShards {
 public:
  // layout: plan_buckets(params, options with shard, comm.size()); groups: the unsharded
  // optimizer's parameter groups (every parameter in exactly one). Local work only.
  ZeroShards(BucketLayout layout, const std::vector<Tensor>& params, const std::vector<std::vector<Tensor>>& groups,
             Communicator& comm);
  // The reducer's buckets (GradientReducer::buffers(), made with the same layout), before the
  // first step: the gradients and the gathering live there.
  void attach(std::vector<Tensor> buffers);
  const BucketLayout& layout() const { return layout_; }

  // The optimizer's groups over this rank's pieces: 1-D views of the parameters that require grad.
  // A group of which this rank owns nothing gets one 0-element piece, so that every rank's
  // optimizer has the same groups and steps each of them.
  const std::vector<std::vector<Tensor>>& piece_groups() const { return piece_groups_; }
  // After the reducer's finish(): each piece's gradient becomes its view of the reduced shard.
  void assign_grads();
  // After the optimizer's step: every parameter whole again on every rank (each rank's pieces
  // written into their bucket slots, the shards all-gathered, the slots copied out).
  void gather_parameters();
  // The pieces named as their parameters (for the names of non-finite gradients after a skip).
  std::vector<nn::NamedTensor> named_pieces(const std::vector<nn::NamedTensor>& named_params) const;
  // Elements of the parameters this rank's pieces hold, and of all parameters.
  int64_t piece_elements() const;
  int64_t total_elements() const;

  // Collective: the state_dict of an unsharded optimizer over the groups (its ids, its tensors whole),
  // gathered from every rank's `opt` (built over piece_groups()), bucket by bucket. Only the rank
  // that keeps it (the checkpoint's writer) holds the whole state, in host memory (its per-element
  // tensors on the CPU: one bucket at a time on the device); the others return no tensors.
  optim::OptimizerStateDict full_state_dict(const optim::Optimizer& opt, bool keep);
  // This rank's pieces of an unsharded state_dict, numbered as `opt`'s parameters (for load_state_dict).
  optim::OptimizerStateDict shard_state_dict(const optim::OptimizerStateDict& full, const optim::Optimizer& opt) const;

 private:
  struct Piece {
    size_t param;          // into params_
    size_t group;
    int64_t param_offset;  // elements into the parameter
    size_t bucket;
    int64_t bucket_offset;
    int64_t numel;
    Tensor view;           // the optimizer's parameter
  };
  Communicator& comm_;
  BucketLayout layout_;
  std::vector<Tensor> buffers_;
  std::vector<Tensor> params_;
  std::vector<int64_t> full_id_;  // per parameter: its id in the unsharded optimizer's state_dict
  std::vector<size_t> group_of_;  // per parameter: its group
  std::vector<Piece> pieces_;     // in piece_groups() order, group by group
  std::vector<std::vector<Tensor>> piece_groups_;
};

}  // namespace amp::comm
