#include <omp.h>

#include <stdexcept>
#include <string>

#include "runtime/kernels/cpu/threads.h"

namespace amp {

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("thread count must be >= 1, got " + std::to_string(n));
  omp_set_num_threads(n);
}

int get_num_threads() { return omp_get_max_threads(); }

}  // namespace amp
