// Stream capture and CUDA graphs on the emulated GPU (preset cuda-emu; tests/gpu_emulator/capture.h):
// a captured sequence replays as its eager runs do, in dependency order under the emulator's
// adversarial interleaving; everything CUDA forbids during a capture is the same error here, and
// invalidates the capture as on a GPU; NCCL collectives are recorded and run at each replay.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <string>
#include <thread>
#include <vector>

#include "emu.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/launch.cuh"

namespace amp {
namespace {

__global__ void affine(float* x, int64_t n, float a, float b) { AMP_GRID_STRIDE(i, n) x[i] = x[i] * a + b; }
__global__ void add_into(const float* x, float* y, int64_t n) { AMP_GRID_STRIDE(i, n) y[i] += x[i]; }

__global__ void copy_to(const float* x, float* y) { y[0] = x[0]; }

class EmuGraph : public ::testing::Test {
 protected:
  void SetUp() override {
    emu::clear_fault_for_testing();
    (void)cudaGetLastError();
    ASSERT_EQ(cudaStreamCreateWithFlags(&a_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&b_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), cudaSuccess);
  }
  void TearDown() override {
    emu::drain_for_testing();
    for (void* p : allocations_) (void)cudaFree(p);
    (void)cudaEventDestroy(fork_);
    (void)cudaEventDestroy(join_);
    (void)cudaStreamDestroy(a_);
    (void)cudaStreamDestroy(b_);
    emu::clear_fault_for_testing();
    (void)cudaGetLastError();
  }
  float* device(size_t n, float value) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(float)), cudaSuccess);
    allocations_.push_back(p);
    const std::vector<float> v(n, value);
    EXPECT_EQ(cudaMemcpy(p, v.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    return static_cast<float*>(p);
  }
  std::vector<float> host(const float* d, size_t n) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the streams are non-blocking: cudaMemcpy would not wait
    std::vector<float> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  // One step on two streams: a forks to b (b reads x after a changed it), and joins back.
  void step(float* x, float* y, int64_t n) {
    AMP_LAUNCH(2, 32, 0, a_, affine)(x, n, 0.5f, 1.0f);
    ASSERT_EQ(cudaEventRecord(fork_, a_), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(b_, fork_, 0), cudaSuccess);
    AMP_LAUNCH(2, 32, 0, b_, add_into)(x, y, n);
    ASSERT_EQ(cudaEventRecord(join_, b_), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(a_, join_, 0), cudaSuccess);
    AMP_LAUNCH(2, 32, 0, a_, affine)(y, n, 1.0f, -0.25f);
  }
  // A capture of a_ that is expected to have been invalidated by the call under test.
  void expect_invalidated() {
    cudaStreamCaptureStatus status;
    ASSERT_EQ(cudaStreamIsCapturing(a_, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusInvalidated);
    AMP_LAUNCH(1, 1, 0, a_, affine)(static_cast<float*>(allocations_.at(0)), 1, 1.0f, 0.0f);
    EXPECT_EQ(cudaGetLastError(), cudaErrorStreamCaptureInvalidated);
    cudaGraph_t g = reinterpret_cast<cudaGraph_t>(this);
    EXPECT_EQ(cudaStreamEndCapture(a_, &g), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(g, nullptr);
    (void)cudaGetLastError();
  }
  cudaStream_t a_ = nullptr, b_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  std::vector<void*> allocations_;
};

TEST_F(EmuGraph, AReplayedCaptureEqualsEagerRunsAndIsCountedAsGraphLaunches) {
  const int64_t n = 100;
  const int replays = 25;
  float* ex = device(n, 3.0f);
  float* ey = device(n, 0.0f);
  for (int i = 0; i < replays; ++i) step(ex, ey, n);
  const std::vector<float> want_x = host(ex, n), want_y = host(ey, n);

  float* x = device(n, 3.0f);
  float* y = device(n, 0.0f);
  const emu::Counters before = emu::counters();
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  step(x, y, n);
  cudaStreamCaptureStatus status;
  ASSERT_EQ(cudaStreamIsCapturing(b_, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive) << "b joined the capture through the event";
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(a_, &graph), cudaSuccess);
  ASSERT_EQ(cudaStreamIsCapturing(b_, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  emu::drain_for_testing();
  EXPECT_EQ(host(x, 1)[0], 3.0f) << "captured work ran at capture";
  const emu::Counters captured = emu::counters();
  EXPECT_EQ(captured.launches, before.launches) << "captured kernels are not launches";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const emu::Counters mid = emu::counters();
  for (int i = 0; i < replays; ++i) ASSERT_EQ(cudaGraphLaunch(exec, a_), cudaSuccess);
  const emu::Counters after = emu::counters();
  EXPECT_EQ(after.graph_launches - mid.graph_launches, replays);
  EXPECT_EQ(after.graph_ops - mid.graph_ops, 3 * replays);
  EXPECT_EQ(after.launches, mid.launches);
  EXPECT_EQ(after.host_syncs, mid.host_syncs);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(host(x, n), want_x);
  EXPECT_EQ(host(y, n), want_y);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// Inside a replay the nodes run in a random order that respects their dependencies only: a reader on a
// forked stream that does not wait for the writer sometimes reads the old value; with the event, never.
TEST_F(EmuGraph, AMissingEventInsideAGraphChangesTheResult) {
  float* x = device(1, 0.0f);
  float* y = device(1, 0.0f);
  for (const bool with_event : {false, true}) {
    ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
    if (!with_event) {
      ASSERT_EQ(cudaEventRecord(fork_, a_), cudaSuccess);  // b forks before the write
    }
    AMP_LAUNCH(1, 1, 0, a_, affine)(x, 1, 1.0f, 1.0f);
    if (with_event) {
      ASSERT_EQ(cudaEventRecord(fork_, a_), cudaSuccess);  // after it
    }
    ASSERT_EQ(cudaStreamWaitEvent(b_, fork_, 0), cudaSuccess);
    AMP_LAUNCH(1, 1, 0, b_, copy_to)(x, y);
    ASSERT_EQ(cudaEventRecord(join_, b_), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(a_, join_, 0), cudaSuccess);
    cudaGraph_t g = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(a_, &g), cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    int stale = 0;
    for (int replay = 0; replay < 40; ++replay) {
      ASSERT_EQ(cudaGraphLaunch(exec, a_), cudaSuccess);
      const float xv = host(x, 1)[0], yv = host(y, 1)[0];
      stale += yv != xv;
    }
    if (with_event) EXPECT_EQ(stale, 0);
    else EXPECT_GT(stale, 0) << "the reader never overtook the writer: replays are not adversarial";
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
  }
}

// A graph keeps the addresses it was captured with: memory freed after the capture and replayed into
// is a device fault naming the kernel (what the caching allocator's private pools prevent).
TEST_F(EmuGraph, AReplayIntoFreedMemoryIsAFault) {
  device(1, 0.0f);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 4 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  AMP_LAUNCH(1, 4, 0, a_, affine)(static_cast<float*>(p), 4, 2.0f, 1.0f);
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(a_, &g), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
  ASSERT_EQ(cudaFree(p), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, a_), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(a_), cudaErrorIllegalAddress);
  EXPECT_NE(emu::last_fault().find("kernel affine"), std::string::npos) << emu::last_fault();
  emu::clear_fault_for_testing();
  (void)cudaGetLastError();
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
}

// Without the join, b's work is left outside the origin stream: the capture cannot end.
TEST_F(EmuGraph, ForkedWorkThatIsNotJoinedBackIsAnError) {
  float* x = device(4, 1.0f);
  float* y = device(4, 0.0f);
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  AMP_LAUNCH(1, 4, 0, a_, affine)(x, 4, 2.0f, 0.0f);
  ASSERT_EQ(cudaEventRecord(fork_, a_), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(b_, fork_, 0), cudaSuccess);
  AMP_LAUNCH(1, 4, 0, b_, add_into)(x, y, 4);
  cudaGraph_t g = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(a_, &g), cudaErrorStreamCaptureUnjoined);
  EXPECT_EQ(g, nullptr);
  cudaStreamCaptureStatus status;
  ASSERT_EQ(cudaStreamIsCapturing(b_, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
}

TEST_F(EmuGraph, SynchronisingOrQueryingTheCapturingStreamIsUnsupported) {
  device(1, 0.0f);
  for (const bool query : {false, true}) {
    ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
    EXPECT_EQ(query ? cudaStreamQuery(a_) : cudaStreamSynchronize(a_), cudaErrorStreamCaptureUnsupported);
    expect_invalidated();
  }
}

TEST_F(EmuGraph, DeviceSynchronizeAndSynchronousCopiesAreUnsupported) {
  float* x = device(1, 0.0f);
  float v = 0;
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorStreamCaptureUnsupported);
  expect_invalidated();
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(&v, x, sizeof v, cudaMemcpyDeviceToHost), cudaErrorStreamCaptureUnsupported);
  expect_invalidated();
  // Into pageable memory an asynchronous copy makes the host wait for the stream: also a sync.
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(&v, x, sizeof v, cudaMemcpyDeviceToHost, a_), cudaErrorStreamCaptureUnsupported);
  expect_invalidated();
}

// cudaMalloc and cudaFree: forbidden under the global mode (from any thread) and, for the capturing
// thread, under the thread-local mode; allowed under the relaxed mode.
TEST_F(EmuGraph, MallocAndFreeDuringACaptureFollowTheCaptureMode) {
  device(1, 0.0f);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 64), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaErrorStreamCaptureUnsupported);
  expect_invalidated();
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  void* q = nullptr;
  cudaError_t other = cudaSuccess;
  std::thread([&] { other = cudaMalloc(&q, 64); }).join();
  EXPECT_EQ(other, cudaErrorStreamCaptureUnsupported) << "another thread, global mode";
  expect_invalidated();
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  std::thread([&] { other = cudaMalloc(&q, 64); }).join();
  EXPECT_EQ(other, cudaSuccess) << "another thread, thread-local mode";
  EXPECT_EQ(cudaMalloc(&p, 64), cudaErrorStreamCaptureUnsupported) << "the capturing thread, thread-local mode";
  expect_invalidated();
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeRelaxed), cudaSuccess);
  void* r = nullptr;
  EXPECT_EQ(cudaMalloc(&r, 64), cudaSuccess);
  EXPECT_EQ(cudaFree(r), cudaSuccess);
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(a_, &g), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
  // A thread that switches itself to relaxed may allocate during a global capture.
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::thread([&] {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    other = cudaMalloc(&r, 64);
  }).join();
  EXPECT_EQ(other, cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(a_, &g), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaFree(q), cudaSuccess);
  EXPECT_EQ(cudaFree(r), cudaSuccess);
}

