// The device memory this process holds beyond its CUDA context, as the driver counts it
// (cudaMemGetInfo): the free bytes when the context was made, less the fewest free bytes seen since.
// So it takes in what the caching allocator holds (live and cached), cuBLAS's workspace, cuDNN's and
// NCCL's own memory, CUDA graphs' and the loaded kernels' code: what nvidia-smi shows for the process
// less its context, and what torch.cuda.mem_get_info() measures the same way for PyTorch (the
// benchmark, launch/bench/bench_vs_pytorch.py, prints both). Another process on the same GPU shows in
// it too: one process per GPU, as amp_train runs.
//
// Sampled where memory can grow: after every segment the caching allocator obtains from cudaMalloc,
// and whenever asked (the end of a run). Memory a library takes and gives back between two samples
// is not seen.
#pragma once
#include <atomic>
#include <cstddef>

namespace amp::cuda {

class DeviceUsage {
 public:
  void start();   // the context exists and nothing is allocated yet
  void sample();  // looks at the free bytes now; a failing query is ignored (the figure is advice)
  size_t peak_bytes() const;  // 0 before start()

 private:
  std::atomic<size_t> start_free_{0}, least_free_{0};
  std::atomic<bool> started_{false};
};

DeviceUsage& device_usage();  // the process's (one device per process)

}  // namespace amp::cuda
