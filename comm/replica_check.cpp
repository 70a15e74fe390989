#include "comm/replica_check.h"

#include <cstring>

#include "runtime/core/fnv1a.h"

namespace amp::comm {

uint64_t parameter_hash(const std::vector<Tensor>& params) {
  uint64_t h = kFnv1aOffset;
  for (const Tensor& p : params) {
    const Tensor host = p.to(kCPU);
    h = fnv1a(host.data_ptr(), host.nbytes(), h);
  }
  return h;
}

ReplicaReport check_replicas(Communicator& comm, const std::vector<Tensor>& params) {
  ReplicaReport r;
  r.hash = parameter_hash(params);
  Tensor mine = empty({1}, DType::i64, kCPU);
  std::memcpy(mine.data_ptr(), &r.hash, 8);
  const Device d = params.empty() ? kCPU : params[0].device();  // NCCL gathers device tensors
  const Tensor all = comm.all_gather(mine.to(d)).to(kCPU);
  const auto* hashes = static_cast<const uint64_t*>(all.data_ptr());
  for (int k = 1; k < comm.size(); ++k)
    if (hashes[k] != hashes[0]) r.differing_ranks.push_back(k);
  r.consistent = r.differing_ranks.empty();
  return r;
}

}  // namespace amp::comm
