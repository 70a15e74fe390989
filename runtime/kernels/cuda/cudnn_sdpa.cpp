// cuDNN's fused causal attention through cudnn-frontend's graph API (cudnn_sdpa.h). libcudnn is
// not linked: the frontend's dynamic loading (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING) calls it
// through the handle opened here, libcudnn.so.9 found by the loader on the node (PyTorch's
// nvidia-cudnn-cu13 wheel or the toolkit's, on LD_LIBRARY_PATH as the bundle's env.sh sets it). A
// library that is missing, or older than the headers this was built with, leaves the library
// unavailable with the reason, and the op uses the backend's own kernels (or refuses --attention cudnn).
//
// One forward graph and one backward graph per shape, both built at the shape's first forward (an
// eager step, before a CUDA graph captures the step), kept for the process. The backward uses the
// deterministic algorithm, so that runs and ranks repeat bit for bit.
#include "runtime/kernels/cuda/cudnn_sdpa.h"

#include <dlfcn.h>
#include <link.h>

#include <cudnn_frontend.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/kernels/cuda/cuda_context.h"

// The frontend's dynamic loading reads the library's handle from here.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace amp::cudnn_sdpa {
namespace {

namespace fe = cudnn_frontend;

// The tensors' ids in the graphs' variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

std::string version_string(size_t v) {  // 91900 -> "9.19.0"
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

struct Library {
  std::string why_not;  // "" when loaded
  std::string text;     // describe()
};

Library load() {
  Library lib;
  dlerror();
  void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    lib.why_not = std::string("libcudnn.so.9 was not found (") + (e != nullptr ? e : "dlopen failed") +
                  "): put cuDNN 9's lib folder (PyTorch's nvidia/cudnn/lib, or the toolkit's) on LD_LIBRARY_PATH";
    lib.text = "no cuDNN: " + lib.why_not;
    return lib;
  }
  fe::cudnn_dlhandle = h;
  std::string path = "libcudnn.so.9";
  link_map* map = nullptr;
  if (dlinfo(h, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && map->l_name[0] != '\0')
    path = map->l_name;
  size_t version = 0;
  try {
    version = fe::detail::get_backend_version();
  } catch (const std::exception& e) {
    lib.why_not = path + " has no cudnnGetVersion (" + e.what() + ")";
    lib.text = "no cuDNN: " + lib.why_not;
    return lib;
  }
  lib.text = "cuDNN " + version_string(version) + " (" + path + ")";
  // A libcudnn built for another CUDA major (a CUDA 12 wheel's) loads, then fails at its first graph.
  using CudartVersion = size_t (*)();
  const auto cudart = reinterpret_cast<CudartVersion>(dlsym(h, "cudnnGetCudartVersion"));
  const size_t cuda_major = cudart != nullptr ? cudart() / 1000 : static_cast<size_t>(CUDART_VERSION / 1000);
  if (cuda_major != static_cast<size_t>(CUDART_VERSION / 1000))
    lib.why_not = "the node's cuDNN (" + path + ") is built for CUDA " + std::to_string(cuda_major) +
                  ", this build for CUDA " + std::to_string(CUDART_VERSION / 1000) + ": put the CUDA " +
                  std::to_string(CUDART_VERSION / 1000) + " build of cuDNN 9 first on LD_LIBRARY_PATH";
  else if (version < static_cast<size_t>(CUDNN_VERSION))
    lib.why_not = "the node's cuDNN " + version_string(version) + " (" + path +
                  ") is older than the headers this was built with (" + version_string(CUDNN_VERSION) + ")";
  if (!lib.why_not.empty()) lib.text += ", not used: " + lib.why_not;
  return lib;
}

const Library& library() {
  static const Library lib = load();
  return lib;
}

void check(fe::error_t e, const char* what) {
  if (e.is_bad()) throw std::runtime_error(std::string("cuDNN's attention: ") + what + ": " + e.get_message());
}

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  std::string error;  // a graph the library would not build: said again, never rebuilt
};

struct Cache {
  std::mutex mutex;  // held while a handle, a plan or an execution is at work
  std::unordered_map<int, cudnnHandle_t> handles;  // one per device
  std::deque<std::pair<Shape, Plan>> forward, backward;  // a deque: references to plans stay valid
};
Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: the handles outlive static destruction's order
  return *c;
}

