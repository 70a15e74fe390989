// nn::Module: named parameters and children, named as PyTorch names them ("0.weight", "2.bias").
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/core/tensor.h"

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
  // Converts every parameter to a floating dtype (the same tensors, as to(Device) keeps them).
  void to(DType dtype);
  // Names a state dict may hold for a parameter stored under another name (a tied weight: GPT's
  // lm_head.weight is transformer.wte.weight): {alias, parameter}. Loading accepts the alias only
  // when it equals the parameter's tensor.
  virtual std::vector<std::pair<std::string, std::string>> tied_aliases() const { return {}; }
  // Parameters trained with more rows than they are saved with (GPT's vocabulary padded to a multiple
  // of 128 for the classifier's GEMMs): {name, rows saved}. The rows past those are padding, zero
  // from the start and kept zero by training (no token reads them, no loss sees them): state_dict
  // gives the saved rows, load_state_dict takes them and zeroes the rest.
  virtual std::vector<std::pair<std::string, int64_t>> saved_rows() const { return {}; }

 protected:
  Tensor& register_parameter(std::string name, Tensor t);
  void register_module(std::string name, std::shared_ptr<Module> m);

 private:
  // Gives every parameter for which changes() holds the storage of convert(parameter).
  void replace_parameters(const std::function<bool(const Tensor&)>& changes,
                          const std::function<Tensor(const Tensor&)>& convert);
  void collect(const std::string& prefix, std::vector<NamedTensor>* out) const;
  std::vector<NamedTensor> params_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

}  // namespace amp::nn
