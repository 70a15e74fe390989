// Matrix products: mm with transposes folded into the GEMM, matmul and linear; the transformer's
// MLP with its tanh GELU folded into the GEMMs (mlp_gelu_tanh).
#include <atomic>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {
bool needs(const Tensor& t) { return t.defined() && t.requires_grad(); }


// linear's weight gradient g^T x. A bf16 weight that is a cast of an fp32 tensor (autocast's copy of
// a parameter) gets it in fp32 straight from the GEMM's fp32 accumulator: the cast's backward passes
// it on unchanged, so neither a bf16 gradient nor its cast to fp32 is written (Megatron-LM's gradient
// accumulation fusion; PyTorch rounds the GEMM's output to bf16 and casts it back, within one bf16
// rounding of this). fp16 keeps PyTorch's way: its range is the loss scaler's overflow check.
// A parameter's gradient from g: its dtype, and the leaf whose destination it may be computed into.
struct GradTarget {
  DType dtype;
  Tensor owner;
};
GradTarget grad_target(const Tensor& g, const Tensor& p) {
  const CastNode* cast_of = cast_node_of(p);
  if (g.dtype() == DType::bf16 && cast_of != nullptr && cast_of->from() == DType::f32 && accumulating_backward() &&
      !GradMode::enabled() && fp32_weight_grads())
    return {DType::f32, leaf_of(cast_of->next[0])};
  return {g.dtype(), p};
}

Tensor weight_grad(const Tensor& g, const Tensor& x2, const Tensor& w) {
  const auto [dtype, owner] = grad_target(g, w);
  Tensor dst = take_grad_destination(owner, dtype);
  if (!dst.defined()) {
    if (dtype == g.dtype()) return mm(g, x2, true, false);  // differentiable under create_graph
    dst = empty(w.shape(), dtype, g.device());
  }
  backend_for(g.device()).gemm(true, false, 1.0f, g, x2, 0.0f, dst);
  return dst;
}

// A bias's gradient: g summed over its rows, straight into the bias's destination where it has one.
Tensor bias_grad(const Tensor& g, const Tensor& b) {
  Tensor dst = take_grad_destination(b, g.dtype());
  if (!dst.defined()) return sum_to(g, b.shape());
  backend_for(g.device()).sum_to(g, dst);
  return dst;
}

// A linear layer's weight and bias gradients (g [r, o], x2 [r, in]), from one pass over g where the
// backend fuses them (Backend::linear_param_grads: on CUDA the bias gradient reduced inside the weight
// gradient's GEMM), each straight into its destination where it has one. Each goes where
// weight_grad's rule sends it; where both go in one dtype (under autocast with bf16, fp32: the bias's
// gradient too then comes from fp32 sums, as the weight's, within one bf16 rounding of PyTorch's), the
// backend may fuse them. Elsewhere, and under create_graph, the two apart.
std::pair<Tensor, Tensor> linear_param_grads(const Tensor& g, const Tensor& x2, const Tensor& w, const Tensor& b) {
  Backend& be = backend_for(g.device());
  const GradTarget tw = grad_target(g, w), tb = grad_target(g, b);
  if (GradMode::enabled() || tb.dtype != tw.dtype || !be.fuses_linear_param_grads(g.dtype(), tw.dtype))
    return {weight_grad(g, x2, w), bias_grad(g, b)};
  Tensor dw = take_grad_destination(tw.owner, tw.dtype), db = take_grad_destination(tb.owner, tb.dtype);
  if (!dw.defined()) dw = empty(w.shape(), tw.dtype, g.device());
  if (!db.defined()) db = empty(b.shape(), tb.dtype, g.device());
  be.linear_param_grads(g, x2, dw, db);
  return {dw, db};
}

void check_gemm_operands(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype())
    throw std::invalid_argument(std::string(op) + ": expected both operands to have the same dtype, but got " +
                                dtype_name(a.dtype()) + " and " + dtype_name(b.dtype()));
  if (a.device() != b.device())
    throw std::invalid_argument(std::string(op) + ": operands are on " + a.device().str() + " and " + b.device().str());
}
}  // namespace

