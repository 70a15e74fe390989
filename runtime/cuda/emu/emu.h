// The emulated GPU's controls and counters, for tests and for amp_train's per-step figures.
// Environment: AMP_EMU_SEED (default 1) seeds the stream order and the delays; AMP_EMU_SMS (default 2)
// is the multiprocessor count the device reports, small so that grid-stride loops iterate.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace amp::emu {

struct Counters {
  int64_t launches = 0;    // kernels launched (cuBLAS GEMMs and NCCL collectives count one each)
  int64_t host_syncs = 0;  // calls that made a host thread wait for device work
  int64_t d2h_copies = 0;  // device-to-host copies
};
Counters counters();

// The kernels launched so far (at most the last 256), as launched: name and geometry. A test can
// check which kernel an op chose and with what grid.
struct LaunchRecord {
  std::string kernel;
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z;
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
