#include "models/gpt.h"

#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "runtime/nn/layers.h"
#include "runtime/ops/ops.h"
#include "runtime/kernels/rng_math.h"

namespace amp::models {

namespace {

// Dropout whose counters follow the samples: site s of sample j (its index in the data stream)
// draws counters [j P, (j + 1) P) of the site's own seed, P the site's elements per sample. So the
// same sample drops the same elements on any rank count, micro-batch split and device.
struct DropoutState {
  double p = 0.0;
  bool training = true;
  uint64_t seed = 0;
  int64_t first = 0;  // stream index of the batch's first sample
  Tensor first_index;  // the same as a device int64 [1], when the batch has it (Batch::first_index)
  int64_t batch = 1;   // samples in the batch
  double rate() const { return training ? p : 0.0; }
  uint64_t site_seed(uint64_t site) const { return math::mix64(seed ^ math::mix64(site + 1)); }
  // The first counter of the batch at a site with per_sample elements a sample: first * per_sample,
  // from the host's value, or from the device's, read by the kernel (the same counters).
  uint64_t offset(int64_t per_sample) const {
    return first_index.defined() ? 0 : static_cast<uint64_t>(first) * static_cast<uint64_t>(per_sample);
  }
  uint64_t per_base(int64_t per_sample) const { return first_index.defined() ? static_cast<uint64_t>(per_sample) : 0; }
  // The counters of the batch's draw at a site with per_sample elements a sample.
  RandomCounters counters(uint64_t site, int64_t per_sample) const {
    return {site_seed(site), offset(per_sample), first_index, per_base(per_sample)};
  }
  Tensor apply(const Tensor& x, uint64_t site) const {
    if (rate() == 0.0) return x;
    return dropout(x, p, counters(site, x.numel() / batch));
  }
};

class CausalSelfAttention final : public nn::Module {
 public:
  CausalSelfAttention(const GptConfig& c, Generator& gen, Device device, const DropoutState* drop, uint64_t site)
      : n_head_(c.n_head), kernels_(c.attention), drop_(drop), site_(site) {
    c_attn = std::make_shared<nn::Linear>(c.n_embd, 3 * c.n_embd, gen, true, device);
    c_proj = std::make_shared<nn::Linear>(c.n_embd, c.n_embd, gen, true, device);
    register_module("c_attn", c_attn);
    register_module("c_proj", c_proj);
  }
  Tensor forward(const Tensor& x) override {
    // The attention weights, [H, T, T] a sample, drop by the site's counters as apply() would draw them.
    const int64_t T = x.size(1);
    const Tensor y = causal_attention(
        (*c_attn)(x), n_head_,
        {.dropout_p = drop_->rate(), .dropout = drop_->counters(site_, n_head_ * T * T), .kernels = kernels_});
    return drop_->apply((*c_proj)(y), site_ + 1);
  }
  std::shared_ptr<nn::Linear> c_attn, c_proj;

 private:
  int64_t n_head_;
  AttentionKernels kernels_;
  const DropoutState* drop_;
  uint64_t site_;
};

class Mlp final : public nn::Module {
 public:
  Mlp(const GptConfig& c, Generator& gen, Device device, const DropoutState* drop, uint64_t site)
      : gelu_tanh_(c.gelu_tanh), drop_(drop), site_(site) {
    c_fc = std::make_shared<nn::Linear>(c.n_embd, 4 * c.n_embd, gen, true, device);
    c_proj = std::make_shared<nn::Linear>(4 * c.n_embd, c.n_embd, gen, true, device);
    register_module("c_fc", c_fc);
    register_module("c_proj", c_proj);
  }
  // GPT-2's tanh GELU as one op whose GELU the GEMMs apply (cuBLASLt's epilogues on a GPU);
  // nanoGPT's erf GELU as its three ops.
  Tensor forward(const Tensor& x) override {
    const Tensor y = gelu_tanh_ ? mlp_gelu_tanh(x, c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias)
                                : (*c_proj)(gelu((*c_fc)(x), false));
    return drop_->apply(y, site_);
  }
  std::shared_ptr<nn::Linear> c_fc, c_proj;

