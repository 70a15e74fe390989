#include "models/data/dataset.h"
#include "models/data/token_dataset.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <vector>

#include "models/mlp.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"
#include "runtime/core/fnv1a.h"
#include "runtime/core/safetensors.h"

namespace amp::models {

namespace {

constexpr int64_t kChunk = 256;

// Copies rows [first, first + count) of each of `sources` (wrapping around modulo rows) into new
// tensors of count rows: one copy per run of contiguous rows.
std::vector<Tensor> copy_rows(const std::vector<Tensor>& sources, int64_t first, int64_t count, int64_t period,
                              int64_t rows_per_source_block, const std::function<const std::vector<Tensor>&(int64_t)>& block) {
  std::vector<Tensor> out;
  for (const Tensor& s : sources) out.push_back(empty({count, s.shape()[1]}, s.dtype(), s.device()));
  if (out.empty()) return out;
  DeviceMemory& b = memory_for(out[0].device());
  for (int64_t done = 0; done < count;) {
    const int64_t j = (first + done) % period, c = j / rows_per_source_block, in = j % rows_per_source_block;
    const int64_t n = std::min(count - done, rows_per_source_block - in);
    const std::vector<Tensor>& src = block(c);
    for (size_t t = 0; t < out.size(); ++t) {
      const size_t row = static_cast<size_t>(out[t].shape()[1]) * sizeof(float);
      b.copy(static_cast<char*>(out[t].data_ptr()) + static_cast<size_t>(done) * row,
             static_cast<const char*>(src[t].data_ptr()) + static_cast<size_t>(in) * row, static_cast<size_t>(n) * row);
    }
    done += n;
  }
  return out;
}

Batch to_batch(std::vector<Tensor> v) {
  Batch b;
  b.x = v[0];
  b.targets.assign(v.begin() + 1, v.end());
  return b;
}

// He-normal weights keep the signal's variance through the ReLU, so targets have unit scale and a
// falling loss is plain to see.
std::shared_ptr<nn::Sequential> teacher(int64_t in, int64_t hidden, int64_t out, Generator& gen, Device device) {
  auto t = models::make_mlp({in, hidden, out, 2}, gen, device);
  const auto params = t->named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor w = params[i].second.detach();
    const int64_t fan_in = i < 2 ? in : hidden;
    if (w.dim() == 2) normal_(w, 0.0, std::sqrt((i < 2 ? 2.0 : 1.0) / static_cast<double>(fan_in)), gen);
  }
  return t;
}

// The synthetic stream is a pool of pool_samples() samples that repeats, like a file: sample j is
// pool sample j mod P. Each chunk of kChunk pool samples is generated the first time a step needs
// it (x from the counter-based normal stream, each target by its teacher) and kept, so after the
// first pass over the pool a step pays for no data at all. Chunks depend on the sample index alone,
// never on the batch, rank count or device, so every configuration sees the same samples.
class Synthetic final : public Dataset {
 public:
  Synthetic(int64_t in, std::vector<std::shared_ptr<nn::Sequential>> teachers, int64_t floats_per_sample, uint64_t seed,
            Device device, std::string what)
      : in_(in), teachers_(std::move(teachers)), seed_(seed), device_(device), what_(std::move(what)) {
    chunks_.resize(static_cast<size_t>(pool_samples(floats_per_sample) / kChunk));
  }
  Batch rows(int64_t first, int64_t count) override {
    const std::vector<Tensor>& first_chunk = chunk(((first % period()) / kChunk));
    return to_batch(copy_rows(first_chunk, first, count, period(), kChunk, [this](int64_t c) -> const std::vector<Tensor>& { return chunk(c); }));
  }
  void prepare(int64_t first, int64_t count) override {
    const int64_t pool = period();
    for (int64_t j = first; j < first + count; j += kChunk) chunk((j % pool) / kChunk);
    chunk(((first + count - 1) % pool) / kChunk);
  }
  int64_t period() const override { return static_cast<int64_t>(chunks_.size()) * kChunk; }
  std::string describe() const override { return what_; }

 private:
  const std::vector<Tensor>& chunk(int64_t c) {
    auto& slot = chunks_[static_cast<size_t>(c)];
    if (slot.empty()) {
      Tensor x = empty({kChunk, in_}, DType::f32, device_);
      backend_for(device_).fill_normal(x, seed_, static_cast<uint64_t>(c * kChunk * in_), 0.0, 1.0);
      NoGradGuard no_grad;
      slot.push_back(x);
      for (const auto& t : teachers_) slot.push_back((*t)(x));
    }
    return slot;
  }

  int64_t in_;
  std::vector<std::shared_ptr<nn::Sequential>> teachers_;
  uint64_t seed_;
  Device device_;
  std::string what_;
  std::vector<std::vector<Tensor>> chunks_;  // [x, targets...] per chunk, generated on first use
};

// A file's tensors, all on the device; the checksum of their values (x, then the targets), which a
// checkpoint records and every rank compares, as a text file's.
struct FileTensors {
  std::vector<Tensor> tensors;
  std::string checksum;
};

class FromFile final : public Dataset {
 public:
  FromFile(FileTensors file, std::string path)
      : tensors_(std::move(file.tensors)), checksum_(std::move(file.checksum)), path_(std::move(path)) {}
  Batch rows(int64_t first, int64_t count) override {
    const int64_t n = tensors_[0].shape()[0];
    return to_batch(copy_rows(tensors_, first, count, n, n, [this](int64_t) -> const std::vector<Tensor>& { return tensors_; }));
  }
  std::string describe() const override { return path_ + " (" + std::to_string(tensors_[0].shape()[0]) + " samples)"; }
  // Its samples and its values: another file on a rank, or at a resume, is named (it trained silently).
  int64_t resume_size() const override { return tensors_[0].shape()[0]; }
  nlohmann::json content_checksums() const override { return checksum_; }

