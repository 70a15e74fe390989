// Optimizer base: parameter groups (each with its own hyperparameters, as torch.optim's
// param_groups), zero_grad, device-resident step counts, a fused step that takes an optional
// device-resident found_inf flag (GradScaler's skip, without a host sync), and a state_dict laid out
// as PyTorch's: {"state": {id: {name: tensor}}, "param_groups": [{..., "params": [ids]}]}.
//
// PyTorch keeps a step count per parameter, created the first time the parameter has a gradient.
// Here parameters of one group with the same step history share one device counter (a cohort), so
// the usual case is one counter and one fused launch per group and step; a step that updates only
// some members of a cohort splits it, on the device and without a host sync. A parameter that
// first gets a gradient late therefore starts from step 0 (momentum buffer = its first gradient,
// Adam's bias corrections from t = 1), exactly as in PyTorch.
#pragma once
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/core/tensor.h"
#include "runtime/kernels/backend.h"

namespace amp::optim {

// One group of parameters and its hyperparameters (Options: SgdOptions, AdamOptions, ...).
template <class Options>
struct ParamGroup {
  std::vector<Tensor> params;
  Options options;
};

// torch.optim.Optimizer.state_dict(): parameters are numbered across groups, in order; a parameter
// has state once it has been stepped. param_groups holds each group's hyperparameters under
// PyTorch's keys, and "params".
struct OptimizerStateDict {
  std::map<int64_t, std::map<std::string, Tensor>> state;
  nlohmann::json param_groups = nlohmann::json::array();
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Updates every parameter that has a gradient. A defined, nonzero found_inf (1-element f32 on the
  // parameters' device) makes the step leave parameters and all state untouched. A defined
  // grad_scale means the gradients are still multiplied by it: the fused step unscales them in the
  // same pass and writes them back (GradScaler::step uses this when unscale_ was not called), unless
  // set_keep_unscaled_grads(false). A defined clip.total_norm clips every gradient by that norm in the
  // same pass (clip_grads_with_norm_'s numbers, without its pass over the gradients; written back
  // likewise).
  void step(const Tensor& found_inf = Tensor(), const Tensor& grad_scale = Tensor(), const NormClip& clip = NormClip());
  // false: a step given grad_scale or a clip does not write the gradients it read back (they stay scaled): for
  // a loop that reads no gradient after the step, one write of every gradient less. Default true.
  void set_keep_unscaled_grads(bool keep) { keep_unscaled_grads_ = keep; }
  bool keep_unscaled_grads() const { return keep_unscaled_grads_; }
  // set_to_none=true drops the gradients (PyTorch 2's default); false zeroes them in place.
  void zero_grad(bool set_to_none = true);

  const std::vector<Tensor>& params() const { return params_; }  // every group's, in order
  std::vector<Tensor> grads() const;   // the defined gradients, in parameter order
  int64_t step_count(size_t param = 0) const;  // that parameter's steps taken (reads the device)

  size_t num_param_groups() const { return group_lr_.size(); }
  std::vector<Tensor> param_group_params(size_t group) const;
  // The learning rate of a group (group["lr"]); set_lr without a group sets every group's.
  double lr(size_t group = 0) const { return group_lr_.at(group); }
  void set_lr(double lr, size_t group) { group_lr_.at(group) = lr; }
  void set_lr(double lr);
  // The step's kernels read each group's lr from a 1-element f64 tensor on the parameters' device
  // (lr_tensor), not from their arguments, so that a step captured in a CUDA graph takes the lr of
  // the replay, not the capture's. write_lr() writes every group's lr there, with a launch only where
  // it changed since the last write; step() calls it first. So a step captured right after a write
  // records no write, and write_lr() before each replay feeds it the scheduler's lr.
  void write_lr();
  const Tensor& lr_tensor(size_t group) const { return lr_device_.at(group); }
  // group["initial_lr"]: the first scheduler attached sets it; later ones keep it.
  std::optional<double> initial_lr(size_t group) const { return initial_lr_.at(group); }
  void set_initial_lr(size_t group, double lr) { initial_lr_.at(group) = lr; }

  // Keeps a copy of every parameter in dtype (float16 or bfloat16): rounded from the parameter now,
  // and from then on rewritten by every step() in the pass that updates the parameter (apex's master
  // weights: the float32 parameters are the masters). An autocast forward takes them as its casts
  // (amp::autocast_provide_casts) instead of reading every float32 parameter to cast it, every step.
  // The copies hold while the parameters change through step() alone: after changing them otherwise
  // (loading weights), call this again. DType::f32 drops the copies.
  void keep_low_precision_copies(DType dtype);
  // One per parameter, in params() order; empty when none are kept.
  const std::vector<Tensor>& low_precision_copies() const { return copies_; }

  // Bytes of the per-element state (moments, momentum buffers) this optimizer holds.
  size_t state_bytes() const;

  OptimizerStateDict state_dict() const;
  // Checks group sizes, names and shapes; takes the hyperparameters of the saved groups.
  void load_state_dict(const OptimizerStateDict& sd);

 protected:
  // groups: each group's parameters; lrs: each group's learning rate.
  Optimizer(const std::vector<std::vector<Tensor>>& groups, const std::vector<double>& lrs);
  // One fused launch over the parameters `index` (all of one cohort of `group`), whose step count is
  // `steps`.
  virtual void step_group(size_t group, const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                          const Tensor& grad_scale, const NormClip& clip) = 0;
  // A group's hyperparameters under PyTorch's keys, "lr" included; and their loading.
  virtual nlohmann::json group_hyper(size_t group) const = 0;
  virtual void load_group_hyper(size_t group, const nlohmann::json& h) = 0;
  // For load_group_hyper: each key present, or std::invalid_argument naming the first missing one
  // and the group's keys (another optimizer's state dict: Adam's groups have 'betas', SGD's 'momentum').
  static void require_group_keys(const char* optimizer, size_t group, const nlohmann::json& h,
                                 std::initializer_list<const char*> keys);
  // Whether PyTorch keeps "step" in a parameter's state (Adam does; SGD does not).
  virtual bool step_in_state() const { return true; }
  // Buffers a subclass registers for each parameter (momentum, Adam moments), zero-initialised;
  // in_group: the group filter (a buffer only some groups need stays undefined elsewhere).
  std::vector<Tensor>& add_state(const std::string& name, const std::vector<bool>& in_group = {});
  std::vector<Tensor> select(const std::vector<Tensor>& all, const std::vector<size_t>& index) const;
  // The low-precision copies of parameters `index`, for the backend's step (empty when none are kept).
  std::vector<Tensor> copies_of(const std::vector<size_t>& index) const {
    return copies_.empty() ? std::vector<Tensor>() : select(copies_, index);
  }
  size_t group_of(size_t param) const { return group_of_.at(param); }

  std::vector<Tensor> params_;
  std::map<std::string, std::vector<Tensor>> state_;

 private:
  std::vector<size_t> group_of_;      // per parameter
  std::vector<double> group_lr_;      // per group
  std::vector<Tensor> lr_device_;     // per group: its lr as the step reads it (write_lr)
  std::vector<double> lr_written_;    // per group: what lr_device_ holds
  std::vector<std::optional<double>> initial_lr_;  // per group
  std::vector<size_t> cohort_of_;     // per parameter
  std::vector<Tensor> cohort_steps_;  // per cohort: 1-element f32 step count on the device
  std::vector<Tensor> copies_;        // per parameter, or empty: keep_low_precision_copies
  bool keep_unscaled_grads_ = true;
};

// Each group's parameters, and each group's lr, for the base constructor.
template <class Options>
std::vector<std::vector<Tensor>> params_of(const std::vector<ParamGroup<Options>>& groups) {
  std::vector<std::vector<Tensor>> out;
  for (const auto& g : groups) out.push_back(g.params);
  return out;
}
template <class Options>
std::vector<double> lrs_of(const std::vector<ParamGroup<Options>>& groups) {
  std::vector<double> out;
  for (const auto& g : groups) out.push_back(g.options.lr);
  return out;
}

// A flat parameter list as the one group, with options o.
template <class Options>
std::vector<ParamGroup<Options>> one_group(std::vector<Tensor> params, const Options& o) {
  return {ParamGroup<Options>{std::move(params), o}};
}

}  // namespace amp::optim