TEST_F(EmuGraph, QueryingOrSynchronisingACapturedEventIsAnError) {
  device(1, 0.0f);
  for (const bool query : {false, true}) {
    ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(fork_, a_), cudaSuccess);
    EXPECT_EQ(query ? cudaEventQuery(fork_) : cudaEventSynchronize(fork_), cudaErrorCapturedEvent);
    expect_invalidated();
  }
  // Recorded eagerly again, it is an ordinary event.
  ASSERT_EQ(cudaEventRecord(fork_, a_), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(fork_), cudaSuccess);
}

TEST_F(EmuGraph, TheLegacyStreamCannotCaptureNorBeUsedWhileABlockingStreamCaptures) {
  float* x = device(1, 0.0f);
  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal), cudaErrorStreamCaptureUnsupported);
  (void)cudaGetLastError();
  cudaStream_t blocking;
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeRelaxed), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(x, 0, sizeof(float), nullptr), cudaErrorStreamCaptureImplicit);
  cudaStreamCaptureStatus status;
  EXPECT_EQ(cudaStreamIsCapturing(nullptr, &status), cudaErrorStreamCaptureImplicit);
  cudaGraph_t g = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(blocking, &g), cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();
  (void)cudaStreamDestroy(blocking);
  // A non-blocking capturing stream does not order against the legacy stream: its use is fine.
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeRelaxed), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(x, 0, sizeof(float), nullptr), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(a_, &g), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
}

