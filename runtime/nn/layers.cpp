#include "runtime/nn/layers.h"

#include <cmath>

#include "runtime/ops/ops.h"

namespace amp::nn {

Linear::Linear(int64_t in_features, int64_t out_features, Generator& gen, bool with_bias, Device device) {
  // kaiming_uniform_(a=sqrt(5)) reduces to this bound, and the bias uses the same one.
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  weight = register_parameter("weight", rand_uniform({out_features, in_features}, -bound, bound, gen, DType::f32, device));
  if (with_bias) bias = register_parameter("bias", rand_uniform({out_features}, -bound, bound, gen, DType::f32, device));
}

Tensor Linear::forward(const Tensor& x) { return linear(x, weight, bias); }

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Generator& gen, Device device, int64_t rows) {
  if (rows <= num_embeddings) {
    weight = register_parameter("weight", randn({num_embeddings, dim}, gen, DType::f32, device));
    return;
  }
  Tensor w = zeros({rows, dim}, DType::f32, device);
  Tensor drawn = w.view(0, {num_embeddings, dim});
  normal_(drawn, 0.0, 1.0, gen);
  weight = register_parameter("weight", w);
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(weight, indices); }

LayerNorm::LayerNorm(int64_t dim, double eps, Device device) : eps_(eps) {
  weight = register_parameter("weight", ones({dim}, DType::f32, device));
  bias = register_parameter("bias", zeros({dim}, DType::f32, device));
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, weight, bias, eps_); }
Tensor LayerNorm::into_linear(const Tensor& x, const Tensor& linear_weight) const {
  return layer_norm_into_linear(x, weight, bias, eps_, linear_weight);
}

std::pair<Tensor, Tensor> LayerNorm::add_into_linear(const Tensor& x, const Tensor& branch,
                                                    const Tensor& linear_weight) const {
  return add_layer_norm_into_linear(x, branch, weight, bias, eps_, linear_weight);
}

Tensor ReLU::forward(const Tensor& x) { return relu(x); }

Tensor GELU::forward(const Tensor& x) { return gelu(x, tanh_); }

Sequential& Sequential::push_back(std::shared_ptr<Module> m) {
  register_module(std::to_string(layers_.size()), m);
  layers_.push_back(std::move(m));
  return *this;
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& layer : layers_) h = layer->forward(h);
  return h;
}

}  // namespace amp::nn
