// autocast: a region in which ops cast their inputs per their policy (runtime/ops/autocast_policy.h),
// like torch.autocast(device_type, dtype, enabled, cache_enabled). A region applies to the ops whose
// inputs live on its device type; each device type has its own state and default dtype (CUDA:
// float16, CPU: bfloat16). Thread-local; regions nest and restore what they found; leaving the
// outermost region clears the cast cache. As PyTorch's, what a region is not given it keeps from the
// regions around it: its dtype (get_autocast_dtype), the cache setting, and the cast lists.
#pragma once
#include <optional>
#include <vector>

#include "runtime/core/device.h"
#include "runtime/core/dtype.h"
#include "runtime/core/tensor.h"

namespace amp {

// Which op lists a region casts by. PyTorch's CPU lists differ from its CUDA ones (softmax, exp,
// log, pow and sum are fp32 ops on CUDA and run in the region's dtype on the CPU). `cuda` makes a CPU
// region cast exactly as a CUDA one, so that a CPU run computes in the dtypes a GPU run does:
// amp_train uses it, and the CPU backend then stands in for the GPU number for number.
enum class CastLists : uint8_t { of_device_type, cuda };

class autocast {
 public:
  explicit autocast(DeviceType device_type, std::optional<DType> dtype = std::nullopt, bool enabled = true,
                    std::optional<bool> cache_enabled = std::nullopt, std::optional<CastLists> lists = std::nullopt);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  DeviceType device_type_;
  bool prev_enabled_;
  DType prev_dtype_;
  CastLists prev_lists_;
  bool prev_cache_enabled_;
};

// Inside an enabled autocast region: the region's cast of params[i] is casts[i] (its values, already
// rounded from it, as Optimizer::low_precision_copies() are), in place of a cast made at the
// parameter's first use; gradients reach the parameter as through cast(). Each parameter must be a
// float32 leaf that requires grad, each cast of the region's dtype. With the cache disabled, nothing
// is provided (every use casts). Throws std::invalid_argument outside a region of the parameters'
// device type, or for a cast whose dtype, shape or device cannot be its parameter's. The casts are
// used as they are, not copied: a graph that outlives the next optimizer step reads the new copies.
void autocast_provide_casts(const std::vector<Tensor>& params, const std::vector<Tensor>& casts);

bool is_autocast_enabled(DeviceType device_type);
DType get_autocast_dtype(DeviceType device_type);
bool is_autocast_cache_enabled();
// Number of cached casts of fp32 parameters in the current region (for tests and diagnostics).
size_t autocast_cache_size();
void clear_autocast_cache();

}  // namespace amp
