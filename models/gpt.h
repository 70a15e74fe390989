// GPT-2 as nanoGPT writes it, with its parameter names and layouts, so that a PyTorch user can load
// our weights and we theirs:
//   transformer.wte.weight [V, C] (trained with V rounded up to a multiple of 128: padded_vocab()),
//   transformer.wpe.weight [T, C],
//   transformer.h.<i>.ln_1.{weight,bias}, .attn.c_attn.{weight [3C, C],bias}, .attn.c_proj.{weight [C, C],bias},
//   transformer.h.<i>.ln_2.{weight,bias}, .mlp.c_fc.{weight [4C, C],bias}, .mlp.c_proj.{weight [C, 4C],bias},
//   transformer.ln_f.{weight,bias}.
// lm_head is tied to wte and not stored. LayerNorm eps 1e-5, exact GELU, dropout after the
// embeddings, on the attention weights, and after each residual branch. nanoGPT's initialisation:
// N(0, 0.02) for weights and embeddings, zero biases, N(0, 0.02 / sqrt(2 n_layer)) for c_proj.
#pragma once
#include <memory>

#include "models/training_model.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"

namespace amp::models {

struct GptConfig {
  int64_t vocab_size = 256;  // bytes
  int64_t block_size = 64;
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  double dropout = 0.0;
  AttentionKernels attention = AttentionKernels::automatic;  // --attention (runtime/ops/ops.h)
  // The MLP's GELU: erf (nanoGPT's, PyTorch's F.gelu; the default), or the tanh form (--gelu tanh:
  // GPT-2's own, Hugging Face's gelu_new), which GPT-2's published weights were trained with.
  bool gelu_tanh = false;
  // The classifier's rows: vocab_size rounded up to a multiple of 128 (GPT-2's 50257 -> 50304, as
  // llm.c), so that its GEMMs run on aligned tiles. The rows past vocab_size are padding: zero, never
  // read by a token, their logits in no loss and never sampled, and not saved (Module::saved_rows).
  int64_t padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
};

// A language model: its batches are x (int64 tokens [B, T]) and one target [B, T] (the next tokens).
class GptModel : public TrainingModel {
 public:
  // Logits [B, T, padded_vocab()] of tokens [B, T] (T <= block_size), in the current autocast and
  // mode; the columns past vocab_size are the padding's (not a token's).
  virtual Tensor logits(const Tensor& tokens) = 0;
  virtual const GptConfig& config() const = 0;
};

// Throws std::invalid_argument for sizes that do not make a model (n_embd not divisible by n_head...).
std::unique_ptr<GptModel> make_gpt_model(const GptConfig& config, Generator& gen, Device device = kCPU);

}  // namespace amp::models
