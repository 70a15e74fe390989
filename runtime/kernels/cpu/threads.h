// Threads of the CPU backend (OpenMP loops and OpenBLAS/oneDNN GEMMs).
#pragma once

namespace amp {

void set_num_threads(int n);
int get_num_threads();

}  // namespace amp
