// cuDNN's fused causal attention (SDPA), the seam between the CUDA backend and the library. Three
// implementations, CMake picks one: cudnn_sdpa.cpp is cuDNN itself (cudnn-frontend's graph API over
// libcudnn, loaded at run time from the node); cudnn_sdpa_absent.cpp a build without the frontend's
// headers (launch/setup.sh fetches them); cudnn_sdpa_reference.cu the emulated GPU's stand-in,
// exact attention as plain kernels, so that the trainer's path, a CUDA graph's capture and
// determinism are tested in CI.
//
// The layout is the GPT's: q, k and v read where the qkv projection wrote them, side by side in
// qkv [B, T, 3C] (head h of q at column h D, of k at C + h D, of v at 2C + h D); y written as
// [B, T, C]; stats [B, H, T] fp32, each row's log-sum-exp of its scaled scores (natural log), which
// the backward reads; dqkv [B, T, 3C] as qkv. Causal, no dropout, scale applied to the scores. The
// backward is deterministic: runs repeat bit for bit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda_runtime.h"
#include "runtime/core/dtype.h"

namespace amp::cudnn_sdpa {

struct Shape {
  int64_t B = 0, T = 0, H = 0, D = 0;
  DType dtype = DType::bf16;
  float scale = 1.0f;
  int device = 0;  // the CUDA device whose stream runs it
  bool operator==(const Shape&) const = default;
};

// What cuDNN's fused attention takes, whatever the library (its documented support for causal
// SDPA on Hopper-class GPUs): bf16 or fp16, a head size that is a multiple of 8 up to 128. ""
// when it does, else why not.
inline std::string unsupported_shape(DType dtype, int64_t head_dim) {
  if (dtype != DType::bf16 && dtype != DType::f16)
    return "cuDNN's attention runs in bf16 or fp16 (autocast's --amp bf16 or fp16), not in fp32 or fp64";
  if (head_dim % 8 != 0 || head_dim < 8 || head_dim > 128)
    return "cuDNN's attention needs a head size that is a multiple of 8 up to 128, not " + std::to_string(head_dim);
  return "";
}

// "" when the library can run causal attention of this dtype and head size on the current device,
// else why not: not built with it, libcudnn not found or older than the headers, the shape. Loads
// the library on the first call (once per process), and does not throw.
std::string unavailable(DType dtype, int64_t head_dim);
// The library found: "cuDNN 9.19.0 (libcudnn.so.9)", or why there is none.
std::string describe();

// The device workspace each direction needs for the shape, in bytes. The shape's first call builds
// both directions' graphs and runs each once on zeroed scratch tensors (the library's refusal of
// either, at its build or its first run, is met at the forward, where the op can still fall back),
// once per process, and says on stderr how long that took and the workspaces' sizes. A shape first
// met while `stream` captures a CUDA graph is refused (std::runtime_error): the trainer's eager steps
// come first. T = 1 is refused (cuDNN's backward does not take it). The allocator's OutOfMemory
// passes through, not kept as the shape's error: its next forward tries again.
size_t forward_workspace(const Shape& s, cudaStream_t stream);
size_t backward_workspace(const Shape& s, cudaStream_t stream);

// Enqueue on stream. Throws std::runtime_error naming what failed (the library's message).
void forward(const Shape& s, cudaStream_t stream, const void* qkv, void* y, float* stats, void* workspace);
void backward(const Shape& s, cudaStream_t stream, const void* qkv, const void* y, const void* gy, const float* stats,
              void* dqkv, void* workspace);

}  // namespace amp::cudnn_sdpa
