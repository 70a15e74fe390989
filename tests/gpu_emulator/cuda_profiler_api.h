// The emulated toolkit's profiler range (the toolkit's cuda_profiler_api.h): cudaProfilerStart and
// cudaProfilerStop write {"op":"profiler_start"} and {"op":"profiler_stop"} to the launch log
// (launch_log.h), where a profiler would start and stop collecting; nothing else.
#pragma once
#include "cuda_runtime.h"

cudaError_t cudaProfilerStart();
cudaError_t cudaProfilerStop();
