#include "models/mlp.h"

#include <stdexcept>

#include "runtime/ops/ops.h"

namespace amp::models {

std::shared_ptr<nn::Sequential> make_mlp(const MlpConfig& c, Generator& gen, Device device) {
  if (c.layers < 1) throw std::invalid_argument("an MLP needs at least one layer, got " + std::to_string(c.layers));
  if (c.width < 1 || c.in_features < 1 || c.out_features < 1)
    throw std::invalid_argument("MLP sizes must be positive");
  auto seq = std::make_shared<nn::Sequential>();
  for (int64_t i = 0; i < c.layers; ++i) {
    const int64_t in = i == 0 ? c.in_features : c.width;
    const int64_t out = i == c.layers - 1 ? c.out_features : c.width;
    seq->push_back(std::make_shared<nn::Linear>(in, out, gen, true, device));
    if (i != c.layers - 1) seq->push_back(std::make_shared<nn::ReLU>());
  }
  return seq;
}

namespace {
class MlpModel final : public TrainingModel {
 public:
  explicit MlpModel(std::shared_ptr<nn::Sequential> net) : net_(std::move(net)) {}
  nn::Module& module() override { return *net_; }
  Losses losses(const Batch& b) override { return {{mse_loss((*net_)(b.x), b.targets.at(0))}, Tensor()}; }

 private:
  std::shared_ptr<nn::Sequential> net_;
};
}  // namespace

std::unique_ptr<TrainingModel> make_mlp_model(const MlpConfig& config, Generator& gen, Device device) {
  return std::make_unique<MlpModel>(make_mlp(config, gen, device));
}

}  // namespace amp::models
