// torch.optim.SGD: momentum, dampening, nesterov, weight_decay.
#pragma once
#include "runtime/backend.h"
#include "runtime/optim/optimizer.h"

namespace amp::optim {

struct SgdOptions {
  float lr = 0.01f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, SgdOptions options);
  void step(const Tensor& found_inf = Tensor(), const Tensor& grad_scale = Tensor()) override;
  const SgdOptions& options() const { return options_; }

 private:
  SgdOptions options_;
};

}  // namespace amp::optim
