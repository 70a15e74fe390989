// A seeded generator over the counter-based stream of rng_math.h. Each fill takes the next numel()
// counters, so a seed gives the same numbers on any backend and any thread count.
#pragma once
#include <cstdint>

#include "runtime/core/tensor.h"

namespace amp {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  // Reserves n counters and returns the first.
  uint64_t advance(uint64_t n) {
    const uint64_t first = offset_;
    offset_ += n;
    return first;
  }

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
};

void uniform_(Tensor& t, double lo, double hi, Generator& gen);
void normal_(Tensor& t, double mean, double std, Generator& gen);
Tensor rand_uniform(const Shape& shape, double lo, double hi, Generator& gen, DType dtype = DType::f32,
                    Device device = kCPU);
Tensor randn(const Shape& shape, Generator& gen, DType dtype = DType::f32, Device device = kCPU);

}  // namespace amp
