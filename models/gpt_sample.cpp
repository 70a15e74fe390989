#include "models/gpt_sample.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>
#include <vector>

#include "runtime/ops/autograd.h"
#include "runtime/kernels/rng_math.h"

namespace amp::models {

std::vector<int64_t> sample_tokens(GptModel& model, std::vector<int64_t> context, const SampleOptions& o) {
  if (context.empty()) throw std::invalid_argument("sample_tokens: the prompt has no token");
  model.train(false);
  NoGradGuard no_grad;
  const Device device = model.module().parameters().at(0).device();
  std::vector<int64_t> out;
  for (int64_t n = 0; n < o.tokens && !(o.stop && o.stop()); ++n) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(context.size()), model.config().block_size);
    const std::vector<int64_t> window(context.end() - T, context.end());
    const Tensor logits = model.logits(from_int64(window, {1, T}, device));
    const int64_t V = model.config().vocab_size;  // the padding's columns past it are never drawn
    const std::vector<double> last = logits.view((T - 1) * logits.size(2), {V}).to_vector();
    // Top-k of logits / temperature (ties to the lower byte), then a draw from their softmax. The
    // logits less their largest, divided: a tiny temperature gives -inf (drawn never) and 0, where
    // logit / temperature overflowed to inf and the softmax to NaN (1e-310 drew garbage).
    const double top = *std::max_element(last.begin(), last.end());
    std::vector<std::pair<double, int64_t>> ranked;
    for (int64_t v = 0; v < V; ++v) ranked.emplace_back((last[static_cast<size_t>(v)] - top) / o.temperature, v);
    const size_t k = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(o.top_k, 1)), ranked.size());
    std::partial_sort(ranked.begin(), ranked.begin() + static_cast<std::ptrdiff_t>(k), ranked.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    double total = 0.0;
    for (size_t i = 0; i < k; ++i) total += std::exp(ranked[i].first - ranked[0].first);
    double u = math::uniform01(o.seed, static_cast<uint64_t>(n)) * total;
    int64_t next = ranked[k - 1].second;
    for (size_t i = 0; i < k; ++i) {
      u -= std::exp(ranked[i].first - ranked[0].first);
      if (u < 0) {
        next = ranked[i].second;
        break;
      }
    }
    context.push_back(next);
    out.push_back(next);
  }
  model.train(true);
  return out;
}

std::string sample(GptModel& model, const std::string& prompt, const SampleOptions& o) {
  std::vector<int64_t> context;
  for (unsigned char ch : prompt) context.push_back(ch);
  if (context.empty()) context.push_back('\n');
  std::string out;
  for (int64_t t : sample_tokens(model, std::move(context), o)) out.push_back(static_cast<char>(t));
  return out;
}

}  // namespace amp::models
