// Stream capture on the emulated GPU: the captures' state and the hooks (capture.h) through which
// the runtime, cuBLAS and NCCL record work into a capture instead of running it. The graph API that
// begins, ends, instantiates and launches captures is graph.cpp's.
#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "capture.h"

namespace amp::emu {

namespace {

std::atomic<bool> g_on{false};  // some stream captures: the hooks' fast path when none does


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

void join(Capture& cap, cudaStream_t s, const std::vector<size_t>& deps, bool blocking) {
  cap.tips[s] = merged(cap.tips[s], deps);
  if (blocking) cap.blocking = true;
}

}  // namespace

Captures& captures() {
  static Captures* c = new Captures;  // never destroyed, like the engine
  return *c;
}

void update_on(const Captures& c) { g_on.store(!c.by_stream.empty()); }

std::set<std::shared_ptr<Capture>> active(const Captures& c) {
  std::set<std::shared_ptr<Capture>> out;
  for (const auto& [s, cap] : c.by_stream) out.insert(cap);
  return out;
}

cudaStreamCaptureMode& thread_capture_mode() {
  thread_local cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  return mode;
}

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
  if (thread_capture_mode() == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.m);
  bool hit = false;
  for (const auto& cap : active(c)) {
    if (cap->mode == cudaStreamCaptureModeRelaxed) continue;
    const bool mine = cap->thread == std::this_thread::get_id();
    if (mine || (thread_capture_mode() == cudaStreamCaptureModeGlobal && cap->mode == cudaStreamCaptureModeGlobal)) {
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

std::optional<cudaError_t> capture_stream_wait(cudaStream_t s, cudaEvent_t e, bool recorded, bool blocking) {
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
  join(*cap, s, deps, blocking);
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
