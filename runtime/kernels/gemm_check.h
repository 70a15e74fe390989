// The validation every backend's gemm does before it launches anything, and the sizes it derives.
#pragma once
#include <cstdint>

#include "runtime/core/tensor.h"

namespace amp {

struct GemmDims {
  int64_t m, n, k;  // op(a) is [m, k], op(b) is [k, n], c is [m, n]
};

// Throws std::invalid_argument naming the shapes or dtypes that do not fit: 2-D operands, matching
// inner sizes, a and b of one dtype, c of that dtype or float32 for fp16/bf16 inputs.
GemmDims check_gemm(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& c);

// The batched form: a, b and c 3-D with one batch size; each [i] checked as check_gemm does.
GemmDims check_gemm_batched(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& c);

class Backend;
// Handles the empty cases (no output, or k = 0: c = beta * c) and returns true, so that backends
// never hand a BLAS a zero dimension; returns false when there is a real product to compute.
bool gemm_is_trivial(Backend& b, int64_t m, int64_t n, int64_t k, float beta, Tensor& c);

}  // namespace amp