 private:
  std::vector<Tensor> tensors_;  // x, then the targets
  std::string checksum_;
  std::string path_;
};

// The named float32 tensors of a --data file, each [N, width_i] with one N, moved to device.
FileTensors read_tensors(const std::string& path, const std::vector<std::pair<std::string, int64_t>>& wanted,
                         const std::string& expected, Device device) {
  if (has_llmc_magic(path))
    throw std::invalid_argument(path + ": --data is llm.c token data, which --model gpt trains on (with --vocab-size); "
                                "this model's --data is a safetensors file of " + expected);
  const auto tensors = safetensors::load(path);
  // A tensor nobody reads means a file made for another model or task count: refused, not ignored.
  for (const auto& [n, v] : tensors)
    if (std::none_of(wanted.begin(), wanted.end(), [&](const auto& w) { return w.first == n; }))
      throw std::invalid_argument(path + ": --data file holds a tensor '" + n + "' that this run does not read (expected " +
                                  expected + ", and nothing else): a file made for another --model, --tasks or --width?");
  std::vector<Tensor> out;
  uint64_t checksum = kFnv1aOffset;
  for (const auto& [name, width] : wanted) {
    Tensor t;
    for (const auto& [n, v] : tensors)
      if (n == name) t = v;
    if (!t.defined()) throw std::invalid_argument(path + ": --data file has no tensor '" + name + "' (expected " + expected + ")");
    if (t.dtype() != DType::f32)
      throw std::invalid_argument(path + ": tensor '" + name + "' has dtype " + dtype_name(t.dtype()) + ", expected float32");
    if (t.dim() != 2 || t.shape()[1] != width || t.shape()[0] < 1)
      throw std::invalid_argument(path + ": tensor '" + name + "' has shape " + shape_str(t.shape()) + ", expected [N, " +
                                  std::to_string(width) + "] (" + expected + ")");
    if (!out.empty() && t.shape()[0] != out[0].shape()[0])
      throw std::invalid_argument(path + ": tensors '" + wanted[0].first + "' " + shape_str(out[0].shape()) + " and '" + name +
                                  "' " + shape_str(t.shape()) + " hold different numbers of samples");
    const uint64_t words = fnv1a_words(t.data<float>(), static_cast<size_t>(t.numel()) * sizeof(float));
    checksum = fnv1a(&words, sizeof words, checksum);
    out.push_back(t.to(device));
  }
  return {std::move(out), hex64(checksum)};
}

}  // namespace

Batch Dataset::validation_rows(int64_t, int64_t) {
  throw std::logic_error(describe() + ": this data has no validation split");
}

int64_t pool_samples(int64_t floats_per_sample) {
  constexpr int64_t kBudget = int64_t{256} << 20;  // bytes of every sample's x and targets together
  const int64_t fit = kBudget / (floats_per_sample * static_cast<int64_t>(sizeof(float)));
  const int64_t chunks = std::clamp<int64_t>(fit / kChunk, 1, 65536 / kChunk);
  return chunks * kChunk;
}

std::unique_ptr<Dataset> make_synthetic(int64_t width, uint64_t seed, Device device) {
  Generator gen(seed ^ 0x7465616368657200ull);  // the teacher's own stream
  return std::make_unique<Synthetic>(width, std::vector{teacher(width, width, width, gen, device)}, 2 * width, seed, device,
                                     "synthetic (random 2-layer teacher)");
}

std::unique_ptr<Dataset> make_synthetic_tasks(int64_t in_features, int64_t hidden, int64_t tasks, uint64_t seed,
                                              Device device) {
  Generator gen(seed ^ 0x7465616368657200ull);
  std::vector<std::shared_ptr<nn::Sequential>> teachers;
  for (int64_t t = 0; t < tasks; ++t) teachers.push_back(teacher(in_features, hidden, 1, gen, device));
  return std::make_unique<Synthetic>(in_features, std::move(teachers), in_features + tasks, seed, device,
                                     "synthetic (a random 2-layer teacher per task)");
}

std::unique_ptr<Dataset> load_dataset(const std::string& path, int64_t width, Device device) {
  const std::string expected = "x and y, [N, " + std::to_string(width) + "] float32, to match --width " + std::to_string(width);
  return std::make_unique<FromFile>(read_tensors(path, {{"x", width}, {"y", width}}, expected, device), path);
}

std::unique_ptr<Dataset> load_task_dataset(const std::string& path, int64_t in_features, int64_t tasks, Device device) {
  std::vector<std::pair<std::string, int64_t>> wanted = {{"x", in_features}};
  for (int64_t t = 1; t <= tasks; ++t) wanted.emplace_back("y" + std::to_string(t), 1);
  const std::string ys = tasks == 1 ? "y1" : "y1 ... y" + std::to_string(tasks);  // (not "y1 ... y1")
  const std::string expected = "x [N, " + std::to_string(in_features) + "] and " + ys +
                               " [N, 1], float32, to match --in-features and --tasks";
  return std::make_unique<FromFile>(read_tensors(path, wanted, expected, device), path);
}

}  // namespace amp::models
