#include "launch/training/output_path.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <system_error>

#include "runtime/core/file_kind.h"
#include "runtime/core/safetensors.h"

namespace amp::launch {

void check_output_path(const char* flag, const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(flag) + ": '" + path + "': " + why);
  };
  std::error_code ec;
  const fs::path target = written_through(path);  // a dangling link: the file it names, to be created
  if (fs::is_symlink(target, ec)) fail("is a symbolic link that does not resolve (a loop, or links unreadable)");
  const fs::file_status st = fs::status(target, ec);
  if (fs::exists(st)) {
    if (fs::is_directory(st)) fail("is a directory; give a file name");
    if (const std::string kind = irregular_file(st); !kind.empty()) fail("exists and is " + kind);
    if (::access(target.c_str(), W_OK) != 0) fail("exists and is not writable");
  }
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::is_directory(dir, ec))
    fail(fs::exists(dir, ec) ? "'" + dir.string() + "' is not a directory" : "the directory '" + dir.string() + "' does not exist");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) fail("the directory '" + dir.string() + "' is not writable");
}

bool writer_is_gone(const std::string& pid) {
  if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) return false;
  if (::kill(static_cast<pid_t>(std::stol(pid)), 0) != 0) return errno == ESRCH;  // not ours (EPERM): kept
  // A zombie answers kill() but writes nothing: killed, with nobody to reap it yet (timeout -s KILL
  // kills itself with its child; a container's PID 1 may reap late). /proc/PID/stat: "PID (comm) S ...".
  std::ifstream stat("/proc/" + pid + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

std::vector<std::string> remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  if (path.empty()) return removed;
  std::error_code ec;
  const fs::path target = written_through(path);  // save() writes beside the target
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  const std::string prefix = target.filename().string() + safetensors::kTemporaryInfix;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    if (!writer_is_gone(name.substr(prefix.size()))) continue;
    if (it->is_regular_file(ec) && fs::remove(it->path(), ec)) removed.push_back(it->path().string());
  }
  return removed;
}

}  // namespace amp::launch
