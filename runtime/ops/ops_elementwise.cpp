// Element-wise ops and their backward formulas.
#include <stdexcept>

#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {

Shape broadcast_shape(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n, 1);
  for (size_t k = 0; k < n; ++k) {
    const int64_t da = k < a.size() ? a[a.size() - 1 - k] : 1;
    const int64_t db = k < b.size() ? b[b.size() - 1 - k] : 1;
    if (da != db && da != 1 && db != 1)
      throw std::invalid_argument("shapes " + shape_str(a) + " and " + shape_str(b) + " cannot be broadcast together");
    out[n - 1 - k] = da == 1 ? db : da;
  }
  return out;
}

void check_same_device(const Tensor& a, const Tensor& b) {
  if (a.device() != b.device())
    throw std::invalid_argument("expected all tensors on the same device, got " + a.device().str() + " and " +
                                b.device().str());
}

Tensor binary_forward(BinaryOp op, const Tensor& a, const Tensor& b) {
  check_same_device(a, b);
  Tensor out = empty(broadcast_shape(a.shape(), b.shape()), a.dtype(), a.device());
  backend_for(a.device()).binary(op, a, b, out);
  return out;
}

Tensor unary_forward(UnaryOp op, const Tensor& x, double alpha = 0.0) {
  if (!is_floating(x.dtype())) throw std::invalid_argument(std::string("expected a floating tensor, got ") + dtype_name(x.dtype()));
  Tensor y = empty_like(x);
  backend_for(x.device()).unary(op, x, y, alpha);
  return y;
}

// Binary ops compute in their inputs' result type (differentiable casts), with PyTorch's rule that a
// 0-dim tensor does not widen a dimensioned one of the same category.
void promote(Tensor& a, Tensor& b) {
  const DType t = result_type(a.dtype(), a.dim() == 0, b.dtype(), b.dim() == 0);
  a = a.to(t);
  b = b.to(t);
}

bool needs(const Tensor& t) { return t.defined() && t.requires_grad(); }

}  // namespace

Tensor add(const Tensor& a_in, const Tensor& b_in) {
  Tensor a = a_in, b = b_in;
  autocast_inputs(OpKind::add, {&a, &b});
  // A residual stream plus a branch's 16-bit output (the GPT's under autocast): b read as its
  // promotion in the add's pass, its gradient cast back in one (the numbers of promote, add and
  // their backward, without the cast's pass).
  const DType t = result_type(a.dtype(), a.dim() == 0, b.dtype(), b.dim() == 0);
  if (a.dim() > 0 && a.shape() == b.shape() && a.dtype() == t && b.dtype() != t && is_floating(b.dtype())) {
    check_same_device(a, b);
    Tensor out = empty(a.shape(), t, a.device());
    backend_for(a.device()).add_cast(a, b, out);
    const DType db = b.dtype();
    return record("AddBackward", out, {a, b}, [db](const Tensor& g) { return std::vector<Tensor>{g, g.to(db)}; });
  }
  promote(a, b);
  const Shape sa = a.shape(), sb = b.shape();
  return record("AddBackward", binary_forward(BinaryOp::add, a, b), {a, b}, [sa, sb](const Tensor& g) {
    return std::vector<Tensor>{sum_to(g, sa), sum_to(g, sb)};
  });
}

Tensor sub(const Tensor& a_in, const Tensor& b_in) {
  Tensor a = a_in, b = b_in;
  autocast_inputs(OpKind::sub, {&a, &b});
  promote(a, b);
  const Shape sa = a.shape(), sb = b.shape();
  const bool nb = needs(b);
  return record("SubBackward", binary_forward(BinaryOp::sub, a, b), {a, b}, [sa, sb, nb](const Tensor& g) {
    return std::vector<Tensor>{sum_to(g, sa), nb ? sum_to(neg(g), sb) : Tensor()};
  });
}

