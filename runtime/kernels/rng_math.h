// Counter-based random numbers: element i of a fill uses counter (offset + i) only, so the result
// is the same on any backend and any number of threads.
#pragma once
#include <cmath>
#include <cstdint>

#include "runtime/core/hd.h"

namespace amp::math {

AMP_HD uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
AMP_HD uint64_t random_bits(uint64_t seed, uint64_t counter) {
  return mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ (counter * 0xd1342543de82ef95ull + 0x2545f4914f6cdd1dull));
}
// Uniform in [0, 1) with 53 random bits.
AMP_HD double uniform01(uint64_t seed, uint64_t counter) {
  return static_cast<double>(random_bits(seed, counter) >> 11) * 0x1.0p-53;
}
// Standard normal by Box-Muller on the two 32-bit halves of one counter's bits.
AMP_HD double standard_normal(uint64_t seed, uint64_t counter) {
  const uint64_t r = random_bits(seed, counter);
  const double u1 = (static_cast<double>(r >> 32) + 1.0) * 0x1.0p-32;  // (0, 1]
  const double u2 = static_cast<double>(r & 0xffffffffull) * 0x1.0p-32;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace amp::math
