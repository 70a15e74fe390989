#include "jd/jac.h"
#include "jd/mtl_backward.h"

#include <set>
#include <stdexcept>

#include "runtime/ops/autograd.h"
#include "runtime/ops/ops.h"

namespace amp::jd {

std::vector<Tensor> leaves_behind(const Tensor& root, const Tensor& stop) {
  std::vector<Tensor> out;
  const std::shared_ptr<Node> stop_node = stop.defined() ? gradient_edge(stop) : nullptr;
  std::set<const Node*> seen;
  std::set<const TensorImpl*> found;
  std::vector<std::shared_ptr<Node>> stack;
  if (auto n = gradient_edge(root)) stack.push_back(n);
  while (!stack.empty()) {
    std::shared_ptr<Node> n = stack.back();
    stack.pop_back();
    if (n == nullptr || n == stop_node || !seen.insert(n.get()).second) continue;
    if (const auto* acc = dynamic_cast<const AccumulateGrad*>(n.get())) {
      const Tensor leaf = acc->leaf();
      if (found.insert(leaf.impl()).second) out.push_back(leaf);
      continue;
    }
    for (auto it = n->next.rbegin(); it != n->next.rend(); ++it) stack.push_back(*it);  // first input first
  }
  return out;
}

namespace {
void accumulate_grad(const Tensor& p, const Tensor& g) {
  if (!g.defined()) return;
  if (p.grad().defined()) {
    Tensor acc = p.grad();
    add_(acc, g.to(acc.dtype()));
  } else {
    Tensor leaf = p;
    leaf.set_grad(g.to(p.dtype()).clone());
  }
}
}  // namespace

void mtl_backward(const std::vector<Tensor>& losses, const Tensor& features, const MtlBackwardOptions& o) {
  const size_t m = losses.size();
  if (m == 0) throw std::invalid_argument("mtl_backward: `tensors` cannot be empty");
  if (!features.defined() || !features.requires_grad())
    throw std::invalid_argument("mtl_backward: `features` must be a tensor that requires grad");
  for (const Tensor& l : losses)
    if (!l.defined() || l.numel() != 1)
      throw std::invalid_argument("mtl_backward: every loss must be a scalar tensor");
  if (!o.tasks_params.empty() && o.tasks_params.size() != m)
    throw std::invalid_argument("mtl_backward: `tasks_params` must hold one list per loss");
  const std::vector<Tensor> shared = o.shared_params.empty() ? leaves_behind(features) : o.shared_params;
  std::set<const TensorImpl*> shared_set;
  for (const Tensor& p : shared) shared_set.insert(p.impl());
  std::vector<Tensor> feature_grads;
  for (size_t i = 0; i < m; ++i) {
    const std::vector<Tensor> task = o.tasks_params.empty() ? leaves_behind(losses[i], features) : o.tasks_params[i];
    for (const Tensor& p : task)
      if (shared_set.count(p.impl()))
        throw std::invalid_argument("mtl_backward: `tasks_params` and `shared_params` should not overlap");
    std::vector<Tensor> inputs = task;
    inputs.push_back(features);
    const std::vector<Tensor> g = grad({losses[i].reshape({})}, inputs, {}, /*retain_graph=*/true, false, /*allow_unused=*/true);
    for (size_t j = 0; j < task.size(); ++j) accumulate_grad(task[j], g[j]);
    feature_grads.push_back(g.back().defined() ? g.back() : zeros_like(features));
  }
  if (o.on_task_grads_ready) o.on_task_grads_ready();
  // .jac [m, *shape] of every shared parameter, created zero where there is none yet.
  for (const Tensor& p : shared) {
    Shape shape = {static_cast<int64_t>(m)};
    for (int64_t d : p.shape()) shape.push_back(d);
    if (jd::jac(p).defined()) {
      if (jd::jac(p).shape() != shape)
        throw std::invalid_argument("mtl_backward: an existing .jac has shape " + shape_str(jd::jac(p).shape()) + ", expected " +
                                    shape_str(shape));
    } else {
      Tensor leaf = p;
      jd::set_jac(leaf, zeros(shape, p.dtype(), p.device()));
    }
  }
  // One backward through the trunk per loss, seeded with that loss's gradient at the features; row k
  // of every .jac is final after pass k.
  for (size_t k = 0; k < m; ++k) {
    const bool retain = k + 1 < m || o.retain_graph;
    const std::vector<Tensor> rows = grad({features}, shared, {feature_grads[k]}, retain, false, /*allow_unused=*/true);
    for (size_t j = 0; j < shared.size(); ++j) {
      if (!rows[j].defined()) continue;
      const Tensor& p = shared[j];
      Tensor row = jd::jac(p).view(static_cast<int64_t>(k) * p.numel(), {p.numel()});
      add_(row, rows[j].to(p.dtype()).reshape({p.numel()}));
    }
    if (o.on_jacobian_row_ready) o.on_jacobian_row_ready(static_cast<int64_t>(k));
  }
}

Tensor concatenated_jacobian(const std::vector<Tensor>& params) {
  if (params.empty()) throw std::invalid_argument("jac_to_grad: no tensors given");
  int64_t m = -1, n = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    const Tensor j = jd::jac(p);
    if (!j.defined()) throw std::invalid_argument("jac_to_grad: a tensor has no .jac (call mtl_backward first)");
    // [m, *p.shape]: a .jac of another width would be read as other entries, silently.
    if (j.dim() != p.dim() + 1 || Shape(j.shape().begin() + 1, j.shape().end()) != p.shape())
      throw std::invalid_argument("jac_to_grad: tensor " + std::to_string(i) + " of shape " + shape_str(p.shape()) +
                                  " has a .jac of shape " + shape_str(j.shape()) + ", expected [rows" +
                                  (p.dim() == 0 ? "]" : ", " + shape_str(p.shape()).substr(1)));
    if (m < 0) m = j.shape()[0];
    if (j.shape()[0] != m) throw std::invalid_argument("jac_to_grad: all .jac must have the same number of rows");
    if (j.dtype() != jd::jac(params[0]).dtype() || j.device() != jd::jac(params[0]).device())
      throw std::invalid_argument("jac_to_grad: all .jac must share a dtype and a device");
    n += p.numel();
  }
  Tensor J = empty({m, n}, jd::jac(params[0]).dtype(), jd::jac(params[0]).device());
  for (int64_t k = 0; k < m; ++k) {
    int64_t off = 0;
    for (const Tensor& p : params) {
      Tensor dst = J.view(k * n + off, {p.numel()});
      copy_(dst, jd::jac(p).view(k * p.numel(), {p.numel()}));
      off += p.numel();
    }
  }
  return J;
}

Tensor aggregate_into_grads(const std::vector<Tensor>& params, const Tensor& J, Aggregator& aggregator) {
  int64_t n = 0;
  for (const Tensor& p : params) n += p.numel();
  if (J.dim() != 2 || J.shape()[1] != n)  // a column more or less would split into other parameters' entries
    throw std::invalid_argument("aggregate_into_grads: the Jacobian has shape " + shape_str(J.shape()) +
                                ", expected [rows, " + std::to_string(n) + "] (the " + std::to_string(params.size()) +
                                " tensors' " + std::to_string(n) + " values)");
  const Tensor g = aggregator(J);
  int64_t off = 0;
  for (const Tensor& p : params) {
    accumulate_grad(p, g.view(off, p.shape()));
    off += p.numel();
  }
  return g;
}

std::vector<double> jac_to_grad(const std::vector<Tensor>& params, Aggregator& aggregator, bool retain_jac) {
  const Tensor J = concatenated_jacobian(params);
  if (!retain_jac)
    for (Tensor p : params) jd::set_jac(p, Tensor());
  aggregate_into_grads(params, J, aggregator);
  return aggregator.last_weights();
}

}  // namespace amp::jd
