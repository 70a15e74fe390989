// Training data (the models layer: each model kind names its data source, models/model_spec.h).
// Step i (0-based) uses samples [i E, (i+1) E) of the stream, E = batch × micro-batches
// × ranks, split rank-major: rank r takes [r K B, (r+1) K B) of those, and its micro-batch m takes
// [m B, (m+1) B). So R ranks × batch B see exactly the samples of 1 rank × batch R·B.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "models/training_model.h"
#include "runtime/nn/layers.h"
#include "runtime/core/tensor.h"

namespace amp::models {

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Rows [first, first + count) of the sample stream: x [count, in] and each target [count, out_t],
  // in tensors of their own (never views of the data): the caller may keep and overwrite them (the
  // trainer's captured step copies each step's rows into the first step's).
  virtual Batch rows(int64_t first, int64_t count) = 0;
  // Makes rows [first, first + count) ready, so that rows() then only copies them.
  virtual void prepare(int64_t /*first*/, int64_t /*count*/) {}
  // Rows that prepare() can make: the stream repeats with this period (0: all rows are ready).
  virtual int64_t period() const { return 0; }
  virtual std::string describe() const = 0;
  // A validation split (text has one): rows [first, first + count) of its own stream, laid out as
  // the training stream. None by default (has_validation() false, validation_rows() throws).
  virtual bool has_validation() const { return false; }
  virtual Batch validation_rows(int64_t first, int64_t count);
  // What a resumed run's data must match: its size (the pool's samples, or the training bytes),
  // not its path, so that a moved file resumes.
  virtual int64_t resume_size() const { return period(); }
  // What a checkpoint records of the data and a resumed run must match (trainer.json's must_match):
  // {"data_samples": resume_size()} by default; token shards add their names and sizes.
  virtual nlohmann::json resume_identity() const { return {{"data_samples", resume_size()}}; }
  // Checksums of the data's content (fnv1a_words, runtime/core/fnv1a.h) that a checkpoint records
  // and a resumed run must match: same names and sizes with other bytes (shards made again) would
  // otherwise resume silently on other data. Text and a safetensors file: one, of the file (the
  // latter of its tensors' values); token data: one per shard, in resume_identity's order; null for
  // data generated from the seed.
  virtual nlohmann::json content_checksums() const { return nullptr; }
  // A separate validation set's shards (names, sizes, checksums), which every rank must read alike
  // (amp_train compares them over the ranks); null where there is none (text's split is in the file).
  virtual nlohmann::json validation_identity() const { return nullptr; }
};

// x ~ N(0, 1) from a counter-based stream (pool sample j uses counters j·width...), y = teacher(x)
// with a fixed random 2-layer ReLU teacher, so the loss can fall. The stream repeats a pool of
// pool_samples(width) samples, each generated once, on first use.
std::unique_ptr<Dataset> make_synthetic(int64_t width, uint64_t seed, Device device);
// The multi-task stream: x [in] ~ N(0, 1), and per task t a target [1] from its own fixed random
// ReLU teacher in -> hidden -> 1.
std::unique_ptr<Dataset> make_synthetic_tasks(int64_t in_features, int64_t hidden, int64_t tasks, uint64_t seed,
                                              Device device);
// 256 MiB of samples at most, between 256 and 65536 samples, a multiple of 256 (floats_per_sample:
// x and every target together).
int64_t pool_samples(int64_t floats_per_sample);
// x and y from a safetensors file ([N, width] float32 each); the stream wraps around modulo N.
// Throws std::invalid_argument naming the file, the tensor, the expected and the actual shape.
std::unique_ptr<Dataset> load_dataset(const std::string& path, int64_t width, Device device);
// x [N, in] and y1 ... yT [N, 1] (float32) from a safetensors file, for the multi-task model.
std::unique_ptr<Dataset> load_task_dataset(const std::string& path, int64_t in_features, int64_t tasks, Device device);

}  // namespace amp::models
