// CUDA graphs on the emulated GPU (cuda_runtime.h): beginning and ending a capture (whose state and
// hooks are capture.cpp's), instantiating its graph, and launching it.
//
// A capture is a list of nodes in the order they were captured, each with the nodes it depends on;
// every stream taking part has its tips (the nodes its next work will depend on). cudaGraphLaunch
// enqueues one operation on the launch stream that runs the nodes whose dependencies are done, one at
// a time, picked at random with a seeded generator, and lets the device thread serve other streams
// between them: a missing join inside a graph changes results as it does for eager work.
#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "capture.h"

using namespace amp::emu;

namespace {

// Sets the calling thread's last error and returns err (cudaSuccess also returns the sticky fault).
cudaError_t answer(cudaError_t err) {
  if (err == cudaSuccess) {
    const cudaError_t s = sticky_error();
    return s == cudaSuccess ? s : set_last_error(s);
  }
  return set_last_error(err);
}

// An instantiated graph: its nodes and, per node, the nodes that depend on it.
struct Exec {
  std::shared_ptr<const Graph> graph;
  std::vector<std::vector<size_t>> successors;
};

std::mutex g_handles_mutex;
std::set<const void*> g_graphs, g_execs;  // live handles

bool live(const std::set<const void*>& handles, const void* p) {
  std::lock_guard<std::mutex> lock(g_handles_mutex);
  return handles.count(p) > 0;
}

// One replay: the operations of the nodes, built when it is launched, run in dependency order.
struct Replay {
  std::vector<Op> ops;
  std::shared_ptr<const Exec> exec;
  std::vector<size_t> waiting;  // per node: dependencies not yet done
  std::vector<size_t> ready;
  size_t remaining = 0;
  std::mt19937_64 rng;

  bool step() {
    if (sticky_error() != cudaSuccess) return true;  // a fault drops the rest, as for queued work
    // The ready nodes from a random one on: the first that finishes ends this turn, so that other
    // streams run between nodes (a node that is not finished, an NCCL collective waiting for its
    // peers, lets the next ready node try).
    const size_t n = ready.size(), first = n == 0 ? 0 : rng() % n;
    for (size_t k = 0; k < n; ++k) {
      const size_t at = (first + k) % n, node = ready[at];
      Op& op = ops[node];
      bool done = false;
      try {
        done = op.step();
      } catch (const std::exception& e) { throw std::runtime_error(op.name + ": " + e.what()); }
      if (!done) continue;
      // Released as a finished eager operation is: an NCCL collective's end lets the next one run.
      op = Op{op.name, nullptr};
      ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(at));
      --remaining;
      for (const size_t next : exec->successors[node])
        if (--waiting[next] == 0) ready.push_back(next);
      break;
    }
    return remaining == 0;
  }
};

