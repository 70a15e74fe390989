#include "runtime/kernels/cuda/cuda_graph.h"

#include <exception>

#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"

namespace amp::cuda {

CudaGraph::CudaGraph(const std::function<void()>& work) {
  Context& ctx = context();
  CachingAllocator& alloc = ctx.allocator();
  pool_ = alloc.create_pool();
  AMP_CUDA_CHECK(cudaStreamBeginCapture(ctx.stream(), cudaStreamCaptureModeGlobal));
  alloc.use_pool(pool_);
  std::exception_ptr failed;
  try {
    work();
  } catch (...) {
    failed = std::current_exception();
  }
  alloc.use_pool(0);
  // The capture ends whatever happened, so that the stream is usable afterwards.
  const cudaError_t ended = cudaStreamEndCapture(ctx.stream(), &graph_);
  if (ended != cudaSuccess) (void)cudaGetLastError();
  try {
    if (failed) std::rethrow_exception(failed);
    AMP_CUDA_CHECK(ended);
    AMP_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  } catch (...) {
    if (graph_ != nullptr) (void)cudaGraphDestroy(graph_);
    alloc.release_pool(pool_);
    throw;
  }
}

CudaGraph::~CudaGraph() {
  // A replay still queued keeps what it needs on a GPU (and on the emulated one): the graph can go;
  // the pool's blocks are reused only by work ordered after it on the compute stream.
  if (exec_ != nullptr) AMP_CUDA_CHECK_NOTHROW(cudaGraphExecDestroy(exec_));
  if (graph_ != nullptr) AMP_CUDA_CHECK_NOTHROW(cudaGraphDestroy(graph_));
  context().allocator().release_pool(pool_);
}

void CudaGraph::replay() { AMP_CUDA_CHECK(cudaGraphLaunch(exec_, context().stream())); }

}  // namespace amp::cuda
