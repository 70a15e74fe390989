// Running amp_train as users do, for the CLI suites: a clean environment, mpirun, a scratch
// directory, and the metrics file.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace amp::cli {

// Runs a shell command; its stdout and stderr (the command redirects), and its wait status.
inline std::string capture(const std::string& cmd, int* status = nullptr) {
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  if (status) *status = st;
  return out;
}

struct RunResult {
  int code;
  std::string out;
};

// Runs amp_train in a clean environment, so that nothing of the caller's (mpirun's variables when
// CTest runs under a launcher, OpenMP settings) changes what the child does.
// Under mpirun a rank left waiting (a missing event wait, a peer that failed) fails in seconds: the
// communication timeout is 20 s unless args set one.
inline RunResult run(const std::string& args, const std::string& prefix = "") {
  const bool short_timeout =
      prefix.find("mpirun") != std::string::npos && args.find("--comm-timeout") == std::string::npos;
  const std::string cmd = "env -i PATH=\"$PATH\" HOME=\"$HOME\" ${OMPI_MCA_orte_tmpdir_base+OMPI_MCA_orte_tmpdir_base=\"$OMPI_MCA_orte_tmpdir_base\"} " + prefix + " " + AMP_TRAIN_BIN + " " + args +
                          (short_timeout ? " --comm-timeout 20" : "") + " 2>&1";
  int status = 0;
  std::string out = capture(cmd, &status);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// amp_train under mpirun. Open MPI leaks by design, so a sanitizer build must not turn that into
// an exit code (the multi-rank suites run the same way, see tests/CMakeLists.txt).
inline const char* const kMpirun =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ASAN_OPTIONS=detect_leaks=0 timeout 120 "
    "mpirun -np 2 --oversubscribe";

// A pid that no process has now: a child that has exited and been reaped.
inline pid_t gone_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

// A scratch directory for one test, removed with everything in it.
struct TempDir {
  std::filesystem::path path = std::filesystem::temp_directory_path() / ("amp_cli_" + std::to_string(::getpid()));
  TempDir() { std::filesystem::create_directories(path); }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& n) const { return (path / n).string(); }
};

// The records of a metrics file.
inline std::vector<nlohmann::ordered_json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::ordered_json> v;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) v.push_back(nlohmann::ordered_json::parse(line));
  return v;
}

// Runs a bash script in d, with $AMP naming amp_train; its output.
inline std::string shell(const std::string& script, const TempDir& d) {
  const std::string cmd = "cd " + d.path.string() + " && env -i PATH=\"$PATH\" HOME=\"$HOME\" ${OMPI_MCA_orte_tmpdir_base+OMPI_MCA_orte_tmpdir_base=\"$OMPI_MCA_orte_tmpdir_base\"} AMP=" + AMP_TRAIN_BIN +
                          " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ASAN_OPTIONS=detect_leaks=0 "
                          "timeout 120 bash -c '" + script + "' 2>&1";
  return capture(cmd);
}

}  // namespace amp::cli
