// Optimizer base: parameters, zero_grad, device-resident step counts, and a fused step that takes
// an optional device-resident found_inf flag (GradScaler's skip, without a host sync).
//
// PyTorch keeps a step count per parameter, created the first time the parameter has a gradient.
// Here parameters with the same step history share one device counter (a cohort), so the usual
// case is one counter and one fused launch per step; a step that updates only some members of a
// cohort splits it, on the device and without a host sync. A parameter that first gets a gradient
// late therefore starts from step 0 (momentum buffer = its first gradient, Adam's bias
// corrections from t = 1), exactly as in PyTorch.
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
  void step(const Tensor& found_inf = Tensor(), const Tensor& grad_scale = Tensor());
  // set_to_none=true drops the gradients (PyTorch 2's default); false zeroes them in place.
  void zero_grad(bool set_to_none = true);

  const std::vector<Tensor>& params() const { return params_; }
  std::vector<Tensor> grads() const;   // the defined gradients, in parameter order
  int64_t step_count(size_t param = 0) const;  // that parameter's steps taken (reads the device)
  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }

  // State tensors by name: per parameter i "step.<i>" and "<buffer>.<i>". Loading checks names and
  // shapes.
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, Tensor>& state);

 protected:
  // One fused launch over the parameters `index` (all of one cohort), whose step count is `steps`.
  virtual void step_group(const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                          const Tensor& grad_scale) = 0;
  // Buffers a subclass registers for each parameter (momentum, Adam moments), zero-initialised.
  std::vector<Tensor>& add_state(const std::string& name);
  std::vector<Tensor> select(const std::vector<Tensor>& all, const std::vector<size_t>& index) const;

  std::vector<Tensor> params_;
  double lr_ = 0.0;
  std::map<std::string, std::vector<Tensor>> state_;

 private:
  std::vector<size_t> cohort_of_;     // per parameter
  std::vector<Tensor> cohort_steps_;  // per cohort: 1-element f32 step count on the device
};

}  // namespace amp::optim
