// Stream capture on the emulated GPU (capture.cpp; the graph API is graph.cpp's): the hooks through which the runtime, cuBLAS and
// NCCL parts of the emulator hand work and events to a capture in progress.
//
// Between cudaStreamBeginCapture and cudaStreamEndCapture, work enqueued on the capturing stream, and
// on every stream joined to it by waiting on an event recorded in the capture, becomes a node of the
// capture's graph instead of running; a node depends on the stream's previous node, and a join adds
// the event's nodes. What CUDA forbids during a capture returns its error here and invalidates the
// capture as on a GPU (the CUDA programming guide's "Prohibited and Unhandled Operations"):
// synchronising or querying a capturing stream, synchronising or querying an event recorded in a
// capture (cudaErrorCapturedEvent), waiting on an event recorded outside the capture
// (cudaErrorStreamCaptureIsolation), the legacy stream while a blocking stream captures
// (cudaErrorStreamCaptureImplicit), and the potentially unsafe calls (cudaMalloc, cudaFree, the
// synchronous copies, cudaDeviceSynchronize and cudaEventQuery) from a thread that the captures' modes forbid them
// (cudaStreamCaptureModeGlobal: every thread while a global capture runs; ThreadLocal: the capturing
// thread; Relaxed: none; cudaThreadExchangeStreamCaptureMode sets a thread's own mode).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "device.h"

namespace amp::emu {

// --- the captures' state (capture.cpp), which graph.cpp's API begins, ends and instantiates.
// A capture's graph: its nodes in capture order, each with the nodes it depends on.
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
// The one set of captures (never destroyed, like the engine); m guards it.
Captures& captures();
// After a change to c.by_stream (m held): whether any stream captures, for capture_on().
void update_on(const Captures& c);
// The active captures (m held).
std::set<std::shared_ptr<Capture>> active(const Captures& c);
// The calling thread's capture mode (cudaThreadExchangeStreamCaptureMode).
cudaStreamCaptureMode& thread_capture_mode();

// --- the hooks

// Work for stream s: recorded into s's capture when s takes part in one (returns that capture's
// error, cudaSuccess when recorded); std::nullopt when s does not capture and the caller runs it.
// make() builds the node's work afresh for every replay. On the legacy stream (s == 0) while a
// blocking stream captures: cudaErrorStreamCaptureImplicit, and the capture is invalidated.
std::optional<cudaError_t> capture_enqueue(cudaStream_t s, const std::string& name, const std::function<Op()>& make);

// Whether any stream captures now (cheap: the runtime asks it for every operation).
bool capture_on();
// Whether s takes part in a capture (active or invalidated).
bool capturing(cudaStream_t s);

// A potentially unsafe call from this thread: cudaErrorStreamCaptureUnsupported where a capture's mode
// forbids it (those captures are invalidated), else cudaSuccess.
cudaError_t capture_check_unsafe();

// Synchronising with or querying stream s (0: the legacy stream): cudaErrorStreamCaptureUnsupported
// when s captures (invalidated), cudaErrorStreamCaptureImplicit for the legacy stream while a
// blocking stream captures, else cudaSuccess.
cudaError_t capture_check_stream_sync(cudaStream_t s);

// cudaDeviceSynchronize: cudaErrorStreamCaptureUnsupported while any capture is active (every one is
// invalidated: the device's work includes theirs).
cudaError_t capture_check_device_sync();

// cudaEventRecord(e, s): when s captures, e now stands for s's last nodes (returns the capture's
// error); otherwise std::nullopt, and e is no longer a captured event.
std::optional<cudaError_t> capture_event_record(cudaEvent_t e, cudaStream_t s);

// cudaStreamWaitEvent(s, e): a join when e was recorded in a capture, an error where CUDA has one;
// std::nullopt when neither s captures nor e was captured (an eager wait). `recorded`: whether e has
// ever been recorded (waiting on an empty event is no dependency); `blocking`: whether s orders
// against the legacy stream (a capture it joins becomes blocking).
std::optional<cudaError_t> capture_stream_wait(cudaStream_t s, cudaEvent_t e, bool recorded, bool blocking);

// cudaEventQuery and cudaEventSynchronize of e: cudaErrorCapturedEvent when e was last recorded in a
// capture (an active one is invalidated), else cudaSuccess.
cudaError_t capture_check_event_use(cudaEvent_t e);

}  // namespace amp::emu
