// The emulated GPU's launch log (launch_log.h).
#include "launch_log.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

#include "emu.h"

namespace amp::emu {

namespace {

thread_local DeclaredCost t_declared;

struct Log {
  std::mutex m;
  std::FILE* file = nullptr;
  std::map<const void*, int> streams;  // stream handle -> its number in the log (0: the legacy stream)
  Log() {
    const char* path = std::getenv("AMP_EMU_LAUNCH_LOG");
    if (path == nullptr || *path == '\0') return;
    std::string name = path;
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr) rank = std::getenv("PMI_RANK");
    if (rank != nullptr && std::string(rank) != "0") name += std::string(".rank") + rank;
    file = std::fopen(name.c_str(), "w");
    if (file == nullptr) std::fprintf(stderr, "emulated GPU: AMP_EMU_LAUNCH_LOG: cannot write %s\n", name.c_str());
    streams.emplace(nullptr, 0);
  }
};

Log& log() {
  static Log* l = new Log;  // never destroyed: operations may be logged during exit
  return *l;
}

}  // namespace

bool launch_log_on() { return log().file != nullptr; }

void declare_cost(int64_t bytes_read, int64_t bytes_written, int64_t flops) {
  t_declared = DeclaredCost{bytes_read, bytes_written, flops, true};
}

DeclaredCost take_declared_cost() {
  const DeclaredCost c = t_declared;
  t_declared = DeclaredCost{};
  return c;
}

void log_line(const char* op, const std::string& fields, cudaStream_t stream, bool with_stream) {
  Log& l = log();
  if (l.file == nullptr) return;
  std::lock_guard<std::mutex> lock(l.m);
  std::string line = std::string("{\"op\":\"") + op + "\"" + fields;
  if (with_stream) {
    const auto it = l.streams.emplace(stream, static_cast<int>(l.streams.size())).first;
    line += ",\"stream\":" + std::to_string(it->second);
  }
  line += "}\n";
  std::fwrite(line.data(), 1, line.size(), l.file);
  if (!with_stream) std::fflush(l.file);  // a step's end: the file is whole up to here
}

void log_step_begin(int64_t step) { log_line("step_begin", ",\"step\":" + std::to_string(step), nullptr, false); }

void log_step(int64_t step, size_t peak_bytes) {
  log_line("step", ",\"step\":" + std::to_string(step) + ",\"peak_bytes\":" + std::to_string(peak_bytes), nullptr,
           false);
}

}  // namespace amp::emu
