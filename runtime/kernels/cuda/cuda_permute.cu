// CUDA backend: permute (its backward is the inverse permute).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/kernels/cuda/block_reduce.cuh"
#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/vec_pack.cuh"
#include "runtime/kernels/strided_index.h"
#include "runtime/kernels/transformer_math.h"

namespace amp::cuda {

namespace {

constexpr int kMaxPermuteDims = 8;
using Permute = math::StridedIndex<kMaxPermuteDims>;

template <class U>
__global__ void permute_kernel(const U* x, int64_t n, Permute index, U* out) {
  AMP_GRID_STRIDE(i, n) out[i] = x[index.offset(i)];
}

// A permute that keeps the innermost dims in place (attention's [B, T, H, D] <-> [B, H, T, D]) moves
// rows of `run` contiguous elements: one index computation per row instead of per element, and
// 16-byte packs within a row. rows indexes the outer dims; thread i moves pack i of the output.
template <class U, int N>
__global__ void permute_rows_kernel(const U* x, int64_t packs, int64_t packs_per_row, Permute rows, U* out) {
  AMP_GRID_STRIDE(i, packs) {
    const int64_t row = i / packs_per_row, j = i - row * packs_per_row;
    const auto* src = reinterpret_cast<const Pack<U, N>*>(x + rows.offset(row)) + j;
    reinterpret_cast<Pack<U, N>*>(out)[i] = *src;
  }
}

// The contiguous run the permute keeps innermost (1 if the last dim moves), and the index of the
// rows of that run: the permuted view with those dims dropped, strides in elements.
struct RowPlan {
  int64_t run = 1;
  Permute rows;
};
RowPlan row_plan(const Permute& index) {
  RowPlan plan;
  int k = index.n;
  while (k > 0 && index.stride[k - 1] == plan.run) plan.run *= index.size[--k];
  plan.rows.n = k;
  for (int d = 0; d < k; ++d) {
    plan.rows.size[d] = index.size[d];
    plan.rows.stride[d] = index.stride[d];
  }
  return plan;
}

}  // namespace

void CudaBackend::permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) {
  require_cuda(x, "permute: input");
  require_cuda(out, "permute: output");
  const Permute index = math::permuted<kMaxPermuteDims>(x.shape(), perm);
  const int64_t total = x.numel();
  if (total == 0) return;
  Context& ctx = context();
  const RowPlan plan = row_plan(index);
  auto launch = [&](auto U_tag) { using U = decltype(U_tag);
    constexpr int N = kPackOf<U>;
    const int64_t bytes = total * static_cast<int64_t>(sizeof(U));
    if (plan.run % N == 0 && pack_aligned(x.data_ptr(), 16) && pack_aligned(out.data_ptr(), 16)) {
      const int64_t packs = total / N;
      declare_launch_cost(bytes, bytes, packs * (2 * plan.rows.n + 2) * kDivModFlops);  // the row, then its index
      AMP_LAUNCH(grid_for(packs, ctx.sm_count()), kBlock, 0, ctx.stream(), permute_rows_kernel<U, N>)(
          static_cast<const U*>(x.data_ptr()), packs, plan.run / N, plan.rows, static_cast<U*>(out.data_ptr()));
    } else {
      declare_launch_cost(bytes, bytes, total * 2 * index.n * kDivModFlops);
      AMP_LAUNCH(grid_for(total, ctx.sm_count()), kBlock, 0, ctx.stream(), permute_kernel<U>)(
          static_cast<const U*>(x.data_ptr()), total, index, static_cast<U*>(out.data_ptr()));
    }
    AMP_CUDA_CHECK_LAUNCH();
  };
  switch (dtype_size(x.dtype())) {
    case 2: launch(uint16_t{}); break;
    case 4: launch(uint32_t{}); break;
    case 8: launch(uint64_t{}); break;
    default: throw std::invalid_argument("permute: unsupported element size");
  }
}

}  // namespace amp::cuda
