// The emulated GPU's controls and counters, for tests and for amp_train's per-step figures (through
// tests/emulated_gpu_observer.cpp).
// Environment: AMP_EMU_SEED (default 1) seeds the stream order and the delays; AMP_EMU_SMS (default 2)
// is the multiprocessor count the device reports, small so that grid-stride loops iterate (132, an
// H100's, for the cost model's dry runs); AMP_EMU_DEVICES (default 8) the node's GPUs, of which
// CUDA_VISIBLE_DEVICES selects; AMP_EMU_DEVICE_ERROR=N makes cudaGetDeviceCount fail with error N.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace amp::emu {

// The dry run (AMP_EMU_DRY_RUN=1): every launch, GEMM, copy, memset and collective is checked,
// counted and logged (launch_log.h) as usual, but none of them runs: no kernel body, no GEMM, no
// byte copied or set, no collective's data moved (the ranks still meet, in order). Device memory is
// reserved (mmap, MAP_NORESERVE) and never touched, so an 80 GB device costs no host memory; the
// memory limit is 80 GB unless AMP_EMU_MEMORY_MB says otherwise. Every device-to-host copy delivers
// zero bytes: a loss of 0 (finite), found_inf 0 (no step skipped, so no loss scale is judged
// collapsed), a stop flag of 0, a gradient norm of 0, a loss scale of 0. A program whose host code
// branches on device values therefore sees zeros; a training step reads none. (Poisoning freed
// blocks, AMP_CUDA_POISON_FREED=1, would add fills a real GPU is not given: a dry run leaves it off.)
bool dry_run();

// Mark the start and the end of a training step in the launch log, the end with the device
// allocator's peak bytes during the step (the training library's step observer calls them once per step).
void log_step_begin(int64_t step);
void log_step(int64_t step, size_t peak_bytes);

struct Counters {
  int64_t launches = 0;    // kernels launched (cuBLAS GEMMs and NCCL collectives count one each)
  int64_t host_syncs = 0;  // calls that made a host thread wait for device work
  int64_t d2h_copies = 0;  // device-to-host copies
  int64_t graph_launches = 0;  // cudaGraphLaunch calls (the kernels they run are not in `launches`)
  int64_t graph_ops = 0;       // the operations those graphs ran: kernels, GEMMs, copies, collectives
  int64_t allocations = 0;     // cudaMalloc and cudaMallocHost calls that allocated
};
Counters counters();
// The most bytes that live cudaMalloc allocations (each rounded up to 256 bytes) held at once since
// the process started: the emulator's own count, beside which a program's cudaMemGetInfo figures
// can be checked.
size_t device_bytes_high_water();

// The kernels launched so far (at most the last 256), as launched: name, geometry, and the cost its
// call site declared (declare_cost; -1 when none). A test can check which kernel an op chose, with
// what grid, and what it said it moves.
struct LaunchRecord {
  std::string kernel;
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z;
  int64_t bytes_read = -1, bytes_written = -1, flops = -1;
};
std::vector<LaunchRecord> recent_launches();

// The first device fault (a barrier or shuffle that not every thread reached, an out-of-range
// pointer handed to a copy, an exception in a kernel), or "" when there was none.
std::string last_fault();
// Clears the sticky fault, for the emulator's own tests (a real device needs a new process).
void clear_fault_for_testing();

// While paused, the device starts no new operation (what is running finishes): a test can enqueue
// work and look at memory before any of it ran. A host thread that waits for the device while it
// is paused waits until it is resumed.
void pause_for_testing(bool paused);

// Waits until every stream is empty, without counting a host synchronisation (for tests that
// inspect memory; a program uses cudaDeviceSynchronize).
void drain_for_testing();

}  // namespace amp::emu