 private:
  bool gelu_tanh_;
  const DropoutState* drop_;
  uint64_t site_;
};

class Block final : public nn::Module {
 public:
  Block(const GptConfig& c, Generator& gen, Device device, const DropoutState* drop, uint64_t site) {
    ln_1 = std::make_shared<nn::LayerNorm>(c.n_embd, 1e-5, device);
    attn = std::make_shared<CausalSelfAttention>(c, gen, device, drop, site);
    ln_2 = std::make_shared<nn::LayerNorm>(c.n_embd, 1e-5, device);
    mlp = std::make_shared<Mlp>(c, gen, device, drop, site + 2);
    register_module("ln_1", ln_1);
    register_module("attn", attn);
    register_module("ln_2", ln_2);
    register_module("mlp", mlp);
  }
  // Each LayerNorm writes its output in the dtype of the linear layer it feeds (autocast's cast in
  // its pass), and each residual add and the LayerNorm after it make one pass.
  Tensor forward(const Tensor& x) override {
    const auto [h, normed_2] = attend(x, ln_1->into_linear(x, attn->c_attn->weight));
    return add(h, (*mlp)(normed_2));
  }
  // forward, with the last residual add and the LayerNorm after the block (`next`: the next block's
  // ln_1, or ln_f) in one pass: x the stream and normed ln_1's output of it; returns the stream after
  // the block and next's output of it (written for the linear of weight next_weight).
  std::pair<Tensor, Tensor> forward_stream(const Tensor& x, const Tensor& normed, const nn::LayerNorm& next,
                                           const Tensor& next_weight) {
    const auto [h, normed_2] = attend(x, normed);
    return next.add_into_linear(h, (*mlp)(normed_2), next_weight);
  }
  std::shared_ptr<nn::LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<Mlp> mlp;

 private:
  // The stream after the attention's residual add, and ln_2's output of it.
  std::pair<Tensor, Tensor> attend(const Tensor& x, const Tensor& normed) {
    return ln_2->add_into_linear(x, (*attn)(normed), mlp->c_fc->weight);
  }
};

// A container named as torch.nn.ModuleDict / ModuleList children are: its forward is unused.
class Container final : public nn::Module {
 public:
  using nn::Module::register_module;
  Tensor forward(const Tensor&) override { throw std::logic_error("a module container has no forward"); }
};

class Gpt final : public GptModel, public nn::Module {
 public:
  Gpt(const GptConfig& c, Generator& gen, Device device) : config_(c) {
    drop_.p = c.dropout;
    drop_.seed = gen.seed();
    auto transformer = std::make_shared<Container>();
    wte_ = std::make_shared<nn::Embedding>(c.vocab_size, c.n_embd, gen, device, c.padded_vocab());
    wpe_ = std::make_shared<nn::Embedding>(c.block_size, c.n_embd, gen, device);
    transformer->register_module("wte", wte_);
    transformer->register_module("wpe", wpe_);
    auto h = std::make_shared<Container>();
    for (int64_t i = 0; i < c.n_layer; ++i) {
      blocks_.push_back(std::make_shared<Block>(c, gen, device, &drop_, static_cast<uint64_t>(1 + 3 * i)));
      h->register_module(std::to_string(i), blocks_.back());
    }
    transformer->register_module("h", h);
    ln_f_ = std::make_shared<nn::LayerNorm>(c.n_embd, 1e-5, device);
    transformer->register_module("ln_f", ln_f_);
    register_module("transformer", transformer);
    // nanoGPT's _init_weights, then its scaled init of the residual projections.
    const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
    for (auto& [name, p] : named_parameters()) {
      Tensor t = p;
      const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
      const bool is_ln = name.find(".ln_") != std::string::npos;
      if (is_ln) continue;  // ones and zeros
      if (t.same(wte_->weight)) t = t.view(0, {c.vocab_size, c.n_embd});  // the padding rows stay zero
      if (is_bias) fill_(t, 0.0);
      else normal_(t, 0.0, name.find("c_proj.weight") != std::string::npos ? proj_std : 0.02, gen);
    }
  }

  nn::Module& module() override { return *this; }
  const GptConfig& config() const override { return config_; }
  void train(bool on) override { drop_.training = on; }
  bool reads_sample_index() const override { return drop_.p > 0.0; }
  std::vector<std::pair<std::string, std::string>> tied_aliases() const override {
    return {{"lm_head.weight", "transformer.wte.weight"}};
  }
  std::vector<std::pair<std::string, int64_t>> saved_rows() const override {
    if (config_.padded_vocab() == config_.vocab_size) return {};
    return {{"transformer.wte.weight", config_.vocab_size}};
  }

