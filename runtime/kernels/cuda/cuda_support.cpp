// The CUDA seam (runtime/kernels/cuda/cuda_support.h) for builds with the CUDA backend: device discovery with a
// clear reason when there is none, device selection by local rank, and backend registration.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "runtime/kernels/backend.h"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/cuda_graph.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/kernels/cuda/cudnn_sdpa.h"


namespace amp {

namespace {

// Why the node's GPUs cannot be used, when they cannot.
enum class NoGpu {
  absent,  // none visible, or no driver: the machine or the launch does not fit the request
  busy,    // there but unavailable now (exclusive-process mode, the system not ready): retry later
  broken,  // any other failure (a driver that does not match its library, an unknown error)
};

// The number of devices, or 0 with *reason and *kind filled. Clears the error that a failed query
// leaves in the runtime's last-error slot, so later calls do not report it again.
int device_count(std::string* reason, NoGpu* kind = nullptr) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  NoGpu why_kind = NoGpu::absent;
  std::string why;
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
    why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
    if (err == cudaErrorInsufficientDriver) {
      why += " (no NVIDIA driver is loaded, or it is older than this CUDA runtime: install a newer driver)";
    } else if (err == cudaErrorNoDevice) {
      why += " (no GPU is visible: check the hardware and CUDA_VISIBLE_DEVICES)";
    } else if (err == cudaErrorDevicesUnavailable || err == cudaErrorSystemNotReady) {
      why_kind = NoGpu::busy;
      why += err == cudaErrorDevicesUnavailable
                 ? " (the GPUs are taken: another process holds them in exclusive-process mode; nvidia-smi shows which)"
                 : " (the system is not ready: on an NVSwitch node, the fabric manager has not started yet)";
    } else {
      why_kind = NoGpu::broken;
    }
  } else if (count == 0) {
    why = "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)";
  }
  if (count == 0 && reason) *reason = why;
  if (count == 0 && kind) *kind = why_kind;
  return count;
}

}  // namespace

bool cuda_built() { return true; }

void cuda_set_allow_tf32(bool on) { cuda::context().set_allow_tf32(on); }

std::unique_ptr<DeviceGraph> capture_device_graph(const std::function<void()>& work) {
  return std::make_unique<cuda::CudaGraph>(work);
}

void cuda_profiler_start() { AMP_CUDA_CHECK(cudaProfilerStart()); }

void cuda_profiler_stop() {
  AMP_CUDA_CHECK(cudaDeviceSynchronize());
  AMP_CUDA_CHECK(cudaProfilerStop());
}

bool cuda_usable(std::string* reason, bool* failing) {
  NoGpu kind = NoGpu::absent;
  const bool usable = device_count(reason, &kind) > 0;
  if (failing) *failing = !usable && kind != NoGpu::absent;
  return usable;
}

namespace {
int g_selected_before_mpi = -1;  // the device cuda_select_device_before_mpi made current, or -1

// The GPU of node-local rank local_rank among local_size, `visible` GPUs visible to it: its own index
// when the node's GPUs are all visible to every rank; 0 when the launcher gave each rank one GPU of its
// own (per-rank CUDA_VISIBLE_DEVICES, Slurm's --gpus-per-task=1 or --gpu-bind); else -1 (too few).
// That two ranks given one GPU each were not given the same one is the caller's check (by UUID).
int device_of(int local_rank, int local_size, int visible) {
  if (visible >= local_size) return local_rank;
  return visible == 1 ? 0 : -1;
}
}  // namespace

bool cuda_select_device_before_mpi(int local_rank, int local_size) {
  const int device = local_rank < 0 || local_rank >= local_size ? -1 : device_of(local_rank, local_size, device_count(nullptr));
  if (device < 0) {
    (void)cudaGetLastError();
    return false;
  }
  AMP_CUDA_CHECK(cudaSetDevice(device));
  g_selected_before_mpi = device;
  return true;
}

std::string cudnn_attention_unavailable(DType dtype, int64_t head_dim) { return cudnn_sdpa::unavailable(dtype, head_dim); }
std::string cudnn_describe() { return cudnn_sdpa::describe(); }

std::string cuda_device_uuid() {
  int device = 0;
  AMP_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  AMP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char text[48];
  std::snprintf(text, sizeof text, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
                b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return text;
}

void cuda_init(int local_rank, int local_size) {
  if (local_rank < 0 || local_rank >= local_size)
    throw std::invalid_argument("cuda_init: local rank " + std::to_string(local_rank) + " of " +
                                std::to_string(local_size));
  std::string reason;
  NoGpu kind = NoGpu::absent;
  const int count = device_count(&reason, &kind);
  // What the machine or the launch gives does not fit the request: found before any step (exit 2).
  // GPUs that are there but fail now are not the request's fault (exit 1: a requeue may succeed).
  if (count == 0 && kind == NoGpu::absent) throw std::invalid_argument("CUDA device requested but none is usable: " + reason);
  if (count == 0) throw std::runtime_error("CUDA device requested but none is usable now: " + reason);
  const int device = device_of(local_rank, local_size, count);
  if (device < 0)
    throw std::invalid_argument(std::to_string(local_size) + " ranks on this node but " + std::to_string(count) +
                             " GPU(s) visible to this one (CUDA_VISIBLE_DEVICES): each rank needs a GPU of its own, "
                             "the one GPU it sees or, where it sees the node's GPUs, its node-local rank's. Give each "
                             "rank one GPU (Slurm: --gpus-per-task=1), or let every rank see all of the node's (Slurm: "
                             "--gpus-per-node, no --gpu-bind), or start at most " + std::to_string(count) +
                             " rank(s) per node");
  if (g_selected_before_mpi >= 0 && g_selected_before_mpi != device)
    throw std::invalid_argument("GPU " + std::to_string(g_selected_before_mpi) +
                             " was selected before MPI_Init from the launcher's node-local rank, but MPI places this "
                             "process at node-local rank " + std::to_string(local_rank) + " of " +
                             std::to_string(local_size) + ": the launcher and MPI disagree on the node's ranks");
  cuda::init_context(device);
  register_backend(DeviceType::cuda, &cuda::cuda_backend());
  register_memory(DeviceType::cuda, &cuda::cuda_backend());
}

}  // namespace amp
