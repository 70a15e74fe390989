#include "runtime/ops/random.h"

#include "runtime/kernels/backend.h"

namespace amp {

void uniform_(Tensor& t, double lo, double hi, Generator& gen) {
  backend_for(t.device()).fill_uniform(t, gen.seed(), gen.advance(static_cast<uint64_t>(t.numel())), lo, hi);
}

void normal_(Tensor& t, double mean, double std, Generator& gen) {
  backend_for(t.device()).fill_normal(t, gen.seed(), gen.advance(static_cast<uint64_t>(t.numel())), mean, std);
}

Tensor rand_uniform(const Shape& shape, double lo, double hi, Generator& gen, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  uniform_(t, lo, hi, gen);
  return t;
}

Tensor randn(const Shape& shape, Generator& gen, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  normal_(t, 0.0, 1.0, gen);
  return t;
}

}  // namespace amp
