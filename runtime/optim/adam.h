// torch.optim.Adam and AdamW: betas, eps, weight_decay (L2 or decoupled), amsgrad, maximize.
#pragma once
#include "runtime/kernels/backend.h"
#include "runtime/optim/optimizer.h"

namespace amp::optim {

struct AdamWOptions;

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
  operator AdamWOptions() const;  // the same fields (weight_decay as given: 0 by default)
};

// AdamW's options: the same fields, with PyTorch's AdamW default weight_decay of 1e-2. An aggregate
// of its own (no base, no constructor), so that AdamW(params, {.lr = 1e-3}) builds this, not an
// AdamOptions whose weight decay would be 0.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
  operator AdamOptions() const { return {lr, beta1, beta2, eps, weight_decay, amsgrad, maximize}; }
};

inline AdamOptions::operator AdamWOptions() const { return {lr, beta1, beta2, eps, weight_decay, amsgrad, maximize}; }

class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, AdamOptions options) : Adam(one_group(std::move(params), options)) {}
  explicit Adam(const std::vector<ParamGroup<AdamOptions>>& groups, bool decoupled_weight_decay = false);
  const AdamOptions& options(size_t group = 0) const { return options_.at(group); }

 protected:
  void step_group(size_t group, const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                  const Tensor& grad_scale, const NormClip& clip) override;
  nlohmann::json group_hyper(size_t group) const override;
  void load_group_hyper(size_t group, const nlohmann::json& h) override;

 private:
  std::vector<AdamOptions> options_;  // per group; lr lives in the base
  bool decoupled_;
};

// AdamW: decoupled weight decay (p *= 1 - lr * weight_decay before the Adam update).
class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> params, AdamWOptions options = {})
      : Adam(one_group(std::move(params), static_cast<AdamOptions>(options)), true) {}
  // Groups as PyTorch's param_groups: a group given no options gets AdamW's own (weight decay 1e-2).
  explicit AdamW(const std::vector<ParamGroup<AdamWOptions>>& groups) : Adam(as_adam(groups), true) {}

 private:
  static std::vector<ParamGroup<AdamOptions>> as_adam(const std::vector<ParamGroup<AdamWOptions>>& groups) {
    std::vector<ParamGroup<AdamOptions>> out;
    for (const auto& g : groups) out.push_back({g.params, g.options});
    return out;
  }
};

}  // namespace amp::optim