Tensor mm(const Tensor& a_in, const Tensor& b_in, bool ta, bool tb) {
  Tensor a = a_in, b = b_in;
  autocast_inputs(OpKind::mm, {&a, &b});
  check_gemm_operands("mm", a, b);
  if (a.dim() != 2 || b.dim() != 2)
    throw std::invalid_argument("mm: expected 2-D operands, got " + shape_str(a.shape()) + " and " + shape_str(b.shape()));
  const int64_t m = ta ? a.shape()[1] : a.shape()[0];
  const int64_t n = tb ? b.shape()[0] : b.shape()[1];
  Tensor c = empty({m, n}, a.dtype(), a.device());
  backend_for(a.device()).gemm(ta, tb, 1.0f, a, b, 0.0f, c);
  // With A = op(a), B = op(b): dA = g B^T and dB = A^T g, transposed back where a or b was.
  return record("MmBackward", c, {a, b}, [a, b, ta, tb](const Tensor& g) {
    Tensor ga, gb;
    if (needs(a)) ga = ta ? mm(b, g, tb, true) : mm(g, b, false, !tb);
    if (needs(b)) gb = tb ? mm(g, a, true, ta) : mm(a, g, !ta, false);
    return std::vector<Tensor>{ga, gb};
  });
}

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  Tensor a = a_in, b = b_in;
  autocast_inputs(OpKind::matmul, {&a, &b});
  if (a.dim() != 2 || b.dim() != 2) throw std::invalid_argument("matmul: only 2-D operands are supported");
  if (a.shape()[1] != b.shape()[0])
    throw std::invalid_argument("matmul: mat1 and mat2 shapes cannot be multiplied (" + shape_str(a.shape()) + " and " +
                                shape_str(b.shape()) + ")");
  return mm(a, b, false, false);
}

Tensor dot(const Tensor& a_in, const Tensor& b_in) {
  Tensor a = a_in, b = b_in;
  autocast_inputs(OpKind::dot, {&a, &b});
  if (a.dim() != 1 || b.dim() != 1 || a.shape()[0] != b.shape()[0])
    throw std::invalid_argument("dot: expected 1-D tensors of the same length, got " + shape_str(a.shape()) + " and " +
                                shape_str(b.shape()));
  AutocastSuspend one_op;  // autocast acted on dot's inputs; its parts must not cast again
  return sum(mul(a, b));    // differentiable through mul and sum
}

Tensor linear(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in) {
  Tensor x = x_in, w = w_in, b = b_in;
  autocast_inputs(OpKind::linear, {&x, &w, &b});
  check_gemm_operands("linear", x, w);
  if (w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.shape()[1])
    throw std::invalid_argument("linear: input " + shape_str(x.shape()) + " does not match weight " +
                                shape_str(w.shape()) + " ([out_features, in_features])");
  if (b.defined() && (b.dim() != 1 || b.shape()[0] != w.shape()[0] || b.dtype() != w.dtype()))
    throw std::invalid_argument("linear: bias " + shape_str(b.shape()) + " (" + dtype_name(b.dtype()) +
                                ") does not match weight " + shape_str(w.shape()) + " (" + dtype_name(w.dtype()) + ")");
  // Leading dimensions are flattened into rows.
  const Shape in_shape = x.shape();
  Tensor x2 = x.dim() == 2 ? x : x.reshape({x.numel() / w.shape()[1], w.shape()[1]});
  Tensor y = empty({x2.shape()[0], w.shape()[0]}, x.dtype(), x.device());
  Backend& be = backend_for(x.device());
  if (b.defined()) {
    be.linear_forward(x2, w, b, y);
  } else {
    be.gemm(false, true, 1.0f, x2, w, 0.0f, y);
  }
  y = record("LinearBackward", y, {x2, w, b}, [x2, w, b](const Tensor& g) {
    Tensor gw, gb;
    // A leaf's first gradient goes straight into its destination (its gradient bucket).
    if (needs(w) && needs(b)) std::tie(gw, gb) = linear_param_grads(g, x2, w, b);
    else if (needs(w)) gw = weight_grad(g, x2, w);
    else if (needs(b)) gb = bias_grad(g, b);
    return std::vector<Tensor>{needs(x2) ? mm(g, w, false, false) : Tensor(), gw, gb};
  });
  if (in_shape.size() == 2) return y;
  Shape out_shape = in_shape;
  out_shape.back() = w.shape()[0];
  return y.reshape(out_shape);
}

