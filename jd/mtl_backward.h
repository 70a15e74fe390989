// TorchJD's mtl_backward and jac_to_grad: the multi-task backward of Jacobian descent.
//
// mtl_backward(losses, features): every task head gets the ordinary gradient of its own loss in
// .grad; every shared parameter gets the Jacobian of all the losses, [m, *shape], in .jac (added to
// one already there), through the chain rule at `features`. jac_to_grad(params, aggregator) then
// concatenates those Jacobians into one [m, n] matrix, aggregates it once, and adds the result to
// .grad.
#pragma once
#include <functional>
#include <vector>

#include "jd/aggregator.h"
#include "runtime/core/tensor.h"

namespace amp::jd {

struct MtlBackwardOptions {
  // Empty: found from the graph, as TorchJD does (the leaves behind `features`, and for task i the
  // leaves behind losses[i] that are not behind `features`).
  std::vector<std::vector<Tensor>> tasks_params;
  std::vector<Tensor> shared_params;
  bool retain_graph = false;
  // Called once every task head's .grad is final for this call, before the trunk's backward passes.
  std::function<void()> on_task_grads_ready;
  // Called after row k of every shared parameter's .jac is final for this call (rows are computed
  // one backward pass each, in order): a data-parallel caller starts reducing row k while the
  // passes of the next rows run.
  std::function<void(int64_t row)> on_jacobian_row_ready;
};

// losses: m scalar tensors; features: the shared trunk's output that every loss depends on.
void mtl_backward(const std::vector<Tensor>& losses, const Tensor& features, const MtlBackwardOptions& options = {});

// The leaves `root` depends on, in the order a depth-first walk meets them, not walking past `stop`.
std::vector<Tensor> leaves_behind(const Tensor& root, const Tensor& stop = Tensor());

// [m, n]: the .jac of params flattened and concatenated along dim 1 (all must have the same m).
Tensor concatenated_jacobian(const std::vector<Tensor>& params);
// g = aggregator(J), split back, cast to each parameter's dtype and added to .grad; returns g.
Tensor aggregate_into_grads(const std::vector<Tensor>& params, const Tensor& J, Aggregator& aggregator);
// Both, then .jac is cleared unless retain_jac. Returns the aggregator's weights (empty if none).
std::vector<double> jac_to_grad(const std::vector<Tensor>& params, Aggregator& aggregator, bool retain_jac = false);

}  // namespace amp::jd
