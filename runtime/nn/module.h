// nn::Module: named parameters and children, named as PyTorch names them ("0.weight", "2.bias").
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/tensor.h"

namespace amp::nn {

using NamedTensor = std::pair<std::string, Tensor>;

class Module {
 public:
  virtual ~Module() = default;
  virtual Tensor forward(const Tensor& x) = 0;
  Tensor operator()(const Tensor& x) { return forward(x); }

  // Parameters of this module and its children, depth first, in registration order.
  std::vector<NamedTensor> named_parameters() const;
  std::vector<Tensor> parameters() const;
  void zero_grad();
  // Moves every parameter to a device (the parameters stay leaves that require grad).
  void to(Device d);

 protected:
  Tensor& register_parameter(std::string name, Tensor t);
  void register_module(std::string name, std::shared_ptr<Module> m);

 private:
  void collect(const std::string& prefix, std::vector<NamedTensor>* out) const;
  std::vector<NamedTensor> params_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

}  // namespace amp::nn