Tensor mul(const Tensor& a_in, const Tensor& b_in) {
  Tensor a = a_in, b = b_in;
  autocast_inputs(OpKind::mul, {&a, &b});
  promote(a, b);
  return record("MulBackward", binary_forward(BinaryOp::mul, a, b), {a, b}, [a, b](const Tensor& g) {
    return std::vector<Tensor>{needs(a) ? sum_to(mul(g, b), a.shape()) : Tensor(),
                               needs(b) ? sum_to(mul(g, a), b.shape()) : Tensor()};
  });
}

Tensor div(const Tensor& a_in, const Tensor& b_in) {
  Tensor a = a_in, b = b_in;
  autocast_inputs(OpKind::div, {&a, &b});
  promote(a, b);
  return record("DivBackward", binary_forward(BinaryOp::div, a, b), {a, b}, [a, b](const Tensor& g) {
    return std::vector<Tensor>{needs(a) ? sum_to(div(g, b), a.shape()) : Tensor(),
                               needs(b) ? sum_to(neg(div(mul(g, a), mul(b, b))), b.shape()) : Tensor()};
  });
}

Tensor add(const Tensor& a, double s) {
  return record("AddScalarBackward", unary_forward(UnaryOp::add_scalar, a, s), {a},
                [](const Tensor& g) { return std::vector<Tensor>{g}; });
}
Tensor sub(const Tensor& a, double s) { return add(a, -s); }

Tensor mul(const Tensor& a, double s) {
  return record("MulScalarBackward", unary_forward(UnaryOp::mul_scalar, a, s), {a},
                [s](const Tensor& g) { return std::vector<Tensor>{mul(g, s)}; });
}
// A true division, as PyTorch's `t / 4` (x / s and x * (1 / s) differ in the last bit).
Tensor div(const Tensor& a, double s) {
  return record("DivScalarBackward", unary_forward(UnaryOp::div_scalar, a, s), {a},
                [s](const Tensor& g) { return std::vector<Tensor>{div(g, s)}; });
}

Tensor neg(const Tensor& x_in) {
  Tensor x = x_in;
  autocast_inputs(OpKind::neg, {&x});
  return record("NegBackward", unary_forward(UnaryOp::neg, x), {x},
                [](const Tensor& g) { return std::vector<Tensor>{neg(g)}; });
}

Tensor exp(const Tensor& x_in) {
  Tensor x = x_in;
  autocast_inputs(OpKind::exp, {&x});
  return record("ExpBackward", unary_forward(UnaryOp::exp, x), {x},
                [x](const Tensor& g) { return std::vector<Tensor>{mul(g, exp(x))}; });
}

Tensor log(const Tensor& x_in) {
  Tensor x = x_in;
  autocast_inputs(OpKind::log, {&x});
  return record("LogBackward", unary_forward(UnaryOp::log, x), {x},
                [x](const Tensor& g) { return std::vector<Tensor>{div(g, x)}; });
}

Tensor sqrt(const Tensor& x_in) {
  Tensor x = x_in;
  autocast_inputs(OpKind::sqrt, {&x});
  return record("SqrtBackward", unary_forward(UnaryOp::sqrt, x), {x},
                [x](const Tensor& g) { return std::vector<Tensor>{div(g, mul(sqrt(x), 2.0))}; });
}

Tensor pow(const Tensor& x_in, double p) {
  Tensor x = x_in;
  autocast_inputs(OpKind::pow, {&x});
  return record("PowBackward", unary_forward(UnaryOp::pow_scalar, x, p), {x}, [x, p](const Tensor& g) {
    if (p == 0.0) return std::vector<Tensor>{zeros_like(x)};
    if (p == 1.0) return std::vector<Tensor>{g};
    if (p == 2.0) return std::vector<Tensor>{mul(g, mul(x, 2.0))};
    return std::vector<Tensor>{mul(g, mul(pow(x, p - 1.0), p))};
  });
}

