// The emulated GPU's launch log: with AMP_EMU_LAUNCH_LOG=path, one JSON object per line for every
// device operation, in the order the host issues them (what a profiler's timeline would list,
// without the times), for launch/bench/cost_model.py:
//   {"op":"kernel","name":..,"params":"(float const*, float*, long)","grid":[x,y,z],"block":[x,y,z],"shmem":B,"stream":S,
//    "read":B,"written":B,"flops":F,"declared":true}   bytes and FLOPs from the call site
//   {"op":"gemm","name":..,"m":..,"n":..,"k":..,"batch":..,"a":"bf16","b":"bf16","c":"f32",
//    "compute":"32F","beta":0|1,"read":B,"written":B,"flops":F,"stream":S}
//   {"op":"memcpy","kind":"h2d"|"d2h"|"d2d","pinned":true|false,"bytes":B,"stream":S}
//   {"op":"memset","bytes":B,"stream":S}
//   {"op":"all_reduce"|"broadcast"|"all_gather","redop":"sum",..,"bytes":B,"ranks":N,"stream":S}
//   {"op":"step_begin","step":N}            the start of a training step
//   {"op":"step","step":N,"peak_bytes":B}   its end, with the allocator's peak bytes during it
//   {"op":"profiler_start"}, {"op":"profiler_stop"}   cudaProfilerStart/Stop (cuda_profiler_api.h)
// Streams are numbered in the order the log first sees them (0: the legacy default stream).
// Under MPI every rank writes its own file: path.rank<N> for ranks other than 0.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda_runtime.h"

namespace amp::emu {

// Whether AMP_EMU_LAUNCH_LOG names a file (opened on first use; a file that cannot be opened is
// said once on stderr and logging stays off).
bool launch_log_on();

// What the calling thread's next kernel launch declared (declare_cost), taken back to zero.
struct DeclaredCost {
  int64_t read = 0, written = 0, flops = 0;
  bool declared = false;
};
DeclaredCost take_declared_cost();

// Appends one line: `fields` is the inside of the JSON object after "op" (starting with a comma, or
// empty); the stream is added when `with_stream`.
void log_line(const char* op, const std::string& fields, cudaStream_t stream, bool with_stream = true);

}  // namespace amp::emu
