// Checkpoints: DIR/step-NNNNNNNN/ holds
//   model.safetensors      the parameters (PyTorch's names)
//   optimizer.safetensors  the optimizer's state tensors, "state.<param id>.<name>" (PyTorch's numbering)
//   trainer.json           the step, the optimizer's param_groups, the scaler's state, the RNG state,
//                          the configuration a resume must match, each file's size and checksum,
//                          and its own checksum (over its content without that key).
// A checkpoint is written into DIR/.tmp-step-NNNNNNNN.<pid>/, every file flushed to disk, then
// renamed into place and DIR synced: a directory named step-* is complete. The last `keep` are kept.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/optim/optimizer.h"
#include "runtime/core/safetensors.h"

namespace amp::launch {

// The version of trainer.json this build writes; it reads 1 to this, and refuses a newer one's.
inline constexpr int kCheckpointFormat = 2;

struct Checkpoint {
  std::string path;  // the step-NNNNNNNN directory
  int64_t step = 0;
  safetensors::NamedTensors model;
  optim::OptimizerStateDict optimizer;
  nlohmann::json meta;  // trainer.json without "files"
};

// Writes the checkpoint of `step` under dir and removes all but the newest `keep` complete ones.
// Returns its path. Throws std::runtime_error naming the file on any failure (nothing is renamed
// into place then, and older checkpoints are untouched).
std::string save_checkpoint(const std::string& dir, int64_t step, const safetensors::NamedTensors& model,
                            const optim::OptimizerStateDict& optimizer, nlohmann::json meta, int64_t keep);

// The step a checkpoint's directory name gives (step-NNNNNNNN -> NNNNNNNN); -1 for another name.
int64_t checkpoint_step_of(const std::string& name);
// The complete checkpoints under dir, oldest first (their step-NNNNNNNN paths).
std::vector<std::string> list_checkpoints(const std::string& dir);
// Whether a name in DIR is one the checkpoints write there: step-NNNNNNNN, their temporaries
// (.tmp-step-*, .old-step-*), and the directory's lock (.lock, output_lock.h).
bool is_checkpoint_entry(const std::string& name);

// Reads and verifies a checkpoint directory: every file present, of its recorded size and checksum.
// Throws std::invalid_argument naming the file that is missing, partial or corrupt.
Checkpoint load_checkpoint(const std::string& path);

// The newest checkpoint under dir, or nullopt when there is none. A newest one that fails to load is
// an error (naming the file and the older complete ones, which --resume-from can take): an older
// checkpoint is never used silently.
std::optional<Checkpoint> load_latest_checkpoint(const std::string& dir);

// Creates dir if needed and checks that checkpoints can be written there; throws
// std::invalid_argument naming --checkpoint-dir and the reason (before the first step). *made: the
// topmost directory it made (dir or an ancestor; empty when dir was there), set as soon as it is
// made, so that a set-up that fails after it removes them again (exit 2 writes nothing).
void check_checkpoint_dir(const std::string& dir, std::string* made);
// dir without "." and ".." steps and without a trailing separator ("a/./b/" -> "a/b").
std::filesystem::path normal_directory(const std::string& dir);

// Removes all but the newest `keep` complete checkpoints under dir. Each is renamed out of the
// step-* names first (to .old-step-NNNNNNNN.PID), then deleted, so that a process killed while
// deleting never leaves an incomplete step-*. between_files (a test's hook) runs after each file.
void prune_checkpoints(const std::string& dir, int64_t keep, const std::function<void()>& between_files = {});

// Removes DIR/.tmp-step-* (a checkpoint being written) and DIR/.old-step-* (one being pruned)
// directories left by processes that no longer run; their paths.
std::vector<std::string> remove_stale_checkpoint_temporaries(const std::string& dir);

}  // namespace amp::launch
