#include "launch/training/output_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace amp::launch {

namespace fs = std::filesystem;

namespace {

// "process 1234 (amp_train)", from what the holder wrote into its lock file and from /proc.
std::string holder_of(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  const std::string pid = n > 0 ? std::string(buf, static_cast<size_t>(n)).substr(0, std::string(buf).find('\n')) : "";
  if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) return "another process";
  std::string name;
  std::ifstream comm("/proc/" + pid + "/comm");
  std::getline(comm, name);
  return "process " + pid + (name.empty() ? "" : " (" + name + ")");
}

}  // namespace

void OutputLocks::acquire(const char* flag, const std::string& path, bool directory) {
  if (path.empty()) return;
  std::error_code ec;
  const fs::path target = fs::weakly_canonical(fs::absolute(path, ec), ec);  // symbolic links resolved
  if (ec) throw std::invalid_argument(std::string(flag) + ": '" + path + "': cannot resolve the path: " + ec.message());
  const fs::path lock = directory ? target / ".lock" : target.parent_path() / ("." + target.filename().string() + ".lock");
  for (const Held& h : held_)
    if (h.lock_path == lock.string())
      throw std::invalid_argument(std::string(flag) + " and " + h.flag + " name the same output '" + path +
                                  "': give each its own");
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(flag) + ": '" + path + "': " + why);
  };
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) fail("cannot create its lock file '" + lock.string() + "': " + std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == ENOSYS || err == EOPNOTSUPP || err == ENOLCK) {  // a filesystem without locks (Lustre without -o flock)
        ::close(fd);
        ::unlink(lock.c_str());
        std::fprintf(stderr, "amp_train: warning: %s: '%s': this filesystem has no file locks (%s): another run writing "
                     "it at the same time would not be refused\n", flag, path.c_str(), std::strerror(err));
        return;
      }
      const std::string who = err == EWOULDBLOCK ? holder_of(fd) : "";
      ::close(fd);
      if (err == EWOULDBLOCK)
        fail("in use by another run, " + who + ": two runs writing one output would overwrite each other; wait for "
             "it to end, or choose another path");
      fail("cannot lock '" + lock.string() + "': " + std::strerror(err));
    }
    // The previous holder removes its lock file as it ends: if it did so after our open(), our lock
    // is on a file nobody else will find. Lock the file that is there now instead.
    struct stat mine {}, there {};
    if (::fstat(fd, &mine) == 0 && ::stat(lock.c_str(), &there) == 0 && mine.st_ino == there.st_ino &&
        mine.st_dev == there.st_dev) {
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size()))
        fail("cannot write its lock file '" + lock.string() + "': " + std::strerror(errno));
      held_.push_back({flag, lock.string(), fd});
      return;
    }
    ::close(fd);
    if (attempt == 100) fail("its lock file '" + lock.string() + "' keeps being replaced");
  }
}

OutputLocks::~OutputLocks() {
  for (const Held& h : held_) {
    ::unlink(h.lock_path.c_str());  // while still locked: nobody can take a lock on it in between
    ::close(h.fd);
  }
}

}  // namespace amp::launch
