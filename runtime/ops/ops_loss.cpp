// Softmax, log-softmax and the losses. Backward formulas recompute the softmax from the input, so
// that they stay differentiable (double backward) without saving outputs (no reference cycles).
#include <memory>
#include <stdexcept>

#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {
void check_lastdim(const char* op, const Tensor& x, int64_t dim) {
  if (x.dim() == 0 || (dim != -1 && dim != x.dim() - 1))
    throw std::invalid_argument(std::string(op) + ": only the last dimension is supported, got dim " +
                                std::to_string(dim) + " for shape " + shape_str(x.shape()));
}

Tensor softmax_forward(const Tensor& x, bool log) {
  Tensor y = empty_like(x);
  backend_for(x.device()).softmax_lastdim(x, y, log);
  return y;
}

// d nll / d logp as an op, differentiable in its gradient input (it is linear in it).
Tensor nll_loss_backward(const Tensor& g, const Tensor& target, const Shape& logp_shape) {
  Tensor out = empty(logp_shape, g.dtype(), g.device());
  backend_for(g.device()).nll_loss_backward(g, target, out);
  return record("NllLossBackwardBackward", out, {g},
                [target](const Tensor& gg) { return std::vector<Tensor>{nll_loss(gg, target)}; });
}

// A first-order backward (no graph of the gradient) is one fused pass over the saved output; with
// create_graph the formula is built from differentiable ops on the input instead.
Tensor fused_softmax_backward(const Tensor& y, const Tensor& g, bool log, double scale) {
  Tensor gx = empty_like(y);
  backend_for(y.device()).softmax_backward(y, g.dtype() == y.dtype() ? g : g.to(y.dtype()), gx, log, scale);
  return gx;
}
}  // namespace

Tensor softmax(const Tensor& x_in, int64_t dim) {
  Tensor x = x_in;
  autocast_inputs(OpKind::softmax, {&x});
  check_lastdim("softmax", x, dim);
  const Tensor y = softmax_forward(x, false);
  const Tensor saved = y.detach();  // the output without its history: no reference cycle
  return record("SoftmaxBackward", y, {x}, [x, saved](const Tensor& g) {
    if (!GradMode::enabled()) return std::vector<Tensor>{fused_softmax_backward(saved, g, false, 1.0)};
    const Tensor yy = softmax(x);
    return std::vector<Tensor>{mul(yy, sub(g, sum(mul(g, yy), -1, true)))};
  });
}

Tensor log_softmax(const Tensor& x_in, int64_t dim) {
  Tensor x = x_in;
  autocast_inputs(OpKind::log_softmax, {&x});
  check_lastdim("log_softmax", x, dim);
  const Tensor y = softmax_forward(x, true);
  const Tensor saved = y.detach();
  return record("LogSoftmaxBackward", y, {x}, [x, saved](const Tensor& g) {
    if (!GradMode::enabled()) return std::vector<Tensor>{fused_softmax_backward(saved, g, true, 1.0)};
    return std::vector<Tensor>{sub(g, mul(softmax(x), sum(g, -1, true)))};
  });
}

Tensor causal_softmax(const Tensor& x_in, double scale) {
  Tensor x = x_in;
  autocast_inputs(OpKind::softmax, {&x});
  if (x.dim() < 2 || x.size(-1) != x.size(-2))
    throw std::invalid_argument("causal_softmax: expected scores [..., T, T], got " + shape_str(x.shape()));
  Tensor y = empty_like(x);
  backend_for(x.device()).causal_softmax(x, y, scale);
  const Tensor saved = y.detach();
  return record("CausalSoftmaxBackward", y, {x}, [saved, scale](const Tensor& g) {
    if (GradMode::enabled()) throw std::logic_error("causal_softmax: double backward is not supported");
    return std::vector<Tensor>{fused_softmax_backward(saved, g, false, scale)};
  });
}

