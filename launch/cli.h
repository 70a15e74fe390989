// amp_train's command line: Boost.Program_options with option groups, typed validators that list
// the allowed values, range checks that name the flag, and --config FILE with the same keys (the
// command line wins).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "launch/training/train_config.h"

namespace amp::launch {

struct CliResult {
  std::optional<TrainConfig> config;  // set when training should run
  int exit_code = 0;                  // otherwise: 0 after --help, 2 for a usage error
  std::string message;                // what to print (help text or the error)
  std::vector<std::string> notices;   // a --config key that changes nothing in this run (rank 0 prints them)
};

// world_size: the number of ranks, to validate --inject-nonfinite's RANK.
CliResult parse_cli(int argc, const char* const* argv, int world_size);

}  // namespace amp::launch
