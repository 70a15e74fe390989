// One launch for a sequence of device work: the work is captured once from the compute stream into a
// CUDA graph and replayed (docs/GPU.md, the emulated GPU's stream capture).
//
// The capture runs in the global mode, so anything that would not be replayed (a host
// synchronisation, a read-back, cudaMalloc) is an error instead of a silently wrong graph. What the
// work allocates comes from a private pool of the caching allocator that lives as long as the graph:
// tensors made during the capture and kept are written again by every replay, and memory freed during
// it is never handed to eager work. The pool starts from the blocks that eager runs of the same work
// left in the cache, so run the work eagerly once or more before capturing it.
#pragma once
#include <cuda_runtime.h>

#include <functional>

#include "runtime/kernels/cuda/cuda_support.h"

namespace amp::cuda {

class CudaGraph final : public DeviceGraph {
 public:
  // Captures work() from the compute stream. Throws std::runtime_error naming the CUDA error when the
  // work does something a capture forbids; nothing is left capturing then.
  explicit CudaGraph(const std::function<void()>& work);
  ~CudaGraph() override;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Enqueues one replay on the compute stream, ordered after the work issued before it.
  void replay() override;

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  int pool_ = 0;
};

}  // namespace amp::cuda