Tensor nll_loss(const Tensor& logp_in, const Tensor& target) {
  Tensor logp = logp_in;
  autocast_inputs(OpKind::nll_loss, {&logp});
  if (logp.dim() != 2) throw std::invalid_argument("nll_loss: expected input [N, C], got " + shape_str(logp.shape()));
  if (target.dtype() != DType::i64 || target.dim() != 1 || target.shape()[0] != logp.shape()[0])
    throw std::invalid_argument("nll_loss: expected int64 target [" + std::to_string(logp.shape()[0]) + "], got " +
                                dtype_name(target.dtype()) + " " + shape_str(target.shape()));
  Tensor loss = empty({}, logp.dtype(), logp.device());
  backend_for(logp.device()).nll_loss(logp, target, loss);
  const Shape shape = logp.shape();
  return record("NllLossBackward", loss, {logp}, [target, shape](const Tensor& g) {
    return std::vector<Tensor>{nll_loss_backward(g, target, shape)};
  });
}

Tensor cross_entropy(const Tensor& logits_in, const Tensor& target) {
  Tensor logits = logits_in;
  autocast_inputs(OpKind::cross_entropy, {&logits});
  return nll_loss(log_softmax(logits, -1), target);
}

Tensor fused_cross_entropy(const Tensor& logits, const Tensor& target, int64_t classes) {
  if (logits.dim() != 2 || !is_floating(logits.dtype()))
    throw std::invalid_argument("fused_cross_entropy: expected floating logits [N, V], got " +
                                std::string(dtype_name(logits.dtype())) + " " + shape_str(logits.shape()));
  const int64_t rows = logits.shape()[0], cols = logits.shape()[1];
  if (classes == -1) classes = cols;
  if (classes < 1 || classes > cols)
    throw std::invalid_argument("fused_cross_entropy: " + std::to_string(classes) + " classes for logits of " +
                                std::to_string(cols) + " columns");
  if (target.dtype() != DType::i64 || target.dim() != 1 || target.shape()[0] != rows)
    throw std::invalid_argument("fused_cross_entropy: expected int64 target [" + std::to_string(rows) + "], got " +
                                dtype_name(target.dtype()) + " " + shape_str(target.shape()));
  const DType acc = logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor lse = empty({rows}, acc, logits.device()), loss = empty({}, acc, logits.device());
  backend_for(logits.device()).cross_entropy(logits, target, classes, lse, loss);
  const Tensor saved = logits.detach();
  const auto overwritten = std::make_shared<bool>(false);
  return record("FusedCrossEntropyBackward", loss, {logits}, [saved, target, lse, classes, overwritten](const Tensor& g) {
    if (GradMode::enabled()) throw std::logic_error("fused_cross_entropy: double backward is not supported");
    if (*overwritten)  // a backward that would have freed the graph stopped after this node (an exception)
      throw std::runtime_error("fused_cross_entropy: a backward that did not finish has written the gradient over "
                               "the saved logits; run the forward again");
    // Written over the logits when nothing else holds them and the graph goes after this backward:
    // no second [N, V] tensor (the GPT's largest) at the step's peak.
    Tensor gx = releasing_graph() && saved.impl()->storage.use_count() == 1 ? saved : empty_like(saved);
    *overwritten = gx.data_ptr() == saved.data_ptr();
    backend_for(saved.device()).cross_entropy_backward(saved, target, lse, g.dtype() == lse.dtype() ? g : g.to(lse.dtype()),
                                                       classes, gx);
    return std::vector<Tensor>{gx};
  });
}

Tensor mse_loss(const Tensor& input_in, const Tensor& target_in) {
  Tensor input = input_in, target = target_in;
  autocast_inputs(OpKind::mse_loss, {&input, &target});
  if (input.shape() != target.shape())
    throw std::invalid_argument("mse_loss: input " + shape_str(input.shape()) + " and target " +
                                shape_str(target.shape()) + " differ in shape");
  return mean(pow(sub(input, target), 2.0));
}

}  // namespace amp
