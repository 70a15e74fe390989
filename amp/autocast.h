// autocast: a region in which ops cast their inputs per their policy (runtime/autocast_policy.h),
// like torch.autocast. Thread-local; regions nest; leaving the outermost region clears the cast cache.
#pragma once
#include "runtime/dtype.h"

namespace amp {

class autocast {
 public:
  explicit autocast(DType dtype = DType::f16, bool enabled = true);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
};

bool is_autocast_enabled();
DType get_autocast_dtype();
// Number of cached casts of fp32 parameters in the current region (for tests and diagnostics).
size_t autocast_cache_size();
void clear_autocast_cache();

}  // namespace amp
