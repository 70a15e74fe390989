// Text from a GPT: tokens (bytes, for text) continuing a prompt, each drawn from the softmax of the last position's
// logits divided by the temperature, among the top_k most likely (nanoGPT's sample.py), with the
// context cropped to the last block_size bytes. The draws come from the counter-based generator:
// draw n uses counter n of seed's stream, so a seed gives the same text on any device.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/gpt.h"

namespace amp::models {

struct SampleOptions {
  int64_t tokens = 100;
  double temperature = 0.8;
  int64_t top_k = 200;
  uint64_t seed = 0;
  std::function<bool()> stop;  // checked before each token: true ends the sample there (none: never)
};

// Runs the model in evaluation mode without autograd, under whatever autocast the caller opened;
// restores training mode. Returns the tokens drawn after the prompt's (at least one token).
std::vector<int64_t> sample_tokens(GptModel& model, std::vector<int64_t> prompt, const SampleOptions& options);
// The same on bytes (a model of text): an empty prompt starts from a newline.
std::string sample(GptModel& model, const std::string& prompt, const SampleOptions& options);

}  // namespace amp::models
