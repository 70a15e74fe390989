// The seam between device-independent code and the CUDA backend. runtime/kernels/cuda/cuda_support.cpp
// implements it when the backend is built; runtime/kernels/cuda/cuda_stub.cpp otherwise. CMake picks the file.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "runtime/core/dtype.h"

namespace amp {

bool cuda_built();
// Whether a usable device exists. If not, *reason says why (no device, driver too old, not built),
// and *failing (where given) whether the node has GPUs that fail: taken by another process in
// exclusive-process mode, the system not ready yet (a later try may find them free), or a driver
// that errs otherwise. Without GPUs (none visible, no driver) it is false.
bool cuda_usable(std::string* reason, bool* failing = nullptr);
// Selects device local_rank and registers the CUDA backend. local_size: the ranks on this node, each
// of which needs a GPU of its own (NCCL refuses two ranks on one GPU, and sharing would be slow).
// Throws std::invalid_argument with a clear message when the node has no GPU for the request (none
// visible, no driver, fewer visible GPUs than its ranks: exit 2), std::runtime_error when its GPUs
// are there but fail (busy, not ready, a broken driver: exit 1, a retry may succeed).
void cuda_init(int local_rank, int local_size = 1);
// Before MPI_Init: makes GPU local_rank this process's current device, so that an MPI library that
// touches CUDA in MPI_Init (a CUDA-aware one) creates its context there, not every rank's on GPU 0.
// Returns false and selects nothing when CUDA is not built or fewer than local_size GPUs are visible
// (cuda_init reports that). cuda_init then refuses any other device (the launcher's node-local rank
// and MPI's must agree). Throws std::runtime_error when the device cannot be made current.
bool cuda_select_device_before_mpi(int local_rank, int local_size);
// A rank given a GPU of its own by the launcher (one visible GPU, however many ranks on the node) uses
// device 0 in both. The current device's UUID ("GPU-xxxxxxxx-..."), by which ranks that were given
// the same physical GPU are found; "" without CUDA.
std::string cuda_device_uuid();

// cuDNN's fused attention (--attention cudnn), before any device is chosen: "" where it can run
// causal attention of head size head_dim in dtype, else why not (no CUDA backend, built without
// cudnn-frontend's headers, libcudnn missing or older than them, the dtype, the head size). Loads
// libcudnn on the first call; never throws. cudnn_describe(): the library found ("cuDNN 9.19.0
// (path)"), or why there is none.
std::string cudnn_attention_unavailable(DType dtype, int64_t head_dim);
std::string cudnn_describe();

// A profiler's collection range (cudaProfilerStart, cudaProfilerStop): `ncu --profile-from-start off`
// and `nsys --capture-range=cudaProfilerApi` record only what runs between them. Stop waits for the
// device first, so that the range holds all the work issued inside it. Nothing without CUDA; in the
// emulated GPU's launch log, two marks.
// fp32 GEMMs in TF32 on the tensor cores (torch.backends.cuda.matmul.allow_tf32; off by default).
// After cuda_init; nothing without CUDA.
void cuda_set_allow_tf32(bool on);
void cuda_profiler_start();
void cuda_profiler_stop();

// Device work captured once from the compute stream into a CUDA graph and replayed
// (runtime/kernels/cuda/cuda_graph.h: the capture's rules, its private memory pool).
class DeviceGraph {
 public:
  virtual ~DeviceGraph() = default;
  // Enqueues one replay on the compute stream, after the work issued before it.
  virtual void replay() = 0;
};
// Captures work(); throws std::runtime_error naming what the capture refused (a host
// synchronisation, say), or in a build without CUDA.
std::unique_ptr<DeviceGraph> capture_device_graph(const std::function<void()>& work);

}  // namespace amp
