// The reference benchmark model (bench_mlp's workload): Linear -> ReLU -> ... -> Linear, as a torch.nn.Sequential, so its
// parameters are named "0.weight", "0.bias", "2.weight", ... like PyTorch's.
#pragma once
#include <memory>

#include "models/training_model.h"
#include "runtime/nn/layers.h"

namespace amp::models {

struct MlpConfig {
  int64_t in_features = 16;
  int64_t width = 16;
  int64_t out_features = 16;
  int64_t layers = 3;  // Linear layers; a ReLU sits between consecutive ones
};

std::shared_ptr<nn::Sequential> make_mlp(const MlpConfig& config, Generator& gen, Device device = kCPU);
// The MLP as a TrainingModel: MSE between its output and the batch's one target.
std::unique_ptr<TrainingModel> make_mlp_model(const MlpConfig& config, Generator& gen, Device device = kCPU);

}  // namespace amp::models