cudnnHandle_t handle_locked(int device) {
  auto& handles = cache().handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  if (fe::detail::create_handle(&h) != CUDNN_STATUS_SUCCESS) throw std::runtime_error("cuDNN's attention: cudnnCreate failed");
  return handles.emplace(device, h).first->second;
}

// Given to the graph, so that the frontend does not ask the device itself (through a libcudart of
// its own loading).
int sm_version(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    throw std::runtime_error("cuDNN's attention: the compute capability of device " + std::to_string(device) +
                             " cannot be read");
  return major * 10 + minor;
}

// q, k, v (and their gradients) where they lie in qkv [B, T, 3C]; o and dO as [B, T, C]: each
// [B, H, T, D] by its strides.
std::vector<int64_t> dims(const Shape& s) { return {s.B, s.H, s.T, s.D}; }
std::vector<int64_t> qkv_strides(const Shape& s) { return {s.T * 3 * s.H * s.D, s.D, 3 * s.H * s.D, 1}; }
std::vector<int64_t> out_strides(const Shape& s) { return {s.T * s.H * s.D, s.D, s.H * s.D, 1}; }

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, Uid uid,
                                                    std::vector<int64_t> dim, std::vector<int64_t> stride) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(std::move(dim)).set_stride(std::move(stride)));
}

std::shared_ptr<fe::graph::Graph> new_graph(const Shape& s) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(s.dtype == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  g->set_sm_version(sm_version(s.device));
  return g;
}

void build_forward(const Shape& s, Plan& plan, cudnnHandle_t h) {
  auto g = new_graph(s);
  auto q = input(*g, "q", kQ, dims(s), qkv_strides(s)), k = input(*g, "k", kK, dims(s), qkv_strides(s));
  auto v = input(*g, "v", kV, dims(s), qkv_strides(s));
  auto a = fe::graph::SDPA_attributes()
               .set_name("attention")
               .set_generate_stats(true)
               .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
               .set_diagonal_band_right_bound(0)
               .set_attn_scale(s.scale);
  auto [o, stats] = g->sdpa(q, k, v, a);
  o->set_output(true).set_uid(kO).set_dim(dims(s)).set_stride(out_strides(s));
  stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim({s.B, s.H, s.T, 1}).set_stride(
      {s.H * s.T, s.T, 1, 1});
  check(g->build(h, {fe::HeurMode_t::A}), "building the forward graph");
  check(g->get_workspace_size(plan.workspace), "its workspace");
  plan.graph = std::move(g);
}

void build_backward(const Shape& s, Plan& plan, cudnnHandle_t h) {
  auto g = new_graph(s);
  auto q = input(*g, "q", kQ, dims(s), qkv_strides(s)), k = input(*g, "k", kK, dims(s), qkv_strides(s));
  auto v = input(*g, "v", kV, dims(s), qkv_strides(s)), o = input(*g, "o", kO, dims(s), out_strides(s));
  auto d_o = input(*g, "dO", kDO, dims(s), out_strides(s));
  auto stats = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("stats")
                             .set_uid(kStats)
                             .set_dim({s.B, s.H, s.T, 1})
                             .set_stride({s.H * s.T, s.T, 1, 1})
                             .set_data_type(fe::DataType_t::FLOAT));
  auto a = fe::graph::SDPA_backward_attributes()
               .set_name("attention_backward")
               .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
               .set_diagonal_band_right_bound(0)
               .set_attn_scale(s.scale)
               .set_deterministic_algorithm(true);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, a);
  dq->set_output(true).set_uid(kDQ).set_dim(dims(s)).set_stride(qkv_strides(s));
  dk->set_output(true).set_uid(kDK).set_dim(dims(s)).set_stride(qkv_strides(s));
  dv->set_output(true).set_uid(kDV).set_dim(dims(s)).set_stride(qkv_strides(s));
  check(g->build(h, {fe::HeurMode_t::A}), "building the backward graph");
  check(g->get_workspace_size(plan.workspace), "its workspace");
  plan.graph = std::move(g);
}

