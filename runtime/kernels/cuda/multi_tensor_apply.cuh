// The device half of the multi-tensor launcher (see multi_tensor_plan.h). An Op is a functor
//   __device__ void operator()(void* const* ptrs, int64_t begin, int64_t end, int64_t block) const
// called by every thread of a block with the Depth tensors' base pointers, the element range of the
// block's chunk, and the block's index among all blocks of the call (for per-block partial results).
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "runtime/kernels/cuda/block_reduce.cuh"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/launch.cuh"
#include "runtime/kernels/cuda/multi_tensor_plan.h"

namespace amp::cuda {

inline constexpr int64_t kChunkSize = 65536;
inline constexpr int64_t kMinChunkSize = 128;  // element_wise_chunk_size's floor
inline constexpr int kMaxBlocksPerLaunch = 320;
// Chosen, as in apex, so that the metadata fits CUDA's classic 4 KB kernel-parameter limit.
template <int Depth>
inline constexpr int kMaxTensorsPerLaunch = Depth == 1 ? 110 : Depth == 2 ? 64 : Depth == 3 ? 48 : Depth == 4 ? 36 : 30;

template <int Depth>
struct TensorListMeta {
  void* addr[Depth][kMaxTensorsPerLaunch<Depth>];
  int64_t numel[kMaxTensorsPerLaunch<Depth>];
  uint8_t block_slot[kMaxBlocksPerLaunch];
  int32_t block_chunk[kMaxBlocksPerLaunch];
  int64_t block_base;  // blocks of earlier launches of the same call
  int64_t chunk;       // elements per chunk
};

template <int Depth, class Op>
__global__ void __launch_bounds__(512) multi_tensor_kernel(TensorListMeta<Depth> meta, Op op) {
  const int slot = meta.block_slot[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * meta.chunk;
  const int64_t end = begin + meta.chunk < meta.numel[slot] ? begin + meta.chunk : meta.numel[slot];
  void* ptrs[Depth];
#pragma unroll
  for (int d = 0; d < Depth; ++d) ptrs[d] = meta.addr[d][slot];
  op(ptrs, begin, end, meta.block_base + blockIdx.x);
}

// What op moves and computes per element of the tensors (bytes read, bytes written, FLOPs), and
// writes per block (a partial result): each launch declares its own elements' share for the launch
// log (declare_launch_cost, launch.cuh).
struct MtCost {
  int64_t read = 0, written = 0, flops = 0, written_per_block = 0, read_per_block = 0;
};

// The launches of one plan, in chunks of `chunk` elements; each block's index among all of them is
// the op's `block`.
template <int Depth, class Op>
void launch_plan(const std::vector<std::array<void*, Depth>>& ptrs, const std::vector<int64_t>& numels,
                 const Op& op, const MtCost& cost, int64_t chunk) {
  int64_t base = 0;
  static_assert(sizeof(TensorListMeta<Depth>) + sizeof(Op) <= 4000, "kernel parameters exceed 4 KB");
  Context& ctx = context();
  for (const MultiTensorLaunch& launch : plan_multi_tensor(numels, chunk, kMaxTensorsPerLaunch<Depth>, kMaxBlocksPerLaunch)) {
    TensorListMeta<Depth> meta{};
    for (size_t s = 0; s < launch.tensors.size(); ++s) {
      const auto t = static_cast<size_t>(launch.tensors[s]);
      for (int d = 0; d < Depth; ++d) meta.addr[d][s] = ptrs[t][static_cast<size_t>(d)];
      meta.numel[s] = numels[t];
    }
    int64_t elements = 0;
    for (size_t b = 0; b < launch.block_slot.size(); ++b) {
      meta.block_slot[b] = static_cast<uint8_t>(launch.block_slot[b]);
      meta.block_chunk[b] = launch.block_chunk[b];
      const int64_t begin = static_cast<int64_t>(launch.block_chunk[b]) * chunk;
      const int64_t numel = meta.numel[launch.block_slot[b]];
      elements += (numel - begin < chunk ? numel - begin : chunk);
    }
    meta.block_base = base;
    meta.chunk = chunk;
    const auto blocks = static_cast<unsigned>(launch.block_slot.size());
    declare_launch_cost(elements * cost.read + blocks * cost.read_per_block, elements * cost.written + blocks * cost.written_per_block,
                        elements * cost.flops);
    AMP_LAUNCH(blocks, 512, 0, ctx.stream(), multi_tensor_kernel<Depth, Op>)(meta, op);
    AMP_CUDA_CHECK_LAUNCH();
    base += blocks;
  }
}

// Launches op over the tensors described by ptrs (Depth pointers per tensor, same element count)
// and numels, on the compute stream. An op with per-block results (it uses its `block` argument and
// must declare cost.written_per_block) works in chunks of kChunkSize, by which its caller sizes them
// (multi_tensor_block_count); an element-wise op in element_wise_groups'.
template <int Depth, class Op>
void multi_tensor_apply(const std::vector<std::array<void*, Depth>>& ptrs, const std::vector<int64_t>& numels,
                        const Op& op, const MtCost& cost) {
  if (cost.written_per_block > 0) return launch_plan<Depth>(ptrs, numels, op, cost, kChunkSize);
  for (const ChunkedGroup& g : element_wise_groups(numels, cost.read + cost.written, context().sm_count(), kChunkSize,
                                                   kMinChunkSize, kMaxTensorsPerLaunch<Depth>, kMaxBlocksPerLaunch)) {
    std::vector<std::array<void*, Depth>> group_ptrs;
    std::vector<int64_t> group_numels;
    for (int t : g.tensors) {
      group_ptrs.push_back(ptrs[static_cast<size_t>(t)]);
      group_numels.push_back(numels[static_cast<size_t>(t)]);
    }
    launch_plan<Depth>(group_ptrs, group_numels, op, cost, g.chunk_size);
  }
}

// An op's flag for its block (check_finite's and unscale_and_check's per-tensor flags, folded by
// fold_block_flags): 1 where any thread of the block saw `flag`, else 0, written by thread 0. Every
// thread of the block calls it; nothing is written where block_flags is null (the same for the block).
__device__ __forceinline__ void write_block_flag(double* block_flags, int64_t block, bool flag) {
  if (block_flags == nullptr) return;
  const double any = block_reduce(flag ? 1.0 : 0.0, SumOp{});
  if (threadIdx.x == 0) block_flags[block] = any > 0.0 ? 1.0 : 0.0;
}

// For ops whose tensors all have one storage type.
#define AMP_MT_LOOP(i, begin, end) \
  for (int64_t i = (begin) + static_cast<int64_t>(threadIdx.x); i < (end); i += static_cast<int64_t>(blockDim.x))

}  // namespace amp::cuda
