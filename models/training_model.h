// The trainer's view of a model: "a model, its batches and its loss". Every model the trainer can
// train implements it; the trainer's step (autocast, scaler, reducer, clipping, metrics) is written
// once against it, and a new model never edits the step.
#pragma once
#include <memory>
#include <vector>

#include "runtime/nn/module.h"
#include "runtime/core/tensor.h"

namespace amp::models {

// A micro-batch: inputs, and one target tensor per loss.
struct Batch {
  Tensor x;
  std::vector<Tensor> targets;
  int64_t first = 0;  // the stream index of its first sample (dropout's counters follow samples)
  // `first` as an int64 [1] tensor on the batch's device, or undefined: given by the trainer when the
  // step is captured in a CUDA graph and the model reads the index (reads_sample_index), so that a
  // replay's kernels read each step's value.
  Tensor first_index{};
};

// What a forward gives the step: the losses (each the mean over the micro-batch; one for an
// ordinary model, one per task for a multi-task model) and, for a multi-task model trained by
// Jacobian descent, the shared trunk's output that every loss goes through.
struct Losses {
  std::vector<Tensor> per_task;
  Tensor features;  // undefined: an ordinary model
};

class TrainingModel {
 public:
  virtual ~TrainingModel() = default;
  // Parameters and their PyTorch names (state dicts, checkpoints, the reducer).
  virtual nn::Module& module() = 0;
  // The forward and the losses of a micro-batch, under whatever autocast the caller opened.
  virtual Losses losses(const Batch& batch) = 0;
  // Multi-task models: the parameters behind the features, and each task's own (Jacobian descent
  // aggregates the first, and gives the others ordinary gradients).
  virtual std::vector<Tensor> shared_parameters() const { return {}; }
  virtual std::vector<std::vector<Tensor>> task_parameters() const { return {}; }
  // Training mode (dropout on) or evaluation mode (off).
  virtual void train(bool /*on*/) {}
  // Parameters that take weight decay, and the others (PyTorch parameter groups); empty first: all decay.
  virtual std::vector<Tensor> decayed_parameters() const { return {}; }
  // Whether losses() reads Batch::first (dropout's counters follow the samples): a captured step then
  // gets it as Batch::first_index.
  virtual bool reads_sample_index() const { return false; }
};

}  // namespace amp::models
