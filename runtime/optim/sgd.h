// torch.optim.SGD: momentum, dampening, nesterov, weight_decay.
#pragma once
#include "runtime/backend.h"
#include "runtime/optim/optimizer.h"

namespace amp::optim {

struct SgdOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, SgdOptions options);
  const SgdOptions& options() const { return options_; }

 protected:
  void step_group(const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                  const Tensor& grad_scale) override;

 private:
  SgdOptions options_;
};

}  // namespace amp::optim
