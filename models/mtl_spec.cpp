// --model mtl: TorchJD's multi-task example network (models/mtl.h), trained by Jacobian descent
// with --aggregator.
#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include "models/model_spec.h"
#include "models/mtl.h"
#include "runtime/ops/ops.h"

namespace amp::models {

namespace {

class MtlSpec final : public ModelSpec {
 public:
  MtlSpec(const MtlConfig& c, std::string aggregator) : c_(c), aggregator_(std::move(aggregator)) {}
  void check(const RunShape& run, long double ram) const override {
    if (ram <= 0) return try_aggregator();
    const MemoryEstimate m = memory_estimate(run);
    if (MemoryEstimate::kProcessBytes + m.model > ram)
      throw std::invalid_argument("--in-features " + std::to_string(c_.in_features) + ", --hidden " +
                                  std::to_string(c_.hidden) + ", --features " + std::to_string(c_.features) +
                                  " and --tasks " + std::to_string(c_.tasks) +
                                  ": the model and its Jacobian alone need at least " +
                                  memory_needed(MemoryEstimate::kProcessBytes + m.model, ram));
    if (m.total() > ram)
      throw std::invalid_argument("--batch-size " + std::to_string(run.batch_size) + " at --in-features " +
                                  std::to_string(c_.in_features) + " and --hidden " + std::to_string(c_.hidden) +
                                  ": a micro-batch's activations, the model and the data need at least " +
                                  memory_needed(m.total(), ram) + "; use more --micro-batches of a smaller --batch-size");
    try_aggregator();
  }
  // The shared trunk's parameters: the Jacobian's columns.
  long double trunk_parameters() const {  // in long double: sizes past 64 bits are the memory check's to refuse
    const long double in = static_cast<long double>(c_.in_features), h = static_cast<long double>(c_.hidden);
    const long double f = static_cast<long double>(c_.features);
    return in * h + h + h * f + f;
  }
  // Built, and its count of rows (Krum, TrimmedMean, a constant of another length) checked against
  // --tasks: a usage error now, not a failure at step 1. Nothing is aggregated where the count fits
  // (a trial on [tasks, 3], as long as a step's aggregation, took minutes for UPGrad on 3000 tasks).
  void try_aggregator() const {
    std::unique_ptr<jd::Aggregator> agg;
    try {
      agg = jd::make_aggregator(aggregator_);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("--aggregator " + aggregator_ + ": " + e.what());
    }
    const int64_t lo = agg->min_rows(), hi = agg->max_rows();
    if (c_.tasks >= lo && c_.tasks <= hi) return;
    // TorchJD's words too, from the aggregation it refuses (before any work), the tried matrix's
    // shape made the run's: its rows are --tasks, its columns the shared parameters.
    std::string torchjd;
    try {
      (*agg)(ones({c_.tasks, 3}));
    } catch (const std::invalid_argument& e) {
      torchjd = e.what();
      const std::string tried = "[" + std::to_string(c_.tasks) + ", 3]";
      if (const size_t at = torchjd.find(tried); at != std::string::npos) {
        char columns[64];
        std::snprintf(columns, sizeof columns, "%.0Lf", trunk_parameters());
        torchjd.replace(at, tried.size(), "[" + std::to_string(c_.tasks) + ", " + columns + "]");
      }
    }
    const std::string need = lo == hi         ? std::to_string(lo) + ", one weight a task"
                             : c_.tasks < lo ? std::to_string(lo) + " or more"
                                             : std::to_string(hi) + " or fewer";
    throw std::invalid_argument("--aggregator " + aggregator_ + " with --tasks " + std::to_string(c_.tasks) +
                                ": it needs --tasks " + need + (torchjd.empty() ? "" : " (TorchJD: " + torchjd + ")"));
  }
  // Measured on the CPU (tests/test_memory_estimate.cpp): the trunk's Jacobian [tasks, trunk] about
  // four times (the micro-batches' sum, the all-reduced copy, the Gramian's and the aggregation's
  // working copies), the Gramian [tasks, tasks] in fp64 with its copies; about 9 bytes a value of a
  // sample's layers.
  MemoryEstimate memory_estimate(const RunShape& run) const override {
    const long double in = static_cast<long double>(c_.in_features), h = static_cast<long double>(c_.hidden);
    const long double f = static_cast<long double>(c_.features), tasks = static_cast<long double>(c_.tasks);
    const long double trunk = trunk_parameters();
    MemoryEstimate m;
    m.model = parameter_bytes(trunk + tasks * (f + 1), run) + tasks * trunk * 4 * 4 + tasks * tasks * 8 * 4;
    m.activations = static_cast<long double>(run.batch_size) * (in + 2 * h + 2 * f + tasks) * 9;
    const long double sample = in + tasks;  // synthetic: a teacher per task, and the pool of samples
    m.data = run.data == "synthetic"
                 ? tasks * (in * h + 2 * h + 1) * 4 + static_cast<long double>(pool_samples(c_.in_features + c_.tasks)) * sample * 4
                 : 2 * data_file_bytes(run);
    return m;
  }
  std::unique_ptr<TrainingModel> build(Generator& gen, Device device) const override {
    return make_mtl_model(c_, gen, device);
  }
  std::unique_ptr<Dataset> data(const std::string& data, uint64_t seed, Device device) const override {
    return data == "synthetic" ? make_synthetic_tasks(c_.in_features, c_.hidden, c_.tasks, seed, device)
                               : load_task_dataset(data, c_.in_features, c_.tasks, device);
  }
  nlohmann::json checkpoint_identity() const override {
    return {{"model",
             {{"model", "mtl"}, {"tasks", c_.tasks}, {"in_features", c_.in_features}, {"hidden", c_.hidden},
              {"features", c_.features}}},
            {"dropout", 0.0}};
  }
  std::string describe(const std::string&) const override {
    return "mtl " + std::to_string(c_.tasks) + " tasks (" + std::to_string(c_.in_features) + "-" +
           std::to_string(c_.hidden) + "-" + std::to_string(c_.features) + " trunk, " + aggregator_ + ")";
  }
  std::string start_note() const override {
    // A step's aggregation grows steeply with the tasks where it solves quadratic programs or
    // eigenproblems of --tasks variables (UPGrad: one a task; about 3 s a step at 200 tasks, 30 s at 400
    // on one core), and a stop signal waits for the step in flight: said before the first one.
    const std::vector<std::string> steep = {"upgrad", "dualproj", "mgda", "imtlg", "alignedmtl", "config"};
    if (c_.tasks < kManyTasks || std::find(steep.begin(), steep.end(), kind()) == steep.end()) return "";
    return "at " + std::to_string(c_.tasks) + " tasks " + kind() +
           "'s aggregation may take seconds to minutes a step (its time grows as the cube of --tasks or faster), and "
           "a stop signal waits for the step in flight (Ctrl-C twice, or SIGKILL, stops at once)";
  }
  static constexpr int64_t kManyTasks = 100;
  std::string kind() const { return aggregator_.substr(0, aggregator_.find(':')); }
  std::string size_flags() const override { return "are --in-features, --hidden, --features, --tasks or --batch-size"; }
  std::unique_ptr<jd::Aggregator> aggregator(uint64_t seed) const override { return jd::make_aggregator(aggregator_, seed); }
  std::string aggregator_spec() const override { return aggregator_; }
  bool double_backward() const override { return false; }  // its gradients come from grad() of each task

