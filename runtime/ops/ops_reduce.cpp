// Broadcasting and reductions: expand and sum_to are each other's backward.
#include <stdexcept>

#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {
int64_t wrap_dim(int64_t dim, int64_t ndim) {
  const int64_t d = dim < 0 ? dim + ndim : dim;
  if (d < 0 || d >= ndim)
    throw std::out_of_range("dimension " + std::to_string(dim) + " out of range for a " + std::to_string(ndim) +
                            "-d tensor");
  return d;
}
}  // namespace

Tensor expand(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  Tensor out = empty(shape, x.dtype(), x.device());
  backend_for(x.device()).broadcast_to(x, out);
  const Shape original = x.shape();
  return record("ExpandBackward", out, {x},
                [original](const Tensor& g) { return std::vector<Tensor>{sum_to(g, original)}; });
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  Tensor out = empty(shape, x.dtype(), x.device());
  backend_for(x.device()).sum_to(x, out);
  const Shape original = x.shape();
  return record("SumToBackward", out, {x},
                [original](const Tensor& g) { return std::vector<Tensor>{expand(g, original)}; });
}

Tensor sum(const Tensor& x_in) {
  Tensor x = x_in;
  autocast_inputs(OpKind::sum, {&x});
  return sum_to(x, Shape{});
}

Tensor sum(const Tensor& x_in, int64_t dim, bool keepdim) {
  Tensor x = x_in;
  autocast_inputs(OpKind::sum, {&x});
  const int64_t d = wrap_dim(dim, x.dim());
  Shape kept = x.shape();
  kept[static_cast<size_t>(d)] = 1;
  Tensor s = sum_to(x, kept);
  if (keepdim) return s;
  Shape dropped = x.shape();
  dropped.erase(dropped.begin() + d);
  return s.reshape(dropped);
}

// Reduced-precision means are summed and divided in fp32 and rounded once, as PyTorch does: a sum
// rounded to fp16 first would overflow long before the mean does.
Tensor mean(const Tensor& x_in) {
  Tensor x = x_in;
  autocast_inputs(OpKind::mean, {&x});
  if (x.numel() == 0) throw std::invalid_argument("mean of an empty tensor");
  const Tensor wide = is_reduced_float(x.dtype()) ? cast(x, DType::f32) : x;
  return cast(mul(sum_to(wide, Shape{}), 1.0 / static_cast<double>(x.numel())), x.dtype());
}

Tensor mean(const Tensor& x_in, int64_t dim, bool keepdim) {
  Tensor x = x_in;
  autocast_inputs(OpKind::mean, {&x});
  const int64_t d = wrap_dim(dim, x.dim());
  const Tensor wide = is_reduced_float(x.dtype()) ? cast(x, DType::f32) : x;
  Shape kept = x.shape();
  kept[static_cast<size_t>(d)] = 1;
  Tensor m = mul(sum_to(wide, kept), 1.0 / static_cast<double>(x.shape()[static_cast<size_t>(d)]));
  if (!keepdim) {
    Shape dropped = x.shape();
    dropped.erase(dropped.begin() + d);
    m = m.reshape(dropped);
  }
  return cast(m, x.dtype());
}

}  // namespace amp
