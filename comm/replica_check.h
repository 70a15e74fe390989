// Replica check: a 64-bit hash of every fp32 parameter, all-gathered, so that replicas that drifted
// apart are caught and named.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace amp::comm {

// FNV-1a over the parameters' bytes, in order.
uint64_t parameter_hash(const std::vector<Tensor>& params);

struct ReplicaReport {
  bool consistent = true;
  std::vector<int> differing_ranks;  // ranks whose hash differs from rank 0's
  uint64_t hash = 0;                 // this rank's
};
ReplicaReport check_replicas(Communicator& comm, const std::vector<Tensor>& params);

}  // namespace amp::comm