TEST_F(EmuGraph, WaitingOnAnEventRecordedOutsideTheCaptureIsAnIsolationError) {
  device(1, 0.0f);
  ASSERT_EQ(cudaEventRecord(fork_, b_), cudaSuccess);  // eager
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(a_, fork_, 0), cudaErrorStreamCaptureIsolation);
  expect_invalidated();
}

// A collective inside a capture is recorded, not run, and runs at every replay, numbered in the
// communicator's order when the graph is launched: eager collectives after the replays still match.
TEST_F(EmuGraph, NcclCollectivesAreRecordedAndRunAtEveryReplay) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm = nullptr;
  ASSERT_EQ(ncclCommInitRank(&comm, 1, id, 0), ncclSuccess);
  float* x = device(8, 1.0f);
  ASSERT_EQ(ncclAllReduce(x, x, 8, ncclFloat32, ncclSum, comm, a_), ncclSuccess);  // connects, eagerly
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeGlobal), cudaSuccess);
  AMP_LAUNCH(1, 8, 0, a_, affine)(x, 8, 1.0f, 1.0f);
  ASSERT_EQ(ncclAllReduce(x, x, 8, ncclFloat32, ncclSum, comm, a_), ncclSuccess);
  AMP_LAUNCH(1, 8, 0, a_, affine)(x, 8, 2.0f, 0.0f);
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(a_, &g), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
  const emu::Counters before = emu::counters();
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, a_), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(x, x, 8, ncclFloat32, ncclSum, comm, a_), ncclSuccess);
  AMP_LAUNCH(1, 8, 0, a_, affine)(x, 8, 1.0f, 1.0f);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  // x = 1; each replay x = 2 (x + 1): 4, 10, 22; one rank's sum is x; then + 1.
  EXPECT_EQ(host(x, 8), std::vector<float>(8, 23.0f));
  EXPECT_EQ(emu::counters().graph_ops - before.graph_ops, 9);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
}

}  // namespace
}  // namespace amp
