#include "runtime/ops/autocast_policy.h"

#include <atomic>
#include <vector>

namespace amp {

namespace {
thread_local AutocastHook t_hook = nullptr;
}

AutocastHook autocast_hook() { return t_hook; }
void set_autocast_hook(AutocastHook h) { t_hook = h; }

const char* op_name(OpKind op) {
  switch (op) {
#define AMP_OP_NAME(op, cuda_policy, cpu_policy) \
  case OpKind::op:              \
    return #op;
    AMP_FOR_EACH_OP_POLICY(AMP_OP_NAME)
#undef AMP_OP_NAME
  }
  return "unknown";
}

void autocast_inputs(OpKind op, std::initializer_list<Tensor*> inputs) {
  if (t_hook == nullptr) return;
  std::vector<Tensor*> v(inputs);
  t_hook->cast(op, v.data(), v.size());
}

DType autocast_dtype(OpKind op, DType dtype, DeviceType t, std::initializer_list<DType> others) {
  if (t_hook == nullptr) return dtype;
  std::vector<DType> all = {dtype};
  all.insert(all.end(), others.begin(), others.end());
  return t_hook->dtype(op, dtype, t, all.data(), all.size());
}

namespace {
std::atomic<bool> g_fp32_weight_grads{true};
}  // namespace

void set_fp32_weight_grads(bool enabled) { g_fp32_weight_grads.store(enabled); }
bool fp32_weight_grads() { return g_fp32_weight_grads.load(std::memory_order_relaxed); }

}  // namespace amp
