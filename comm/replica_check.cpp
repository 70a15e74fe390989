#include "comm/replica_check.h"

#include <cstdio>
#include <cstring>

namespace amp::comm {

uint64_t parameter_hash(const std::vector<Tensor>& params) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const Tensor& p : params) {
    const Tensor host = p.to(kCPU);
    const auto* bytes = static_cast<const unsigned char*>(host.data_ptr());
    for (size_t i = 0; i < host.nbytes(); ++i) {
      h ^= bytes[i];
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

std::string hash_hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
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