  Tensor forward(const Tensor& tokens) override { return logits(tokens); }

  Tensor logits(const Tensor& tokens) override {
    if (tokens.dim() != 2 || tokens.dtype() != DType::i64)
      throw std::invalid_argument("gpt: expected int64 tokens [B, T], got " + shape_str(tokens.shape()));
    const int64_t B = tokens.size(0), T = tokens.size(1);
    if (T > config_.block_size)
      throw std::invalid_argument("gpt: sequence of length " + std::to_string(T) + " exceeds block_size " +
                                  std::to_string(config_.block_size));
    drop_.batch = B;
    Tensor x = add((*wte_)(tokens), (*wpe_)(positions(T)));  // [B, T, C] + [T, C]
    x = drop_.apply(x, 0);
    // The blocks' forward, each residual add with the next LayerNorm (the next block's ln_1, or ln_f)
    // in one pass.
    Tensor normed = blocks_.empty() ? ln_f_->into_linear(x, wte_->weight)
                                    : blocks_[0]->ln_1->into_linear(x, blocks_[0]->attn->c_attn->weight);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      const bool last = i + 1 == blocks_.size();
      std::tie(x, normed) = blocks_[i]->forward_stream(x, normed, last ? *ln_f_ : *blocks_[i + 1]->ln_1,
                                                       last ? wte_->weight : blocks_[i + 1]->attn->c_attn->weight);
    }
    return linear(normed, wte_->weight, Tensor());  // lm_head, tied to wte
  }

  Losses losses(const Batch& batch) override {
    if (batch.targets.size() != 1) throw std::invalid_argument("gpt: a batch has one target (the next tokens)");
    drop_.first = batch.first;
    drop_.first_index = batch.first_index;
    const Tensor lg = logits(batch.x);
    const int64_t n = lg.size(0) * lg.size(1);
    Losses out;
    // The classifier's loss fused: the logits stay in autocast's dtype (no fp32 copy of [B T, V]),
    // and the padding's columns are in neither the softmax nor the loss.
    out.per_task.push_back(fused_cross_entropy(lg.reshape({n, lg.size(2)}), batch.targets[0].reshape({n}),
                                               config_.vocab_size));
    return out;
  }

  // nanoGPT's groups: weight decay on every tensor of 2 or more dims (embeddings included), none
  // on biases and LayerNorm.
  std::vector<Tensor> decayed_parameters() const override {
    std::vector<Tensor> out;
    for (const Tensor& p : parameters())
      if (p.dim() >= 2) out.push_back(p);
    return out;
  }

 private:
  // 0 .. T-1 on the parameters' device, made once per length (not copied there at every forward).
  const Tensor& positions(int64_t T) {
    Tensor& p = positions_[T];
    const Device device = wte_->weight.device();
    if (!p.defined() || p.device() != device) {
      std::vector<int64_t> pos(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = t;
      p = from_int64(pos, {T}, device);
    }
    return p;
  }

  GptConfig config_;
  std::map<int64_t, Tensor> positions_;
  DropoutState drop_;
  std::shared_ptr<nn::Embedding> wte_, wpe_;
  std::vector<std::shared_ptr<Block>> blocks_;
  std::shared_ptr<nn::LayerNorm> ln_f_;
};

}  // namespace

std::unique_ptr<GptModel> make_gpt_model(const GptConfig& c, Generator& gen, Device device) {
  auto positive = [](int64_t v, const char* what) {
    if (v < 1) throw std::invalid_argument(std::string("gpt: ") + what + " must be >= 1, got " + std::to_string(v));
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.block_size, "block_size");
  positive(c.n_layer, "n_layer");
  positive(c.n_head, "n_head");
  positive(c.n_embd, "n_embd");
  if (c.n_embd % c.n_head != 0)
    throw std::invalid_argument("gpt: n_embd " + std::to_string(c.n_embd) + " is not divisible by n_head " +
                                std::to_string(c.n_head));
  if (!(c.dropout >= 0.0 && c.dropout < 1.0))
    throw std::invalid_argument("gpt: dropout must be in [0, 1), got " + std::to_string(c.dropout));
  return std::make_unique<Gpt>(c, gen, device);
}

}  // namespace amp::models
