#include "jd/packed_jacobians.h"

#include "jd/jac.h"
#include "jd/mtl_backward.h"
#include "runtime/ops/ops.h"

namespace amp::jd {

Packed pack(const std::vector<Tensor>& shared, const std::vector<std::vector<Tensor>>& tasks) {
  const Tensor J = concatenated_jacobian(shared);
  int64_t n = J.numel();
  for (const auto& task : tasks)
    for (const Tensor& p : task) n += p.numel();
  Packed out{empty({n}, DType::f32, J.device()), J.shape()[0]};
  Tensor part = out.flat.view(0, {J.numel()});
  copy_(part, J.reshape({J.numel()}));
  int64_t off = J.numel();
  for (const auto& task : tasks)
    for (Tensor p : task) {
      Tensor dst = out.flat.view(off, {p.numel()});
      if (p.grad().defined()) copy_(dst, p.grad().reshape({p.numel()}));
      else fill_(dst, 0.0);
      off += p.numel();
      p.set_grad(Tensor());
    }
  for (const Tensor& p : shared) set_jac(p, Tensor());
  return out;
}

std::vector<double> unpack_and_aggregate(const Packed& sum, const std::vector<Tensor>& shared,
                                         const std::vector<std::vector<Tensor>>& tasks, Aggregator& aggregator) {
  int64_t N = 0;
  for (const Tensor& p : shared) N += p.numel();
  const Tensor J = sum.flat.view(0, {sum.rows, N});
  int64_t off = sum.rows * N;
  for (const auto& task : tasks)
    for (Tensor p : task) {
      p.set_grad(sum.flat.view(off, p.shape()).clone());
      off += p.numel();
    }
  for (const Tensor& p : shared) set_jac(p, Tensor());
  aggregate_into_grads(shared, J, aggregator);
  return aggregator.last_weights();
}

}  // namespace amp::jd
