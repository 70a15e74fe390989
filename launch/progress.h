// amp_train's progress lines: every --log-every steps (and the last, and where an interruption
// stops the run) the loss, learning rate, scale, skipped steps, throughput and ETA; each validation
// loss. Rank 0 prints them to stdout.
#pragma once
#include <memory>

#include "launch/training/train_config.h"
#include "launch/training/trainer.h"

namespace amp::launch {

// start_step: the step the run continues from (0: a fresh run); samples_per_step: every rank's.
std::shared_ptr<ProgressSink> progress_printer(const TrainConfig& cfg, const models::ModelSpec& spec,
                                               int64_t start_step, int64_t samples_per_step);

}  // namespace amp::launch
