// AMP_HD marks per-element functions that the CPU loops and the CUDA kernels share (docs/DESIGN.md §3).
#pragma once
#if defined(__CUDACC__)
#define AMP_HD __host__ __device__ __forceinline__
#else
#define AMP_HD inline
#endif
