// The CPU backend's permute (its backward is the inverse permute).
#include "runtime/kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/kernels/cpu/dispatch.h"
#include "runtime/kernels/strided_index.h"
#include "runtime/kernels/transformer_math.h"

namespace amp {

void CpuBackend::permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) {
  const math::StridedIndex<8> pi = math::permuted<8>(x.shape(), perm);
  const int n = pi.n;
  const size_t es = dtype_size(x.dtype());
  const long total = static_cast<long>(x.numel());
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  // Whole rows when the last dim stays last: one copy per row.
  const int64_t row = n > 0 && perm[n - 1] == n - 1 ? x.shape()[n - 1] : 1;
  const long rows = row == 0 ? 0 : total / static_cast<long>(row);
#pragma omp parallel for schedule(static) if (total > cpu::kParallelGrain)
  for (long r = 0; r < rows; ++r) {
    const int64_t o = static_cast<int64_t>(r) * row;
    std::memcpy(dst + static_cast<size_t>(o) * es, src + static_cast<size_t>(pi.offset(o)) * es, static_cast<size_t>(row) * es);
  }
}

}  // namespace amp
