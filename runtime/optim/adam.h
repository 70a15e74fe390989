// torch.optim.Adam and AdamW: betas, eps, weight_decay (L2 or decoupled), amsgrad.
#pragma once
#include "runtime/backend.h"
#include "runtime/optim/optimizer.h"

namespace amp::optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
};

class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, AdamOptions options, bool decoupled_weight_decay = false);
  const AdamOptions& options() const { return options_; }

 protected:
  void step_group(const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                  const Tensor& grad_scale) override;

 private:
  AdamOptions options_;
  bool decoupled_;
};

// AdamW: decoupled weight decay. PyTorch's default weight_decay for AdamW is 1e-2.
class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> params, AdamOptions options) : Adam(std::move(params), options, true) {}
};

}  // namespace amp::optim
