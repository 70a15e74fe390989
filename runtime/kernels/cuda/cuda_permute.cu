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

}  // namespace

void CudaBackend::permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) {
  require_cuda(x, "permute: input");
  require_cuda(out, "permute: output");
  const Permute index = math::permuted<kMaxPermuteDims>(x.shape(), perm);
  const int64_t total = x.numel();
  if (total == 0) return;
  Context& ctx = context();
  auto launch = [&](auto U_tag) { using U = decltype(U_tag);
    declare_launch_cost(total * static_cast<int64_t>(sizeof(U)), total * static_cast<int64_t>(sizeof(U)));
    AMP_LAUNCH(grid_for(total, ctx.sm_count()), kBlock, 0, ctx.stream(), permute_kernel<U>)(
        static_cast<const U*>(x.data_ptr()), total, index, static_cast<U*>(out.data_ptr()));
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
