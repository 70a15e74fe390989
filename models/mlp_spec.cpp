// --model mlp: the reference benchmark model (models/mlp.h), MSE against a random teacher's targets or
// a file's.
#include <stdexcept>

#include "models/mlp.h"
#include "models/model_spec.h"

namespace amp::models {

namespace {

class MlpSpec final : public ModelSpec {
 public:
  MlpSpec(int64_t width, int64_t layers) : width_(width), layers_(layers) {}
  void check(const RunShape& run, long double ram) const override {
    if (ram <= 0) return;
    const MemoryEstimate m = memory_estimate(run);
    if (MemoryEstimate::kProcessBytes + m.model > ram)
      throw std::invalid_argument("--width " + std::to_string(width_) + " with --layers " + std::to_string(layers_) +
                                  ": the model alone needs at least " +
                                  memory_needed(MemoryEstimate::kProcessBytes + m.model, ram));
    if (m.total() > ram)
      throw std::invalid_argument("--batch-size " + std::to_string(run.batch_size) + " at --width " +
                                  std::to_string(width_) + ": a micro-batch's activations, the model and the data need "
                                  "at least " + memory_needed(m.total(), ram) +
                                  "; use more --micro-batches of a smaller --batch-size");
  }
  // Measured on the CPU (tests/test_memory_estimate.cpp): each layer's output and ReLU saved for the
  // backward, and about 8 [B, width] in flight.
  MemoryEstimate memory_estimate(const RunShape& run) const override {
    const long double w = static_cast<long double>(width_), layers = static_cast<long double>(layers_);
    MemoryEstimate m;
    m.model = parameter_bytes(layers * w * (w + 1), run);
    m.activations = static_cast<long double>(run.batch_size) * w * 4 * (2 * layers + 8);
    // A file is read whole, then as tensors; synthetic data is its teacher and the pool it fills as
    // the steps go (at most pool_samples() samples of x and y).
    m.data = run.data == "synthetic"
                 ? (2 * w * w + 2 * w + static_cast<long double>(pool_samples(2 * width_)) * 2 * w) * 4
                 : 2 * data_file_bytes(run);
    return m;
  }
  std::unique_ptr<TrainingModel> build(Generator& gen, Device device) const override {
    return make_mlp_model({width_, width_, width_, layers_}, gen, device);
  }
  std::unique_ptr<Dataset> data(const std::string& data, uint64_t seed, Device device) const override {
    return data == "synthetic" ? make_synthetic(width_, seed, device) : load_dataset(data, width_, device);
  }
  nlohmann::json checkpoint_identity() const override {
    return {{"model", {{"model", "mlp"}, {"width", width_}, {"layers", layers_}}}, {"dropout", 0.0}};
  }
  std::string describe(const std::string&) const override {
    return "mlp " + std::to_string(layers_) + "x" + std::to_string(width_);
  }
  std::string size_flags() const override { return "is --width or --batch-size"; }

 private:
  int64_t width_, layers_;
};

}  // namespace

ModelKind mlp_kind() {
  ModelKind k;
  k.name = "mlp";
  k.summary = "Linear and ReLU layers, MSE";
  k.data_help = "x, y [N, width] float32 (safetensors)";
  k.flags = {{"width", "256", "mlp: hidden width (also the input and output size)"},
             {"layers", "3", "mlp: number of Linear layers"}};
  k.configure = [flags = k.flags](const ModelFlagValues& v) -> std::shared_ptr<const ModelSpec> {
    const FlagReader r(flags, v);
    return std::make_shared<MlpSpec>(r.integer("width", 1), r.integer("layers", 1));
  };
  return k;
}

}  // namespace amp::models
