// Metrics as JSON Lines (DESIGN §9): one record per optimizer step, then one "end" record, written
// to FILE itself as training goes (`tail -f` works), a whole line at a time, flushed per record. A
// run that dies leaves every finished step's line and no partial one; the "end" record marks a run
// that finished.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace amp::launch {

struct StepRecord {
  int64_t step;
  double loss;       // unscaled mean loss over the effective batch, averaged over ranks
  double scale;      // the scale this step's backward used (1 without scaling)
  bool skipped;
  double grad_norm;  // 2-norm of the unscaled, averaged gradients (before clipping); NaN: not computed
  double lr;
  double step_ms;
  bool stop_requested = false;  // a rank got SIGINT/SIGTERM before this step's figures were reduced
  // Multi-task models: each task's unscaled mean loss (averaged over ranks; `loss` is their sum),
  // and the aggregator's weights when it has them. Empty otherwise, and then not written.
  std::vector<double> task_losses, weights;
  // On the emulated GPU: what train_step issued (the one-step-late read of the previous step's
  // figures is not in it). -1 elsewhere, and then not written.
  int64_t device_launches = -1, device_host_syncs = -1, device_d2h_copies = -1;
};

// The validation loss (gpt): mean over the evaluation's batches, averaged over ranks.
struct EvalRecord {
  int64_t step;
  double val_loss;
};

struct EndRecord {
  int64_t steps;  // the steps trained (fewer than asked when interrupted)
  int64_t skipped_steps;
  double final_scale;
  std::string param_checksum;
  bool replicas_consistent;
  std::string interrupted_by;  // "SIGTERM", ..., or empty (and then not written)
};

class MetricsWriter {
 public:
  MetricsWriter() = default;  // writes nothing
  explicit MetricsWriter(const std::string& path, bool append = false);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const StepRecord& r);
  void write(const EvalRecord& r);
  void write(const EndRecord& r);
  void close();  // flush and close; throws if anything could not be written

 private:
  void line(const std::string& json);
  std::string path_;
  std::ofstream out_;
};

}  // namespace amp::launch
