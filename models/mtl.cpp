#include "models/mtl.h"

#include <stdexcept>
#include <string>

#include "runtime/ops/ops.h"

namespace amp::models {

namespace {

class MultiTaskNet final : public nn::Module {
 public:
  MultiTaskNet(const MtlConfig& c, Generator& gen, Device device) {
    shared = std::make_shared<nn::Sequential>();
    shared->push_back(std::make_shared<nn::Linear>(c.in_features, c.hidden, gen, true, device))
        .push_back(std::make_shared<nn::ReLU>())
        .push_back(std::make_shared<nn::Linear>(c.hidden, c.features, gen, true, device))
        .push_back(std::make_shared<nn::ReLU>());
    register_module("shared", shared);
    for (int64_t t = 0; t < c.tasks; ++t) {
      heads.push_back(std::make_shared<nn::Linear>(c.features, 1, gen, true, device));
      register_module("task" + std::to_string(t + 1), heads.back());
    }
  }
  Tensor forward(const Tensor& x) override { return (*shared)(x); }  // the features

  std::shared_ptr<nn::Sequential> shared;
  std::vector<std::shared_ptr<nn::Linear>> heads;
};

class MtlModel final : public TrainingModel {
 public:
  MtlModel(const MtlConfig& c, Generator& gen, Device device) : net_(c, gen, device) {}
  nn::Module& module() override { return net_; }
  Losses losses(const Batch& b) override {
    if (b.targets.size() != net_.heads.size())
      throw std::invalid_argument("multi-task batch: " + std::to_string(b.targets.size()) + " targets for " +
                                  std::to_string(net_.heads.size()) + " tasks");
    Losses out;
    out.features = net_(b.x);
    for (size_t t = 0; t < net_.heads.size(); ++t) out.per_task.push_back(mse_loss((*net_.heads[t])(out.features), b.targets[t]));
    return out;
  }
  std::vector<Tensor> shared_parameters() const override { return net_.shared->parameters(); }
  std::vector<std::vector<Tensor>> task_parameters() const override {
    std::vector<std::vector<Tensor>> out;
    for (const auto& h : net_.heads) out.push_back(h->parameters());
    return out;
  }

 private:
  MultiTaskNet net_;
};

}  // namespace

std::unique_ptr<TrainingModel> make_mtl_model(const MtlConfig& c, Generator& gen, Device device) {
  if (c.tasks < 1 || c.in_features < 1 || c.hidden < 1 || c.features < 1)
    throw std::invalid_argument("multi-task sizes must be positive");
  return std::make_unique<MtlModel>(c, gen, device);
}

}  // namespace amp::models