// The graphs' tensors by uid: q, k and v (and their gradients) side by side in each row of qkv (dqkv),
// C 16-bit elements apart; o and dO as [B, T, C].
using Pack = std::unordered_map<int64_t, void*>;
Pack forward_pack(const Shape& s, const void* qkv, void* y, float* stats) {
  char* x = static_cast<char*>(const_cast<void*>(qkv));
  const int64_t c = s.H * s.D * 2;
  return {{kQ, x}, {kK, x + c}, {kV, x + 2 * c}, {kO, y}, {kStats, stats}};
}
Pack backward_pack(const Shape& s, const void* qkv, const void* y, const void* gy, const float* stats, void* dqkv) {
  Pack pack = forward_pack(s, qkv, const_cast<void*>(y), const_cast<float*>(stats));
  char* d = static_cast<char*>(dqkv);
  const int64_t c = s.H * s.D * 2;
  pack.insert({{kDO, const_cast<void*>(gy)}, {kDQ, d}, {kDK, d + c}, {kDV, d + 2 * c}});
  return pack;
}

// Runs a plan on the stream; the cache's mutex is held.
void run_locked(const Plan& p, cudnnHandle_t h, cudaStream_t stream, Pack pack, void* workspace, const char* what) {
  if (fe::detail::set_stream(h, stream) != CUDNN_STATUS_SUCCESS)
    throw std::runtime_error("cuDNN's attention: cudnnSetStream failed");
  check(p.graph->execute(h, pack, workspace), what);
}

// Both graphs run once on zeroed scratch tensors where they are built: an error the library meets
// only when it runs a plan (a misaligned pointer, an engine that fails to launch) is met at the
// forward, where the op can still fall back, and not in the backward, where nothing can. Zeros make
// uniform scores and zero gradients: nothing to overflow. Not under a capture (plan() refuses it).
void trial_run(const Shape& s, const Plan& f, const Plan& b, cudnnHandle_t h, cudaStream_t stream) {
  const size_t es = 2, tokens = static_cast<size_t>(s.B * s.T), C = static_cast<size_t>(s.H * s.D);
  const auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };
  const size_t qkv = aligned(tokens * 3 * C * es), out = aligned(tokens * C * es);
  const size_t stats = aligned(static_cast<size_t>(s.B * s.H * s.T) * sizeof(float));
  const size_t workspace = aligned(static_cast<size_t>(std::max(f.workspace, b.workspace)));
  const cuda::Scratch scratch(2 * qkv + 2 * out + stats + workspace);
  char* p = scratch.as<char>();
  char *x = p, *dx = x + qkv, *y = dx + qkv, *gy = y + out, *st = gy + out, *ws = st + stats;
  // Work queued before is finished first, so that its fault is not taken for the library's.
  if (const cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess)
    throw std::runtime_error(std::string("the device failed before cuDNN's attention ran: ") + cudaGetErrorString(e));
  if (const cudaError_t e = cudaMemsetAsync(p, 0, 2 * qkv + 2 * out + stats, stream); e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("cuDNN's attention: zeroing its trial run's tensors failed: ") +
                             cudaGetErrorString(e));
  }
  float* stats_at = reinterpret_cast<float*>(st);
  run_locked(f, h, stream, forward_pack(s, x, y, stats_at), ws, "a trial of the forward");
  run_locked(b, h, stream, backward_pack(s, x, y, gy, stats_at, dx), ws, "a trial of the backward");
  const cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("cuDNN's attention: its trial run failed on the device: ") +
                             cudaGetErrorString(e));
}

