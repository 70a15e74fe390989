// Hugging Face's GPT-2 weights in and out of ours (nanoGPT's names and layouts: models/gpt.h).
//
// Theirs, as the hub's `gpt2` (GPT2Model) and save_pretrained of GPT2LMHeadModel write them:
//   wte.weight [V, C], wpe.weight [T, C], h.N.ln_1.{weight,bias}, h.N.attn.c_attn.{weight [C, 3C],bias},
//   h.N.attn.c_proj.{weight [C, C],bias}, h.N.ln_2.{weight,bias}, h.N.mlp.c_fc.{weight [C, 4C],bias},
//   h.N.mlp.c_proj.{weight [4C, C],bias}, ln_f.{weight,bias}
// with or without the prefix "transformer."; the four matrices are Conv1D's, [in, out]: the
// transposes of our Linear's [out, in]. h.N.attn.bias and h.N.attn.masked_bias (older files: the
// causal mask, buffers) are ignored; lm_head.weight, where present, is tied to wte.weight and must
// equal it. GPT-2's GELU is the tanh form (Hugging Face's gelu_new): --gelu tanh computes what it
// computes.
#pragma once
#include <cstdint>
#include <string>

#include "runtime/core/safetensors.h"

namespace amp::models {

// Whether tensors are in Hugging Face's layout: a block's c_attn.weight (with or without the
// prefix) is [C, 3C], where ours is [3C, C].
bool is_hf_gpt2(const safetensors::NamedTensors& tensors);
// The sizes a file is checked against (the run's flags; vocab: the vocabulary as saved, unpadded).
struct Gpt2Dims {
  int64_t n_layer = 0, n_embd = 0, block_size = 0, vocab = 0;
};
// Ours from theirs. Each tensor is checked in the file's own terms first: a name GPT-2 of these dims
// does not have, a shape other than its layout's, a tensor missing: the message names the tensor as
// the file does, and both shapes in Hugging Face's layout (source names the file).
safetensors::NamedTensors gpt2_from_hf(const safetensors::NamedTensors& theirs, const std::string& source,
                                       const Gpt2Dims& dims);
// Theirs from ours, in the hub's layout: no prefix, no lm_head, no buffers, sorted by name (the
// order the safetensors library writes tensors of one dtype in).
safetensors::NamedTensors gpt2_to_hf(const safetensors::NamedTensors& ours);

}  // namespace amp::models
