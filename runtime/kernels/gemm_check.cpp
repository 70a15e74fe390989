#include "runtime/kernels/gemm_check.h"

#include "runtime/kernels/backend.h"

#include <stdexcept>
#include <string>

namespace amp {

GemmDims check_gemm(bool ta, bool tb, const Tensor& a, const Tensor& b, const Tensor& c) {
  if (a.dim() != 2 || b.dim() != 2 || c.dim() != 2) throw std::invalid_argument("gemm: operands must be 2-D");
  const GemmDims d{ta ? a.shape()[1] : a.shape()[0], tb ? b.shape()[0] : b.shape()[1], ta ? a.shape()[0] : a.shape()[1]};
  const int64_t kb = tb ? b.shape()[1] : b.shape()[0];
  if (d.k != kb || c.shape()[0] != d.m || c.shape()[1] != d.n)
    throw std::invalid_argument("gemm: shapes " + shape_str(a.shape()) + (ta ? "^T" : "") + " @ " +
                                shape_str(b.shape()) + (tb ? "^T" : "") + " -> " + shape_str(c.shape()) +
                                " do not match");
  if (a.dtype() != b.dtype()) throw std::invalid_argument("gemm: a and b must share a dtype");
  if (c.dtype() != a.dtype() && !(is_reduced_float(a.dtype()) && c.dtype() == DType::f32))
    throw std::invalid_argument(std::string("gemm: ") + dtype_name(a.dtype()) + " inputs cannot write a " +
                                dtype_name(c.dtype()) + " output (only fp16/bf16 inputs may write float32)");
  return d;
}

GemmDims check_gemm_batched(bool ta, bool tb, const Tensor& a, const Tensor& b, const Tensor& c) {
  if (a.dim() != 3 || b.dim() != 3 || c.dim() != 3 || a.shape()[0] != b.shape()[0] || a.shape()[0] != c.shape()[0])
    throw std::invalid_argument("gemm_batched: operands must be 3-D with one batch size, got " + shape_str(a.shape()) +
                                ", " + shape_str(b.shape()) + " and " + shape_str(c.shape()));
  const auto inner = [](const Tensor& t) { return t.view(0, {t.shape()[1], t.shape()[2]}); };
  return check_gemm(ta, tb, inner(a), inner(b), inner(c));
}

bool gemm_is_trivial(Backend& b, int64_t m, int64_t n, int64_t k, float beta, Tensor& c) {
  if (m == 0 || n == 0) return true;
  if (k != 0) return false;
  if (beta == 0.0f) memory_for(c.device()).fill(c, 0.0);
  else b.unary(UnaryOp::mul_scalar, c, c, beta);
  return true;
}

}  // namespace amp
