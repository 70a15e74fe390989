// Timing helpers shared by the benchmark executables.
#pragma once
#include <algorithm>
#include <chrono>
#include <vector>

namespace amp::launch {

using BenchClock = std::chrono::steady_clock;

inline double ms_since(BenchClock::time_point t0) {
  return std::chrono::duration<double, std::milli>(BenchClock::now() - t0).count();
}

// The median of a run's timings: robust to the odd slow step on a shared machine.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace amp::launch
