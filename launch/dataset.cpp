#include "launch/dataset.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "models/mlp.h"
#include "runtime/autograd.h"
#include "runtime/backend.h"
#include "runtime/ops.h"
#include "runtime/safetensors.h"

namespace amp::launch {

namespace {

// The synthetic stream is a pool of pool_samples() samples that repeats, like a file: sample j is
// pool sample j mod P. Each chunk of kChunk pool samples is generated the first time a step needs
// it (x from the counter-based normal stream, y by the teacher) and kept, so after the first pass
// over the pool a step pays for no data at all. Chunks depend on the sample index alone, never on
// the batch, rank count or device, so every configuration sees the same samples.
class Synthetic final : public Dataset {
 public:
  static constexpr int64_t kChunk = 256;

  Synthetic(int64_t width, uint64_t seed, Device device) : width_(width), seed_(seed), device_(device) {
    Generator gen(seed ^ 0x7465616368657200ull);  // the teacher's own stream
    teacher_ = models::make_mlp({width, width, width, 2}, gen, device);
    // He-normal weights keep the signal's variance through the ReLU, so targets have unit scale
    // and a falling loss is plain to see.
    const auto params = teacher_->named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor w = params[i].second.detach();
      const bool hidden = i < 2;
      if (w.dim() == 2) normal_(w, 0.0, std::sqrt((hidden ? 2.0 : 1.0) / static_cast<double>(width)), gen);
    }
    chunks_.resize(static_cast<size_t>(pool_samples(width) / kChunk));
  }
  std::pair<Tensor, Tensor> rows(int64_t first, int64_t count) override {
    Tensor x = empty({count, width_}, DType::f32, device_), y = empty({count, width_}, DType::f32, device_);
    Backend& b = backend_for(device_);
    const int64_t pool = period();
    const size_t row = static_cast<size_t>(width_) * sizeof(float);
    for (int64_t done = 0; done < count;) {  // one copy per run of rows inside one chunk
      const int64_t j = (first + done) % pool, c = j / kChunk, in = j % kChunk;
      const int64_t n = std::min(count - done, kChunk - in);
      const auto& [cx, cy] = chunk(c);
      b.copy(static_cast<char*>(x.data_ptr()) + static_cast<size_t>(done) * row,
             static_cast<const char*>(cx.data_ptr()) + static_cast<size_t>(in) * row, static_cast<size_t>(n) * row);
      b.copy(static_cast<char*>(y.data_ptr()) + static_cast<size_t>(done) * row,
             static_cast<const char*>(cy.data_ptr()) + static_cast<size_t>(in) * row, static_cast<size_t>(n) * row);
      done += n;
    }
    return {x, y};
  }
  void prepare(int64_t first, int64_t count) override {
    const int64_t pool = period();
    for (int64_t j = first; j < first + count; j += kChunk) chunk((j % pool) / kChunk);
    chunk(((first + count - 1) % pool) / kChunk);
  }
  int64_t period() const override { return static_cast<int64_t>(chunks_.size()) * kChunk; }
  std::string describe() const override { return "synthetic (random 2-layer teacher)"; }

 private:
  const std::pair<Tensor, Tensor>& chunk(int64_t c) {
    auto& slot = chunks_[static_cast<size_t>(c)];
    if (!slot.first.defined()) {
      Tensor x = empty({kChunk, width_}, DType::f32, device_);
      backend_for(device_).fill_normal(x, seed_, static_cast<uint64_t>(c * kChunk * width_), 0.0, 1.0);
      NoGradGuard no_grad;
      slot = {x, (*teacher_)(x)};
    }
    return slot;
  }

  int64_t width_;
  uint64_t seed_;
  Device device_;
  std::shared_ptr<nn::Sequential> teacher_;
  std::vector<std::pair<Tensor, Tensor>> chunks_;  // generated on first use
};

class FromFile final : public Dataset {
 public:
  FromFile(Tensor x, Tensor y, std::string path) : x_(std::move(x)), y_(std::move(y)), path_(std::move(path)) {}
  std::pair<Tensor, Tensor> rows(int64_t first, int64_t count) override {
    const int64_t n = x_.shape()[0], w = x_.shape()[1];
    Tensor x = empty({count, w}, DType::f32, x_.device()), y = empty({count, w}, DType::f32, x_.device());
    Backend& b = backend_for(x_.device());
    const size_t row = static_cast<size_t>(w) * sizeof(float);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t src = (first + i) % n;
      b.copy(static_cast<char*>(x.data_ptr()) + static_cast<size_t>(i) * row,
             static_cast<const char*>(x_.data_ptr()) + static_cast<size_t>(src) * row, row);
      b.copy(static_cast<char*>(y.data_ptr()) + static_cast<size_t>(i) * row,
             static_cast<const char*>(y_.data_ptr()) + static_cast<size_t>(src) * row, row);
    }
    return {x, y};
  }
  std::string describe() const override { return path_ + " (" + std::to_string(x_.shape()[0]) + " samples)"; }

 private:
  Tensor x_, y_;
  std::string path_;
};

}  // namespace

int64_t pool_samples(int64_t width) {
  constexpr int64_t kBudget = int64_t{256} << 20;  // bytes of x and y together
  const int64_t fit = kBudget / (2 * width * static_cast<int64_t>(sizeof(float)));
  const int64_t chunks = std::clamp<int64_t>(fit / Synthetic::kChunk, 1, 65536 / Synthetic::kChunk);
  return chunks * Synthetic::kChunk;
}

std::unique_ptr<Dataset> make_synthetic(int64_t width, uint64_t seed, Device device) {
  return std::make_unique<Synthetic>(width, seed, device);
}

std::unique_ptr<Dataset> load_dataset(const std::string& path, int64_t width, Device device) {
  const auto tensors = safetensors::load(path);
  auto get = [&](const char* name) -> Tensor {
    for (const auto& [n, t] : tensors)
      if (n == name) return t;
    throw std::invalid_argument(path + ": --data file has no tensor '" + name + "' (expected x and y, [N, " +
                                std::to_string(width) + "] float32)");
  };
  const Tensor x = get("x"), y = get("y");
  for (const auto& [name, t] : {std::pair<const char*, Tensor>{"x", x}, {"y", y}}) {
    if (t.dtype() != DType::f32)
      throw std::invalid_argument(path + ": tensor '" + name + "' has dtype " + dtype_name(t.dtype()) + ", expected float32");
    if (t.dim() != 2 || t.shape()[1] != width || t.shape()[0] < 1)
      throw std::invalid_argument(path + ": tensor '" + name + "' has shape " + shape_str(t.shape()) + ", expected [N, " +
                                  std::to_string(width) + "] to match --width " + std::to_string(width));
  }
  if (x.shape()[0] != y.shape()[0])
    throw std::invalid_argument(path + ": tensors 'x' " + shape_str(x.shape()) + " and 'y' " + shape_str(y.shape()) +
                                " hold different numbers of samples");
  return std::make_unique<FromFile>(x.to(device), y.to(device), path);
}

}  // namespace amp::launch
