// The emulated GPU's engine, shared by the runtime, cuBLAS and NCCL parts of the emulator (not by
// the project's own code, which sees only the CUDA, cuBLAS and NCCL APIs).
//
// Work is asynchronous. Every stream is a queue of operations; one device thread runs them. Nothing
// runs when it is enqueued: an operation becomes eligible after a seeded random delay (or at once
// when a host thread waits for the device), and among the streams whose head is eligible the device
// thread picks one at random with a seeded generator. A missing event or stream wait therefore
// changes what a program computes, and the tests see it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "cuda_runtime.h"

namespace amp::emu {

// One unit of stream work. step() runs on the device thread when the operation is at the head of its
// stream; it returns true when finished, or false to be called again later (an NCCL collective
// waiting for its peers): the stream stays blocked behind it while other streams go on. A step that
// throws records a sticky device fault with the exception's message.
struct Op {
  std::string name;
  std::function<bool()> step;
};

// Enqueues op on stream s (0: the legacy default stream, which waits for all earlier work).
// Returns cudaErrorInvalidResourceHandle for an unknown stream, or the sticky fault.
cudaError_t enqueue(cudaStream_t s, Op op);

// Makes the calling host thread wait until pred() holds (checked on the device thread's progress),
// counting one host synchronisation. Returns the sticky fault if the device faulted meanwhile.
cudaError_t host_wait(const char* why, const std::function<bool()>& pred);

// Records the sticky device fault (first one wins) and prints it once to stderr. Every later call
// of the runtime API returns code, as after a real kernel fault.
void fault(const std::string& message, cudaError_t code = cudaErrorLaunchFailure);
// The sticky fault, or cudaSuccess.
cudaError_t sticky_error();

// Device memory: whether [p, p + bytes) lies inside one live cudaMalloc allocation.
bool is_device_range(const void* p, size_t bytes);
// Pinned host memory from cudaMallocHost.
bool is_pinned_range(const void* p, size_t bytes);

// The dry run's device memory (dry_run.cpp): reserved address space, page-aligned, never written.
void* reserve_device_memory(size_t bytes);
void release_device_memory(void* p, size_t bytes);

// Counters (see emu.h): launched kernels (not those captured on s), host synchronisations,
// device-to-host copies.
void count_launch(cudaStream_t s);
void count_d2h();

// The seeded generator of the emulator (AMP_EMU_SEED, default 1), for anything that must vary.
uint64_t random_u64();

// Sets the calling thread's last-error slot (as a failing API call does) and returns err.
cudaError_t set_last_error(cudaError_t err);

// Whether stream s exists, and whether it orders against the legacy stream.
std::optional<bool> stream_is_blocking(cudaStream_t s);

// Counts one graph launch of `ops` operations (emu.h's counters; graph.cpp).
void count_graph_launch(int64_t ops);

}  // namespace amp::emu
