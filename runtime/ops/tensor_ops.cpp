// The Tensor members and factories that are ops (declared with the handle in runtime/core/tensor.h,
// as PyTorch's Tensor methods are defined by ATen): a differentiable cast and reshape, backward, and
// from_vector's rounding into a dtype by the CPU's cast kernel.
#include <algorithm>
#include <stdexcept>

#include "runtime/core/tensor.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/autograd.h"
#include "runtime/ops/ops.h"

namespace amp {

void Tensor::backward(const Tensor& gradient, bool retain_graph, bool create_graph) const {
  amp::backward({*this}, gradient.defined() ? std::vector<Tensor>{gradient} : std::vector<Tensor>{}, retain_graph,
                create_graph);
}

Tensor Tensor::to(DType t) const { return t == dtype() ? *this : cast(*this, t); }

Tensor Tensor::reshape(const Shape& s) const {
  if (shape_numel(s) != numel())
    throw std::invalid_argument("cannot reshape " + shape_str(shape()) + " into " + shape_str(s));
  Tensor out = detach();
  out.impl()->shape = s;
  const Shape original = shape();
  return record("ReshapeBackward", out, {*this}, [original](const Tensor& g) {
    return std::vector<Tensor>{g.reshape(original)};
  });
}

Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype, Device device) {
  if (static_cast<int64_t>(values.size()) != shape_numel(shape))
    throw std::invalid_argument("from_vector: " + std::to_string(values.size()) + " values for shape " +
                                shape_str(shape));
  Tensor host = empty(shape, DType::f64, kCPU);
  std::copy(values.begin(), values.end(), host.data<double>());
  Tensor typed = dtype == DType::f64 ? host : empty(shape, dtype, kCPU);
  if (dtype == DType::i64) {
    for (size_t i = 0; i < values.size(); ++i) typed.data<int64_t>()[i] = static_cast<int64_t>(values[i]);
  } else if (dtype != DType::f64) {
    backend_for(kCPU).cast(host, typed);
  }
  return typed.to(device);
}

}  // namespace amp
