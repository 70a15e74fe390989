// The multi-task network of TorchJD's example: a shared trunk Linear(in, hidden) -> ReLU ->
// Linear(hidden, features) -> ReLU, and one Linear(features, 1) head per task, each task's loss
// the MSE of its head against its own target. Parameters are named as a PyTorch state dict of
// modules named shared, task1, task2, ...: shared.0.weight, shared.0.bias, shared.2.weight,
// shared.2.bias, task1.weight, task1.bias, ...
#pragma once
#include <memory>

#include "models/training_model.h"
#include "runtime/nn/layers.h"

namespace amp::models {

struct MtlConfig {
  int64_t tasks = 2;
  int64_t in_features = 10;
  int64_t hidden = 5;
  int64_t features = 3;
};

std::unique_ptr<TrainingModel> make_mtl_model(const MtlConfig& config, Generator& gen, Device device = kCPU);

}  // namespace amp::models