Tensor mlp_gelu_tanh(const Tensor& x_in, const Tensor& w1_in, const Tensor& b1_in, const Tensor& w2_in,
                     const Tensor& b2_in) {
  Tensor x = x_in, w1 = w1_in, b1 = b1_in, w2 = w2_in, b2 = b2_in;
  autocast_inputs(OpKind::linear, {&x, &w1, &b1});
  autocast_inputs(OpKind::linear, {&w2, &b2});
  const DType dt = x.dtype();
  const Device dev = x.device();
  const bool same = w1.defined() && b1.defined() && w2.defined() && b2.defined() && is_floating(dt) &&
                    w1.dtype() == dt && b1.dtype() == dt && w2.dtype() == dt && b2.dtype() == dt &&
                    w1.device() == dev && b1.device() == dev && w2.device() == dev && b2.device() == dev;
  const bool shapes = same && x.dim() >= 1 && w1.dim() == 2 && w2.dim() == 2 && b1.dim() == 1 && b2.dim() == 1 &&
                      x.size(-1) == w1.shape()[1] && b1.shape()[0] == w1.shape()[0] &&
                      w2.shape()[1] == w1.shape()[0] && b2.shape()[0] == w2.shape()[0];
  // The GELU would run in x's dtype (autocast leaves it alone) and the second linear in h's.
  const bool one_dtype = shapes && autocast_dtype(OpKind::gelu, dt, dev.type, {dt}) == dt &&
                         autocast_dtype(OpKind::linear, dt, dev.type, {dt}) == dt;
  if (!one_dtype) return linear(gelu(linear(x, w1, b1), true), w2, b2);  // its checks and messages
  const Shape in_shape = x.shape();
  const Tensor x2 = x.dim() == 2 ? x : x.reshape({x.numel() / x.size(-1), x.size(-1)});
  const int64_t rows = x2.shape()[0];
  Tensor pre = empty({rows, w1.shape()[0]}, dt, dev), h = empty({rows, w1.shape()[0]}, dt, dev);
  Tensor y = empty({rows, w2.shape()[0]}, dt, dev);
  Backend& be = backend_for(dev);
  be.linear_gelu_tanh_forward(x2, w1, b1, pre, h);
  be.linear_forward(h, w2, b2, y);
  y = record("MlpGeluTanhBackward", y, {x2, w1, b1, w2, b2}, [x2, w1, b1, w2, b2, pre, h](const Tensor& g) {
    if (GradMode::enabled())
      throw std::runtime_error("mlp_gelu_tanh: no double backward (compose linear, gelu and linear for one)");
    // linear's backward for the second layer, then the first's from dpre, which the GEMM that
    // takes g back through w2 gives with the GELU's slope applied (Backend::linear_input_grad_gelu_tanh).
    Tensor gx, gw1, gb1, gw2, gb2;
    if (needs(w2) && needs(b2)) std::tie(gw2, gb2) = linear_param_grads(g, h, w2, b2);
    else if (needs(w2)) gw2 = weight_grad(g, h, w2);
    else if (needs(b2)) gb2 = bias_grad(g, b2);
    if (needs(x2) || needs(w1) || needs(b1)) {
      Tensor dpre = empty(pre.shape(), pre.dtype(), pre.device());
      backend_for(g.device()).linear_input_grad_gelu_tanh(g, w2, pre, dpre);
      if (needs(w1) && needs(b1)) std::tie(gw1, gb1) = linear_param_grads(dpre, x2, w1, b1);
      else if (needs(w1)) gw1 = weight_grad(dpre, x2, w1);
      else if (needs(b1)) gb1 = bias_grad(dpre, b1);
      if (needs(x2)) gx = mm(dpre, w1, false, false);
    }
    return std::vector<Tensor>{gx, gw1, gb1, gw2, gb2};
  });
  if (in_shape.size() == 2) return y;
  Shape out_shape = in_shape;
  out_shape.back() = w2.shape()[0];
  return y.reshape(out_shape);
}


}  // namespace amp
