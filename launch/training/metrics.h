// Metrics as JSON Lines: one record per optimizer step, then one "end" record, written to FILE
// itself as training goes (`tail -f` works), a whole line at a time with one write(2) each. A run that
// dies leaves every finished step's line and no partial one; the "end" record marks a run that
// finished and saved its outputs, a "failed" record one that trained but could not save them.
//
// A line that cannot be written (a full disk, a file-size limit) is cut off again, so the file ends
// with its last whole line; the writer then stops writing and keeps the error, with its cause and
// step, for the caller to report: the metrics failing must not stop the training, nor cost the
// weights and checkpoints.
#pragma once
#include <cstdint>
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
  bool stop_requested = false;  // a rank got a stop signal before this step's figures were reduced
  // Bytes this rank sent in the step's collectives, counted from their sizes (comm/comm_bytes.h).
  int64_t comm_bytes = 0;
  // Multi-task models: each task's unscaled mean loss (averaged over ranks; `loss` is their sum),
  // and the aggregator's weights when it has them. Empty otherwise, and then not written.
  std::vector<double> task_losses, weights;
  // On the emulated GPU: what train_step issued (the one-step-late read of the previous step's
  // figures is not in it). -1 elsewhere, and then not written.
  int64_t device_launches = -1, device_host_syncs = -1, device_d2h_copies = -1;
  // CUDA graphs launched (a replayed step: 1) and the operations they ran, and the device and pinned
  // allocations (cudaMalloc, cudaMallocHost) the step made.
  int64_t device_graph_launches = -1, device_graph_ops = -1, device_allocations = -1;
};

// The validation loss: mean over the evaluation's batches, averaged over ranks.
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
  int64_t device_memory_bytes = 0;  // TrainResult's; 0 (the CPU) is not written
};

// A resumed run's first record: the records after it are its own, and those of the steps past
// `step` written before it (by the run that was stopped) are superseded by them.
struct ResumeRecord {
  int64_t step;            // the checkpoint's
  std::string checkpoint;  // its directory
};

// The run trained but an output could not be saved (the weights, the final checkpoint).
struct FailedRecord {
  int64_t steps;
  std::string error;
};

// True when the metrics file at path ends with the end record of a run of `steps` steps (its last
// whole line): what a requeued command, with nothing left to train, need not write again.
bool ends_with_end_record(const std::string& path, int64_t steps);

class MetricsWriter {
 public:
  MetricsWriter() = default;  // writes nothing
  // Throws std::invalid_argument naming --metrics when the file cannot be opened.
  explicit MetricsWriter(const std::string& path, bool append = false);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const StepRecord& r);
  void write(const EvalRecord& r);
  void write(const EndRecord& r);
  void write(const FailedRecord& r);
  void write(const ResumeRecord& r);
  void close();  // flushes to the disk and closes; a failure is kept in error()
  // Empty while every line was written; else "--metrics: cannot write 'FILE' at step N: CAUSE".
  const std::string& error() const { return error_; }

 private:
  void line(const std::string& json, int64_t step);
  std::string path_;
  int fd_ = -1;
  std::string error_;
};

}  // namespace amp::launch
