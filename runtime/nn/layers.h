// Layers with PyTorch's names and layouts: Linear, Embedding, LayerNorm, ReLU, GELU and Sequential.
#pragma once
#include <memory>
#include <utility>

#include "runtime/nn/module.h"
#include "runtime/ops/random.h"

namespace amp::nn {

// y = x W^T + b, W is [out, in]. Initialised as PyTorch does: U(-1/sqrt(in), 1/sqrt(in)) for both.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, Generator& gen, bool bias = true, Device device = kCPU);
  Tensor forward(const Tensor& x) override;
  Tensor weight;
  Tensor bias;
};

// Rows of weight [num_embeddings, dim] picked by int64 indices. PyTorch's init: N(0, 1).
class Embedding : public Module {
 public:
  // N(0, 1) rows, as PyTorch's. rows > num_embeddings: the weight has `rows` rows, those past
  // num_embeddings zero padding (the draws are the first num_embeddings rows' only).
  Embedding(int64_t num_embeddings, int64_t dim, Generator& gen, Device device = kCPU, int64_t rows = 0);
  Tensor forward(const Tensor& indices) override;
  Tensor weight;
};

// LayerNorm over the last dim: weight ones, bias zeros, eps 1e-5 (PyTorch's defaults).
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, Device device = kCPU);
  Tensor forward(const Tensor& x) override;
  // forward, for a linear layer of weight linear_weight that reads the output: written in the dtype
  // autocast casts that layer's input to, in the same pass (layer_norm_into_linear).
  Tensor into_linear(const Tensor& x, const Tensor& linear_weight) const;
  // A residual add and this norm of the sum: {x + branch, into_linear(x + branch, linear_weight)}, in one
  // pass where the backend has one (add_layer_norm_into_linear).
  std::pair<Tensor, Tensor> add_into_linear(const Tensor& x, const Tensor& branch, const Tensor& linear_weight) const;
  Tensor weight;
  Tensor bias;

 private:
  double eps_;
};

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

class GELU : public Module {
 public:
  explicit GELU(bool tanh_approximation = false) : tanh_(tanh_approximation) {}
  Tensor forward(const Tensor& x) override;

 private:
  bool tanh_;
};

// Children are named "0", "1", ... as torch.nn.Sequential names them.
class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential& push_back(std::shared_ptr<Module> m);
  Tensor forward(const Tensor& x) override;
  size_t size() const { return layers_.size(); }
  Module& operator[](size_t i) { return *layers_.at(i); }

 private:
  std::vector<std::shared_ptr<Module>> layers_;
};

}  // namespace amp::nn