// The shape's plan for one direction, built on first use (both directions at once, and run once:
// the backward of a step must not be the first to meet the library's refusal).
const Plan& plan(const Shape& s, bool backward, cudaStream_t stream) {
  const std::string why = unavailable(s.dtype, s.D);
  if (!why.empty()) throw std::runtime_error("cuDNN's attention: " + why);
  if (s.T == 1) throw std::runtime_error("cuDNN's attention: its backward does not take sequences of one token");
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const auto find = [&](std::deque<std::pair<Shape, Plan>>& list) -> Plan* {
    for (auto& [shape, p] : list)
      if (shape == s) return &p;
    return nullptr;
  };
  if (find(c.forward) == nullptr) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone)
      throw std::runtime_error("cuDNN's attention: a shape first met while a CUDA graph is captured (B " +
                               std::to_string(s.B) + ", T " + std::to_string(s.T) +
                               "): its graphs are built in an eager step before the capture");
    Plan f, b;
    try {
      const auto start = std::chrono::steady_clock::now();
      const cudnnHandle_t h = handle_locked(s.device);
      build_forward(s, f, h);
      build_backward(s, b, h);
      trial_run(s, f, b, h, stream);
      // Once per shape, for whoever times a first step: the build compiles kernels (seconds).
      std::fprintf(stderr,
                   "cuDNN's attention: graphs for B %lld, T %lld, %lld heads of %lld, %s built and tried in %.1f s; "
                   "workspace forward %.1f MiB, backward %.1f MiB\n",
                   static_cast<long long>(s.B), static_cast<long long>(s.T), static_cast<long long>(s.H),
                   static_cast<long long>(s.D), s.dtype == DType::bf16 ? "bf16" : "fp16",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                   static_cast<double>(f.workspace) / (1 << 20), static_cast<double>(b.workspace) / (1 << 20));
    } catch (const cuda::OutOfMemory&) {
      throw;  // the device's state, not the library's refusal: not kept (under --attention auto the op
              // keeps the shape on our kernels from then on; asked for by name, the run stops)
    } catch (const std::exception& e) {
      f.error = b.error = e.what();
    }
    c.forward.emplace_back(s, std::move(f));
    c.backward.emplace_back(s, std::move(b));
  }
  const Plan& p = *find(backward ? c.backward : c.forward);
  if (!p.error.empty()) throw std::runtime_error(p.error);
  return p;
}

// The handle is the device's one: its stream is set and the graph run under the lock.
void execute(const Shape& s, const Plan& p, cudaStream_t stream, Pack pack, void* workspace, const char* what) {
  std::lock_guard<std::mutex> lock(cache().mutex);
  run_locked(p, handle_locked(s.device), stream, std::move(pack), workspace, what);
}

}  // namespace

std::string unavailable(DType dtype, int64_t head_dim) {
  const std::string shape = unsupported_shape(dtype, head_dim);
  if (!shape.empty()) return shape;
  return library().why_not;
}

std::string describe() { return library().text; }

size_t forward_workspace(const Shape& s, cudaStream_t stream) { return static_cast<size_t>(plan(s, false, stream).workspace); }
size_t backward_workspace(const Shape& s, cudaStream_t stream) { return static_cast<size_t>(plan(s, true, stream).workspace); }

void forward(const Shape& s, cudaStream_t stream, const void* qkv, void* y, float* stats, void* workspace) {
  execute(s, plan(s, false, stream), stream, forward_pack(s, qkv, y, stats), workspace, "the forward");
}

void backward(const Shape& s, cudaStream_t stream, const void* qkv, const void* y, const void* gy, const float* stats,
              void* dqkv, void* workspace) {
  execute(s, plan(s, true, stream), stream, backward_pack(s, qkv, y, gy, stats, dqkv), workspace, "the backward");
}

}  // namespace amp::cudnn_sdpa