 private:
  MtlConfig c_;
  std::string aggregator_;
};

}  // namespace

ModelKind mtl_kind() {
  ModelKind k;
  k.name = "mtl";
  k.summary = "multi-task, by Jacobian descent";
  k.data_help = "x [N, in], y1..yT [N, 1] float32 (safetensors)";
  k.flags = {{"tasks", "2", "mtl: tasks (losses, heads)"},
             {"in-features", "10", "mtl: input size"},
             {"hidden", "5", "mtl: the shared trunk's hidden size"},
             {"features", "3", "mtl: the shared features' size"},
             {"aggregator", "upgrad",
              "mtl: upgrad|mean|sum|random|dualproj|mgda|pcgrad|imtlg|alignedmtl|config|graddrop|trimmedmean[:T]|"
              "krum[:F[:K]]|constant:W1,W2,..."}};
  k.configure = [flags = k.flags](const ModelFlagValues& v) -> std::shared_ptr<const ModelSpec> {
    const FlagReader r(flags, v);
    const MtlConfig c{r.integer("tasks", 1), r.integer("in-features", 1), r.integer("hidden", 1), r.integer("features", 1)};
    const std::string aggregator = r.text("aggregator");
    try {
      jd::make_aggregator(aggregator);  // the name and its parameters; tried on a Jacobian by check()
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--aggregator: ") + e.what());
    }
    return std::make_shared<MtlSpec>(c, aggregator);
  };
  return k;
}

}  // namespace amp::models
