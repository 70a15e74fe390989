// The single-process communicator: every collective is the identity, so everything also runs
// without mpirun.
#pragma once
#include "comm/communicator.h"

namespace amp::comm {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int local_rank() const override { return 0; }
  int local_size() const override { return 1; }
  std::string name() const override { return "local"; }
  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override;
  void broadcast(Tensor& t, int root) override;
  Tensor all_gather(const Tensor& t) override;
  void barrier() override {}
};

}  // namespace amp::comm
