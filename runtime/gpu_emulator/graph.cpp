// Stream capture and CUDA graphs on the emulated GPU (capture.h, cuda_runtime.h).
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

namespace amp::emu {

namespace {

struct Node {
  std::string name;
  std::function<Op()> make;
  std::vector<size_t> deps;
};

struct Graph {
  std::vector<Node> nodes;
};

struct Capture {
  cudaStream_t origin = nullptr;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  bool invalidated = false, ended = false;
  bool blocking = false;  // some stream of it orders against the legacy stream
  std::shared_ptr<Graph> graph = std::make_shared<Graph>();
  std::map<cudaStream_t, std::vector<size_t>> tips;  // the streams taking part
};

struct Captures {
  std::mutex m;
  std::map<cudaStream_t, std::shared_ptr<Capture>> by_stream;  // streams taking part in an active capture
  std::map<cudaEvent_t, std::pair<std::shared_ptr<Capture>, std::vector<size_t>>> events;  // captured records
};
Captures& captures() {
  static Captures* c = new Captures;  // never destroyed, like the engine
  return *c;
}

std::atomic<bool> g_on{false};  // some stream captures: the hooks' fast path when none does
void update_on(const Captures& c) { g_on.store(!c.by_stream.empty()); }

thread_local cudaStreamCaptureMode t_mode = cudaStreamCaptureModeGlobal;

// The active captures (m held).
std::set<std::shared_ptr<Capture>> active(const Captures& c) {
  std::set<std::shared_ptr<Capture>> out;
  for (const auto& [s, cap] : c.by_stream) out.insert(cap);
  return out;
}

// What the legacy stream may not do now (m held): a blocking stream captures.
cudaError_t legacy_use_locked(Captures& c) {
  bool hit = false;
  for (const auto& cap : active(c))
    if (cap->blocking) {
      cap->invalidated = true;
      hit = true;
    }
  return hit ? cudaErrorStreamCaptureImplicit : cudaSuccess;
}

std::vector<size_t> merged(std::vector<size_t> a, const std::vector<size_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  std::sort(a.begin(), a.end());
  a.erase(std::unique(a.begin(), a.end()), a.end());
  return a;
}

void join(Capture& cap, cudaStream_t s, const std::vector<size_t>& deps) {
  cap.tips[s] = merged(cap.tips[s], deps);
  const auto blocking = stream_is_blocking(s);
  if (blocking && *blocking) cap.blocking = true;
}

}  // namespace

std::optional<cudaError_t> capture_enqueue(cudaStream_t s, const std::string& name, const std::function<Op()>& make) {
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  if (s == nullptr) {
    const cudaError_t err = legacy_use_locked(c);
    return err == cudaSuccess ? std::nullopt : std::optional<cudaError_t>(err);
  }
  const auto it = c.by_stream.find(s);
  if (it == c.by_stream.end()) return std::nullopt;
  Capture& cap = *it->second;
  if (cap.invalidated) return cudaErrorStreamCaptureInvalidated;
  std::vector<size_t>& tips = cap.tips[s];
  cap.graph->nodes.push_back(Node{name, make, tips});
  tips = {cap.graph->nodes.size() - 1};
  return cudaSuccess;
}

bool capture_on() { return g_on.load(); }

bool capturing(cudaStream_t s) {
  if (!capture_on()) return false;
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  return s != nullptr && c.by_stream.count(s) > 0;
}

cudaError_t capture_check_unsafe() {
  if (t_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  bool hit = false;
  for (const auto& cap : active(c)) {
    if (cap->mode == cudaStreamCaptureModeRelaxed) continue;
    const bool mine = cap->thread == std::this_thread::get_id();
    if (mine || (t_mode == cudaStreamCaptureModeGlobal && cap->mode == cudaStreamCaptureModeGlobal)) {
      cap->invalidated = true;
      hit = true;
    }
  }
  return hit ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

cudaError_t capture_check_stream_sync(cudaStream_t s) {
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  if (s == nullptr) return legacy_use_locked(c);
  const auto it = c.by_stream.find(s);
  if (it == c.by_stream.end()) return cudaSuccess;
  it->second->invalidated = true;
  return cudaErrorStreamCaptureUnsupported;
}

cudaError_t capture_check_device_sync() {
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  const auto caps = active(c);
  for (const auto& cap : caps) cap->invalidated = true;
  return caps.empty() ? cudaSuccess : cudaErrorStreamCaptureUnsupported;
}

std::optional<cudaError_t> capture_event_record(cudaEvent_t e, cudaStream_t s) {
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  const auto it = s == nullptr ? c.by_stream.end() : c.by_stream.find(s);
  if (it == c.by_stream.end()) {
    c.events.erase(e);
    return std::nullopt;
  }
  const auto cap = it->second;
  if (cap->invalidated) return cudaErrorStreamCaptureInvalidated;
  c.events[e] = {cap, cap->tips[s]};
  return cudaSuccess;
}

std::optional<cudaError_t> capture_stream_wait(cudaStream_t s, cudaEvent_t e, bool recorded) {
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  const auto mine = s == nullptr ? c.by_stream.end() : c.by_stream.find(s);
  const auto ev = c.events.find(e);
  if (ev == c.events.end()) {
    if (mine == c.by_stream.end()) return std::nullopt;  // eager
    if (mine->second->invalidated) return cudaErrorStreamCaptureInvalidated;
    if (!recorded) return cudaSuccess;  // an event never recorded is no work: nothing to wait for
    mine->second->invalidated = true;   // a dependency on work outside the capture
    return cudaErrorStreamCaptureIsolation;
  }
  const auto& [cap, deps] = ev->second;
  if (cap->ended) return cudaErrorCapturedEvent;
  if (s == nullptr) {
    cap->invalidated = true;
    return cudaErrorStreamCaptureImplicit;
  }
  if (mine != c.by_stream.end() && mine->second != cap) {  // two captures would merge
    cap->invalidated = true;
    mine->second->invalidated = true;
    return cudaErrorStreamCaptureMerge;
  }
  if (cap->invalidated) return cudaErrorStreamCaptureInvalidated;
  join(*cap, s, deps);
  c.by_stream[s] = cap;
  update_on(c);
  return cudaSuccess;
}

cudaError_t capture_check_event_use(cudaEvent_t e) {
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  const auto ev = c.events.find(e);
  if (ev == c.events.end()) return cudaSuccess;
  if (!ev->second.first->ended) ev->second.first->invalidated = true;
  return cudaErrorCapturedEvent;
}

}  // namespace amp::emu

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
  std::swap(*mode, t_mode);
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
