// The model registry: what the trainer and the CLI ask of a kind of model, so that neither names one.
// A kind declares its name, its flags and their checks, its memory estimate, its data source, what a
// checkpoint must match, and its optional hooks (sampling, Jacobian descent). Adding a model is one
// file (its spec) and one line in model_spec.cpp's list, or register_model() from outside (tests,
// a program that embeds the runtime).
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "jd/aggregator.h"
#include "models/data/dataset.h"
#include "runtime/core/device.h"
#include "runtime/core/dtype.h"
#include "models/training_model.h"
#include "runtime/core/safetensors.h"
#include "runtime/ops/random.h"

namespace amp::models {

// A flag of a model kind: --NAME VALUE, with its default and help as --help prints them.
struct ModelFlag {
  std::string name, default_value, help;
};
// The values a run gives its model's flags, by name (the ones not given keep their defaults).
using ModelFlagValues = std::map<std::string, std::string>;
// A flag given that changes nothing in a configuration (the sampling flags without a sample), and why.
struct InertFlag {
  std::string flag, why;
};

// What the rest of the run looks like, for a model's checks.
struct RunShape {
  std::string data;  // --data: "synthetic" or a file
  int64_t batch_size = 1;  // samples per rank per micro-batch
  int optimizer_slots = 2;  // fp32 values the optimizer keeps per parameter (SGD 0, with momentum 1, AdamW 2)
  bool autocast = false;  // --amp fp16|bf16: 16-bit copies of the parameters, and of activations
  DType autocast_dtype = DType::f32;  // --amp's dtype (f32 without autocast)
  // The device, once chosen: the trainer's check has it; the CLI's, which run before, do not.
  std::optional<DeviceType> device;
};

// What a run keeps resident at its peak on the CPU, in bytes: a bound, within 1.5x of what it uses
// (tests/test_memory_estimate.cpp measures it). The process itself (libraries, MPI, threads' stacks)
// is kProcessBytes; the model is its parameters with their gradients, reducer buckets and optimizer
// state; the activations are a micro-batch's forward and backward; the data, what is read into memory.
struct MemoryEstimate {
  static constexpr long double kProcessBytes = 320.0L * 1024 * 1024;
  long double model = 0, activations = 0, data = 0;
  long double total() const { return kProcessBytes + model + activations + data; }
};
// The bytes of `parameters` fp32 parameters in a run: weights, gradients, the reducer's buckets, the
// optimizer's slots, the 16-bit copies.
long double parameter_bytes(long double parameters, const RunShape& run);
// The size of --data's file (0 for synthetic data or a file that cannot be read: its reader says why).
long double data_file_bytes(const RunShape& run);

// One configured model of a kind: its flags' values parsed and checked.
class ModelSpec {
 public:
  virtual ~ModelSpec() = default;
  // Checks the run against this model (data, sizes against physical_memory bytes: 0 skips that).
  // Throws std::invalid_argument naming the flag and what is wrong.
  virtual void check(const RunShape& run, long double physical_memory) const = 0;
  // What the run needs in memory (none said: zeros).
  virtual MemoryEstimate memory_estimate(const RunShape& /*run*/) const { return {}; }
  // A fresh model, initialised from gen.
  virtual std::unique_ptr<TrainingModel> build(Generator& gen, Device device) const = 0;
  // Its data: "synthetic" or a file. Throws std::invalid_argument naming the file.
  virtual std::unique_ptr<Dataset> data(const std::string& data, uint64_t seed, Device device) const = 0;
  // What a checkpoint must match to resume into this model ({"model": {...}, ...}).
  virtual nlohmann::json checkpoint_identity() const = 0;
  // One line for the start of a run ("gpt 4 layers x 4 heads x 128 wide, block 64, on FILE").
  virtual std::string describe(const std::string& data) const = 0;
  // A note for the start of a run, after that line, or "" (a multi-task run whose aggregation is slow).
  virtual std::string start_note() const { return ""; }
  // The flags that size it, for an out-of-memory message ("--width or --batch-size").
  virtual std::string size_flags() const = 0;
  // Progress: tokens per sample and their name ("tokens" for a language model).
  virtual double tokens_per_sample() const { return 1.0; }
  virtual const char* unit() const { return "samples"; }
  // Multi-task models train by Jacobian descent: their aggregator (null: an ordinary model).
  virtual std::unique_ptr<jd::Aggregator> aggregator(uint64_t /*seed*/) const { return nullptr; }
  // Its --aggregator, as given (a checkpoint records it: a resume with another one says so).
  virtual std::string aggregator_spec() const { return ""; }
  // Whether the step may differentiate through its own gradients (--grad-penalty).
  virtual bool double_backward() const { return true; }
  // After training (rank 0): text to print (any bytes), e.g. a sample of a language model; empty:
  // nothing. Work that takes long checks stop() as it goes and ends early, saying so, when it is true.
  virtual std::string after_training(TrainingModel& /*model*/, uint64_t /*seed*/,
                                     const std::function<bool()>& /*stop*/) const {
    return {};
  }
  // --init-weights: a file's tensors in this model's own names and layouts (the GPT also reads
  // Hugging Face's GPT-2); as given by default. Throws std::invalid_argument naming the source.
  virtual safetensors::NamedTensors import_weights(safetensors::NamedTensors tensors, const std::string& /*source*/) const {
    return tensors;
  }
  // --save-weights-format: the layouts this model writes besides its own ("native"), and the
  // conversion of its state dict into one of them.
  virtual std::vector<std::string> weight_formats() const { return {}; }
  virtual safetensors::NamedTensors export_weights(safetensors::NamedTensors tensors, const std::string& /*format*/) const {
    return tensors;
  }
};

// A kind of model: its name (--model NAME), a line for --help, its flags, and how to configure one.
struct ModelKind {
  std::string name, summary;
  std::string data_help;  // what --data FILE holds for it ("x, y [N, width] float32 (safetensors)")
  std::vector<ModelFlag> flags;
  // Parses and checks the values (unknown names are the caller's concern); throws std::invalid_argument
  // naming the flag.
  std::function<std::shared_ptr<const ModelSpec>(const ModelFlagValues&)> configure;
  // The flags given that would change nothing (empty function: none). configure_model refuses them (a
  // mistake, not a value to ignore); amp_train asks first, so that a --config key is only a notice.
  std::function<std::vector<InertFlag>(const ModelFlagValues&)> inert;
};

// Every kind, in registration order: the built-in ones, then those registered by register_model().
const std::deque<ModelKind>& model_kinds();
// Adds a kind (a test's, an embedding program's); a name already taken is refused.
void register_model(ModelKind kind);
// The kind named `name`; throws std::invalid_argument naming --model and the kinds there are.
const ModelKind& model_kind(const std::string& name);
// model_kind(name).configure(values), refusing a value for a flag the kind does not have, then an
// inert one (after every value's own check).
std::shared_ptr<const ModelSpec> configure_model(const std::string& name, const ModelFlagValues& values = {});
// The kind's inert flags among the values (they are its own: configure_model checks that).
std::vector<InertFlag> inert_model_flags(const std::string& name, const ModelFlagValues& values);

// Reads a kind's flags from the values, with their defaults (a flag's check names it).
class FlagReader {
 public:
  FlagReader(const std::vector<ModelFlag>& flags, const ModelFlagValues& values) : flags_(flags), values_(values) {}
  std::string text(const std::string& name) const;
  int64_t integer(const std::string& name, int64_t min) const;  // a whole number >= min
  double number(const std::string& name) const;                 // any finite number
  bool given(const std::string& name) const { return values_.count(name) > 0; }  // not its default

 private:
  const std::vector<ModelFlag>& flags_;
  const ModelFlagValues& values_;
};

// "X GiB, and this machine has Y GiB (for each of its ranks)": for the memory checks' messages.
std::string memory_needed(long double bytes, long double physical_memory);

// The built-in kinds (each in its own file).
ModelKind mlp_kind();
ModelKind mtl_kind();
ModelKind gpt_kind();

}  // namespace amp::models