Op make_replay(const std::shared_ptr<const Exec>& exec, uint64_t seed) {
  auto r = std::make_shared<Replay>();
  r->exec = exec;
  r->rng.seed(seed);
  const auto& nodes = exec->graph->nodes;
  r->remaining = nodes.size();
  r->waiting.resize(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    r->ops.push_back(nodes[i].make());  // in capture order: NCCL numbers its collectives here
    r->waiting[i] = nodes[i].deps.size();
    if (r->waiting[i] == 0) r->ready.push_back(i);
  }
  return Op{"cudaGraphLaunch", [r] { return r->step(); }};
}

}  // namespace

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  if (stream == nullptr) return answer(cudaErrorStreamCaptureUnsupported);  // the legacy stream cannot capture
  const auto blocking = stream_is_blocking(stream);
  if (!blocking) return answer(cudaErrorInvalidResourceHandle);
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed)
    return answer(cudaErrorInvalidValue);
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  if (c.by_stream.count(stream) > 0) return answer(cudaErrorIllegalState);
  auto cap = std::make_shared<Capture>();
  cap->origin = stream;
  cap->mode = mode;
  cap->thread = std::this_thread::get_id();
  cap->blocking = *blocking;
  cap->tips[stream] = {};
  c.by_stream[stream] = cap;
  update_on(c);
  return answer(cudaSuccess);
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (graph == nullptr) return answer(cudaErrorInvalidValue);
  *graph = nullptr;
  Captures& c = captures();
  std::shared_ptr<Capture> cap;
  {
    std::lock_guard<std::mutex> lock(c.m);
    const auto it = c.by_stream.find(stream);
    if (stream == nullptr || it == c.by_stream.end()) return answer(cudaErrorIllegalState);
    cap = it->second;
    if (cap->origin != stream) {
      cap->invalidated = true;
      return answer(cudaErrorStreamCaptureUnmatched);
    }
    if (cap->mode != cudaStreamCaptureModeRelaxed && cap->thread != std::this_thread::get_id())
      return answer(cudaErrorStreamCaptureWrongThread);
    // The capture ends for every stream that took part, valid or not.
    for (auto s = c.by_stream.begin(); s != c.by_stream.end();) s = s->second == cap ? c.by_stream.erase(s) : ++s;
    cap->ended = true;
    update_on(c);
  }
  if (cap->invalidated) return answer(cudaErrorStreamCaptureInvalidated);
  // Every other stream's work must have been joined back into the origin stream.
  const auto& nodes = cap->graph->nodes;
  std::vector<bool> before_end(nodes.size(), false);
  std::vector<size_t> todo = cap->tips[stream];
  while (!todo.empty()) {
    const size_t n = todo.back();
    todo.pop_back();
    if (before_end[n]) continue;
    before_end[n] = true;
    todo.insert(todo.end(), nodes[n].deps.begin(), nodes[n].deps.end());
  }
  for (const auto& [s, tips] : cap->tips)
    for (const size_t n : tips)
      if (!before_end[n]) return answer(cudaErrorStreamCaptureUnjoined);
  auto* g = new Graph(*cap->graph);
  {
    std::lock_guard<std::mutex> lock(g_handles_mutex);
    g_graphs.insert(g);
  }
  *graph = reinterpret_cast<cudaGraph_t>(g);
  return answer(cudaSuccess);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  if (status == nullptr) return answer(cudaErrorInvalidValue);
  *status = cudaStreamCaptureStatusNone;
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  if (stream == nullptr) {
    for (const auto& cap : active(c))
      if (cap->blocking) return answer(cudaErrorStreamCaptureImplicit);
    return answer(cudaSuccess);
  }
  const auto it = c.by_stream.find(stream);
  if (it != c.by_stream.end())
    *status = it->second->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return answer(cudaSuccess);
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (mode == nullptr) return answer(cudaErrorInvalidValue);
  std::swap(*mode, thread_capture_mode());
  return answer(cudaSuccess);
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (exec == nullptr || !live(g_graphs, graph)) return answer(cudaErrorInvalidValue);
  auto e = std::make_shared<Exec>();
  e->graph = std::make_shared<const Graph>(*reinterpret_cast<const Graph*>(graph));
  e->successors.resize(e->graph->nodes.size());
  for (size_t i = 0; i < e->graph->nodes.size(); ++i)
    for (const size_t d : e->graph->nodes[i].deps) e->successors[d].push_back(i);
  auto* handle = new std::shared_ptr<const Exec>(std::move(e));
  {
    std::lock_guard<std::mutex> lock(g_handles_mutex);
    g_execs.insert(handle);
  }
  *exec = reinterpret_cast<cudaGraphExec_t>(handle);
  return answer(cudaSuccess);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (!live(g_execs, exec)) return answer(cudaErrorInvalidValue);
  const std::shared_ptr<const Exec> e = *reinterpret_cast<const std::shared_ptr<const Exec>*>(exec);
  const uint64_t seed = random_u64();
  const auto make = [e, seed] { return make_replay(e, seed); };
  if (const auto captured = capture_enqueue(stream, "cudaGraphLaunch", make)) return answer(*captured);
  if (const cudaError_t err = enqueue(stream, make()); err != cudaSuccess) return answer(err);
  count_graph_launch(static_cast<int64_t>(e->graph->nodes.size()));
  return answer(cudaSuccess);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  {
    std::lock_guard<std::mutex> lock(g_handles_mutex);
    if (g_execs.erase(exec) == 0) return answer(cudaErrorInvalidValue);
  }
  delete reinterpret_cast<std::shared_ptr<const Exec>*>(exec);  // a launched replay keeps its own reference
  return answer(cudaSuccess);
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  {
    std::lock_guard<std::mutex> lock(g_handles_mutex);
    if (g_graphs.erase(graph) == 0) return answer(cudaErrorInvalidValue);
  }
  delete reinterpret_cast<Graph*>(graph);
  return answer(cudaSuccess);
}