Tensor relu(const Tensor& x_in) {
  Tensor x = x_in;
  autocast_inputs(OpKind::relu, {&x});
  return record("ReluBackward", unary_forward(UnaryOp::relu, x), {x},
                [x](const Tensor& g) { return std::vector<Tensor>{relu_backward(g, x)}; });
}

Tensor relu_backward(const Tensor& grad, const Tensor& x) {
  // Piecewise linear: the derivative with respect to x is zero almost everywhere.
  return record("ReluBackwardBackward", binary_forward(BinaryOp::relu_backward, grad, x), {grad},
                [x](const Tensor& gg) { return std::vector<Tensor>{relu_backward(gg, x)}; });
}

Tensor gelu(const Tensor& x_in, bool tanh_approximation) {
  Tensor x = x_in;
  autocast_inputs(OpKind::gelu, {&x});
  Tensor y = unary_forward(tanh_approximation ? UnaryOp::gelu_tanh : UnaryOp::gelu, x);
  return record("GeluBackward", y, {x}, [x, tanh_approximation](const Tensor& g) {
    return std::vector<Tensor>{gelu_backward(g, x, tanh_approximation)};
  });
}

Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool tanh_approximation) {
  const BinaryOp op = tanh_approximation ? BinaryOp::gelu_tanh_backward : BinaryOp::gelu_backward;
  return record("GeluBackwardBackward", binary_forward(op, grad, x), {grad, x},
                [x, tanh_approximation](const Tensor& gg) {
                  if (needs(x))
                    throw std::runtime_error("double backward through gelu with respect to its input is not implemented");
                  return std::vector<Tensor>{gelu_backward(gg, x, tanh_approximation), Tensor()};
                });
}

Tensor cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  if (!is_floating(x.dtype()) || !is_floating(dtype))
    throw std::invalid_argument(std::string("cast: only floating dtypes convert, got ") + dtype_name(x.dtype()) +
                                " to " + dtype_name(dtype));
  Tensor y = empty(x.shape(), dtype, x.device());
  backend_for(x.device()).cast(x, y);
  return cast_precomputed(x, y);
}

Tensor cast_precomputed(const Tensor& x, const Tensor& values) {
  if (values.shape() != x.shape() || values.device() != x.device() || !is_floating(values.dtype()) ||
      !is_floating(x.dtype()))
    throw std::invalid_argument("cast_precomputed: values " + shape_str(values.shape()) + " " +
                                dtype_name(values.dtype()) + " on " + values.device().str() + " are not a cast of " +
                                shape_str(x.shape()) + " " + dtype_name(x.dtype()) + " on " + x.device().str());
  const DType from = x.dtype();
  return record_node(std::make_shared<CastNode>(from), values.detach(), {x});
}

// --- in-place, no autograd

void add_(Tensor& dst, const Tensor& src) {
  if (dst.shape() != src.shape())
    throw std::invalid_argument("add_: shapes " + shape_str(dst.shape()) + " and " + shape_str(src.shape()) + " differ");
  const Tensor s = src.dtype() == dst.dtype() ? src : [&] {
    Tensor t = empty(src.shape(), dst.dtype(), src.device());
    backend_for(src.device()).cast(src, t);
    return t;
  }();
  backend_for(dst.device()).binary(BinaryOp::add, dst, s, dst);
}

void copy_(Tensor& dst, const Tensor& src) {
  if (dst.numel() != src.numel())
    throw std::invalid_argument("copy_: shapes " + shape_str(dst.shape()) + " and " + shape_str(src.shape()) + " differ");
  if (dst.dtype() == src.dtype()) {
    memory_for(dst.device()).copy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
  } else {
    backend_for(dst.device()).cast(src, dst);
  }
}

void fill_(Tensor& t, double value) { memory_for(t.device()).fill(t, value); }

void mul_(Tensor& t, double s) { backend_for(t.device()).unary(UnaryOp::mul_scalar, t, t, s); }

}  // namespace amp
