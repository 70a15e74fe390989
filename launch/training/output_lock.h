// Outputs in use by a live run are refused, not shared: each run holds an exclusive lock (flock(2))
// on every output it writes (--checkpoint-dir, --metrics, --save-weights) for its whole life. A
// second run that names one of them stops at set-up with exit 2, naming the output and the process
// that holds it. The kernel releases a lock when its process ends, however it ends (kill -9
// included), so a dead run never blocks the next one.
//
// The lock of a file F is the file .F.lock beside it (beside the file a symbolic link names); the
// lock of a directory is DIR/.lock. They hold the owner's process id, and are removed when the run
// ends normally.
#pragma once
#include <string>
#include <vector>

namespace amp::launch {

class OutputLocks {
 public:
  OutputLocks() = default;
  OutputLocks(const OutputLocks&) = delete;
  OutputLocks& operator=(const OutputLocks&) = delete;
  ~OutputLocks();  // releases every lock and removes its file
  // Locks the output `path` given by `flag` (a directory when `directory`, which must exist). Throws
  // std::invalid_argument naming the flag, the path and, when another process holds it, that process.
  void acquire(const char* flag, const std::string& path, bool directory);

 private:
  struct Held {
    std::string flag, lock_path;
    int fd;
  };
  std::vector<Held> held_;
};

}  // namespace amp::launch
