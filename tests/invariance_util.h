// What the bitwise tests compare (test_rank_invariance.cpp, test_zero.cpp): amp_train under mpirun
// over shared memory or TCP, its metrics without the figures that may differ between equal runs
// (times, bytes sent, the emulated GPU's counts of work), and its saved weights' bytes.
#pragma once
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"

namespace amp::invariance {

using namespace cli;

// mpirun with R ranks, over shared memory, or over TCP on the loopback with the shared-memory
// all-reduce off (AMP_COMM_SHM=0: MPI's own transport carries every byte).
inline std::string launcher(int ranks, bool tcp = false) {
  return std::string(
             "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ASAN_OPTIONS=detect_leaks=0 timeout 300 "
             "mpirun --oversubscribe -np ") +
         std::to_string(ranks) + (tcp ? " --mca btl self,tcp --mca btl_tcp_if_include lo -x AMP_COMM_SHM=0" : "");
}

// Every record of a metrics file without its timing, the bytes sent (they grow with the ranks), the
// emulated GPU's counts of work (a split into more micro-batches launches more kernels) and the
// device memory held (the buckets and the micro-batches' activations move with the split): what must
// be identical.
inline std::vector<std::string> records_of(const std::string& metrics) {
  std::vector<std::string> out;
  for (auto r : read_jsonl(metrics)) {
    for (const char* k : {"step_ms", "comm_bytes", "device_launches", "device_host_syncs", "device_d2h_copies", "device_graph_launches",
                          "device_graph_ops", "device_allocations", "device_memory_bytes"})
      r.erase(k);
    out.push_back(r.dump());
  }
  return out;
}

// The step records and the last record (the end): what a resumed run must reproduce (the first
// part's run ends with its own evaluation and end record in the middle of the file).
inline std::vector<std::string> steps_and_end(const std::string& metrics) {
  std::vector<std::string> out;
  const auto all = records_of(metrics);
  for (const std::string& r : all)
    if (r.find("\"event\"") == std::string::npos) out.push_back(r);
  if (!all.empty()) out.push_back(all.back());
  return out;
}

inline std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct Outcome {
  std::vector<std::string> records;
  std::string weights;
};

// amp_train on R ranks with K = M / R micro-batches (M the micro-batches of a step over all ranks).
inline Outcome train(const TempDir& d, const std::string& args, int ranks, int64_t M, bool tcp = false) {
  const std::string tag = std::to_string(ranks) + (tcp ? "tcp" : "shm");
  const std::string metrics = d.file("m" + tag + ".jsonl"), weights = d.file("w" + tag + ".safetensors");
  const RunResult r = run(args + " --log-every 0 --threads 1 --micro-batches " + std::to_string(M / ranks) +
                              " --metrics " + metrics + " --save-weights " + weights,
                          launcher(ranks, tcp));
  EXPECT_EQ(r.code, 0) << r.out;
  return {records_of(metrics), bytes_of(weights)};
}

// The run on each rank count in `ranks` equals the first one's, bit for bit; returns the first.
inline Outcome expect_invariant(const std::string& args, int64_t M, const std::vector<int>& ranks, bool tcp = false) {
  TempDir d;
  const Outcome first = train(d, args, ranks.at(0), M, tcp);
  EXPECT_GE(first.records.size(), 3u);
  EXPECT_FALSE(first.weights.empty());
  for (size_t i = 1; i < ranks.size(); ++i) {
    SCOPED_TRACE(std::to_string(ranks[i]) + " ranks against " + std::to_string(ranks[0]) + (tcp ? " (TCP)" : ""));
    const Outcome other = train(d, args, ranks[i], M, tcp);
    EXPECT_EQ(first.records, other.records);
    EXPECT_TRUE(first.weights == other.weights) << "the saved weights differ";
  }
  return first;
}

}  // namespace amp::invariance
