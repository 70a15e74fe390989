// Optimizer base: parameters, zero_grad, a device-resident step count, and a fused step that takes
// an optional device-resident found_inf flag (GradScaler's skip, without a host sync).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace amp::optim {

class Optimizer {
 public:
  explicit Optimizer(std::vector<Tensor> params);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Updates every parameter that has a gradient. A defined, nonzero found_inf (1-element f32 on the
  // parameters' device) makes the step leave parameters and all state untouched. A defined
  // grad_scale means the gradients are still multiplied by it: the fused step unscales them in the
  // same pass and writes them back (GradScaler::step uses this when unscale_ was not called).
  virtual void step(const Tensor& found_inf = Tensor(), const Tensor& grad_scale = Tensor()) = 0;
  // set_to_none=true drops the gradients (PyTorch 2's default); false zeroes them in place.
  void zero_grad(bool set_to_none = true);

  const std::vector<Tensor>& params() const { return params_; }
  std::vector<Tensor> grads() const;  // the defined gradients, in parameter order
  int64_t step_count() const;        // reads the device counter
  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }

  // State tensors by name: "step", and per parameter i "<buffer>.<i>". Loading checks names and shapes.
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, Tensor>& state);

 protected:
  // Buffers a subclass registers for each parameter (momentum, Adam moments), zero-initialised.
  std::vector<Tensor>& add_state(const std::string& name);
  void params_with_grad(std::vector<Tensor>* params, std::vector<Tensor>* grads,
                        const std::vector<Tensor>* state, std::vector<std::vector<Tensor>>* state_out) const;

  std::vector<Tensor> params_;
  Tensor step_count_;  // 1-element f32 on the parameters' device
  double lr_ = 0.0;
  std::map<std::string, std::vector<Tensor>> state_;
};

}  // namespace amp::optim
