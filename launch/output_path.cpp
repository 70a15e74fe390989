#include "launch/output_path.h"

#include <unistd.h>

#include <filesystem>
#include <stdexcept>
#include <system_error>

namespace amp::launch {

void check_output_path(const char* flag, const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(flag) + ": '" + path + "': " + why);
  };
  std::error_code ec;
  fs::path target = path;
  if (fs::is_symlink(target, ec)) {
    const fs::path resolved = fs::weakly_canonical(target, ec);
    if (ec) fail("cannot resolve the symbolic link: " + ec.message());
    target = resolved;
  }
  const fs::file_status st = fs::status(target, ec);
  if (fs::exists(st)) {
    if (fs::is_directory(st)) fail("is a directory; give a file name");
    if (!fs::is_regular_file(st)) fail("exists and is not a regular file (a device, FIFO or socket)");
    if (::access(target.c_str(), W_OK) != 0) fail("exists and is not writable");
  }
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::is_directory(dir, ec)) fail("the directory '" + dir.string() + "' does not exist");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) fail("the directory '" + dir.string() + "' is not writable");
}

}  // namespace amp::launch
