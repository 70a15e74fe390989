// CPU loop helpers: the dtype dispatch shared with the CUDA backend, the parallel grain, and what
// every hot loop is built from (see "Hot loops" below): AMP_SIMD_CLONES, parallel_chunks, lane_sum,
// sum_of_chunks.
#pragma once
#include <omp.h>

#include <type_traits>
#include <vector>

#include "runtime/core/dtype_dispatch.h"

namespace amp::cpu {

using amp::dispatch_float;

// Below this many elements a loop runs on one thread: the fork/join would cost more.
inline constexpr long kParallelGrain = 1 << 15;

// Hot loops. The build is portable (x86-64's baseline, SSE2), so a loop the compiler vectorises
// there uses 4-wide SSE2 at best. A function marked AMP_SIMD_CLONES is also compiled for AVX2+FMA
// (x86-64-v3) and AVX-512 (x86-64-v4), and the loader picks the best one this CPU runs. The clones
// compute the same numbers: no reassociation is allowed (no -ffast-math), and -ffp-contract=off keeps
// FMA out. They vectorise only a plain serial loop over raw pointers whose coefficients are locals,
// so the pattern is: a cloned serial kernel over [0, n), and parallel_chunks() handing each thread
// one contiguous range of it. (A `#pragma omp parallel for` body is outlined into a function of
// its own, which is not cloned, and reads every captured coefficient through a pointer.)
// -DAMP_SIMD_CLONES=OFF (CMake) builds the baseline only: a control run for the clones' numbers.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && !defined(AMP_NO_SIMD_CLONES)
#define AMP_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define AMP_SIMD_CLONES
#endif

// body(begin, end) over [0, n): one contiguous range per thread, starts aligned to 64 (whole cache
// lines, whole vectors), or one call when n is at most `grain` (in elements: a loop over rows of C
// elements passes kParallelGrain / C).
template <class F>
void parallel_chunks(long n, F&& body, long grain = kParallelGrain) {
  if (n <= grain || omp_get_max_threads() == 1 || omp_in_parallel()) {
    if (n > 0) body(0L, n);
    return;
  }
#pragma omp parallel
  {
    const long nt = omp_get_num_threads(), t = omp_get_thread_num();
    const long per = (n + nt - 1) / nt;
    const long chunk = (per + 63) / 64 * 64;
    const long begin = t * chunk < n ? t * chunk : n;
    const long end = begin + chunk < n ? begin + chunk : n;
    if (begin < end) body(begin, end);
  }
}

// The sum over [0, n) of chunk_sum(begin, end) (a double) over fixed chunks of kParallelGrain, run in
// parallel and added in chunk order: the same bits on any thread count (an OpenMP reduction adds its
// threads' partial sums, which another count splits elsewhere). One chunk: one call, no fork.
template <class F>
double sum_of_chunks(long n, F&& chunk_sum) {
  const long chunks = (n + kParallelGrain - 1) / kParallelGrain;
  if (chunks <= 1) return n > 0 ? chunk_sum(0L, n) : 0.0;
  std::vector<double> part(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) if (omp_get_max_threads() > 1 && !omp_in_parallel())
  for (long c = 0; c < chunks; ++c)
    part[static_cast<size_t>(c)] = chunk_sum(c * kParallelGrain, c + 1 < chunks ? (c + 1) * kParallelGrain : n);
  double sum = 0.0;
  for (double s : part) sum += s;
  return sum;
}

// f(std::bool_constant<flags>...): run-time flags as template arguments, so that a kernel's loop has
// no branch on them (one instantiation per combination).
template <class F>
void with_flags(F&& f) {
  f();
}
template <class F, class... Rest>
void with_flags(F&& f, bool flag, Rest... rest) {
  if (flag) {
    with_flags([&](auto... later) { f(std::true_type{}, later...); }, rest...);
  } else {
    with_flags([&](auto... later) { f(std::false_type{}, later...); }, rest...);
  }
}

// The sum of term(i) over [0, n) in fp64, in 8 interleaved partial sums added in a fixed order: a
// loop the compiler vectorises without reassociating, so every clone gets the same result.
template <class F>
[[gnu::always_inline]] inline double lane_sum(long n, F term) {
  constexpr long kLanes = 8;
  double acc[kLanes] = {};
  long i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (long l = 0; l < kLanes; ++l) acc[l] += term(i + l);
  for (long l = 0; i < n; ++i, ++l) acc[l] += term(i);
  double sum = 0.0;
  for (long l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

}  // namespace amp::cpu
