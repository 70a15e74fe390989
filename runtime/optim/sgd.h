// torch.optim.SGD: momentum, dampening, nesterov, weight_decay, maximize; PyTorch 2.x's defaults.
#pragma once
#include "runtime/kernels/backend.h"
#include "runtime/optim/optimizer.h"

namespace amp::optim {

struct SgdOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, SgdOptions options) : SGD(one_group(std::move(params), options)) {}
  explicit SGD(const std::vector<ParamGroup<SgdOptions>>& groups);
  const SgdOptions& options(size_t group = 0) const { return options_.at(group); }

 protected:
  void step_group(size_t group, const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                  const Tensor& grad_scale, const NormClip& clip) override;
  nlohmann::json group_hyper(size_t group) const override;
  void load_group_hyper(size_t group, const nlohmann::json& h) override;
  bool step_in_state() const override { return false; }

 private:
  std::vector<SgdOptions> options_;  // per group; lr lives in the base
};

}  // namespace amp::optim
