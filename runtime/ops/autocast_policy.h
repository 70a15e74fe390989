// Each op's autocast cast policy (docs/DESIGN.md §5), as one table, and the seam through which amp/'s
// autocast casts an op's inputs. runtime/ only declares the policy; amp/autocast.cpp installs the hook.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "runtime/core/tensor.h"

namespace amp {

enum class CastPolicy : uint8_t {
  lower_precision,  // inputs go to the region's dtype (fp16/bf16)
  fp32,             // inputs go to fp32
  promote,          // inputs go to the widest of the region's dtype and the inputs' (fp64 ignored)
  passthrough,      // run in the input dtype (ordinary type promotion, as outside autocast)
};

// X(op, CUDA policy, CPU policy): PyTorch's lists per device type (torch/csrc/autocast_mode.cpp).
// Ops on neither list run by ordinary type promotion: add, sub, mul and div are on no list.
// The CPU's fp32 list is short: softmax, exp, log, pow and sum run in bf16 under a CPU region,
// as in PyTorch.
#define AMP_FOR_EACH_OP_POLICY(X)                       \
  X(linear, lower_precision, lower_precision)           \
  X(matmul, lower_precision, lower_precision)           \
  X(mm, lower_precision, lower_precision)               \
  X(bmm, lower_precision, lower_precision)              \
  X(dot, promote, passthrough)                          \
  X(mse_loss, fp32, fp32)                               \
  X(cross_entropy, fp32, fp32)                          \
  X(nll_loss, fp32, fp32)                               \
  X(softmax, fp32, passthrough)                         \
  X(log_softmax, fp32, passthrough)                     \
  X(exp, fp32, passthrough)                             \
  X(log, fp32, passthrough)                             \
  X(pow, fp32, passthrough)                             \
  X(sum, fp32, passthrough)                             \
  X(norm, fp32, passthrough)                            \
  X(layer_norm, fp32, passthrough)                      \
  X(add, passthrough, passthrough)                      \
  X(sub, passthrough, passthrough)                      \
  X(mul, passthrough, passthrough)                      \
  X(div, passthrough, passthrough)                      \
  X(relu, passthrough, passthrough)                     \
  X(gelu, passthrough, passthrough)                     \
  X(neg, passthrough, passthrough)                      \
  X(sqrt, passthrough, passthrough)                     \
  X(mean, passthrough, passthrough)

enum class OpKind : uint8_t {
#define AMP_OP_ENUM(op, cuda_policy, cpu_policy) op,
  AMP_FOR_EACH_OP_POLICY(AMP_OP_ENUM)
#undef AMP_OP_ENUM
};

constexpr CastPolicy cast_policy(OpKind op, DeviceType device_type) {
  switch (op) {
#define AMP_OP_POLICY(op, cuda_policy, cpu_policy) \
  case OpKind::op:                                 \
    return device_type == DeviceType::cuda ? CastPolicy::cuda_policy : CastPolicy::cpu_policy;
    AMP_FOR_EACH_OP_POLICY(AMP_OP_POLICY)
#undef AMP_OP_POLICY
  }
  return CastPolicy::passthrough;
}
const char* op_name(OpKind op);

// The current thread's autocast, installed by amp/autocast.cpp; null when autocast is off on every
// device type. cast: casts the op's floating inputs in place per the policy of the device type they
// live on. dtype: what an input of `dtype` on device type t becomes under that same rule (PyTorch's
// get_autocast_dtype and promote_type, as a question: nothing is cast), `dtypes` the op's floating
// inputs for a promote op.
struct AutocastHooks {
  void (*cast)(OpKind op, Tensor* const* inputs, size_t n);
  DType (*dtype)(OpKind op, DType dtype, DeviceType t, const DType* dtypes, size_t n);
};
using AutocastHook = const AutocastHooks*;
AutocastHook autocast_hook();           // this thread's hooks
void set_autocast_hook(AutocastHook h);  // amp/autocast.cpp uses this

// Applies the current thread's autocast to an op's inputs (no-op when autocast is off).
void autocast_inputs(OpKind op, std::initializer_list<Tensor*> inputs);
// The dtype autocast_inputs(op, ...) would give an input of `dtype` on device type t, found without
// casting anything: `dtype` itself when autocast is off there, for passthrough ops and for inputs it
// leaves (float64). others: the op's other floating inputs' dtypes, which a promote op widens with.
DType autocast_dtype(OpKind op, DType dtype, DeviceType t, std::initializer_list<DType> others = {});

// Backward runs with autocast off (docs/DESIGN.md §5): the engine holds one of these.
class AutocastSuspend {
 public:
  AutocastSuspend() : prev_(autocast_hook()) { set_autocast_hook(nullptr); }
  ~AutocastSuspend() { set_autocast_hook(prev_); }
  AutocastSuspend(const AutocastSuspend&) = delete;
  AutocastSuspend& operator=(const AutocastSuspend&) = delete;

 private:
  AutocastHook prev_;
};

// Autocast's numbers where this runtime departs from PyTorch's: whether linear's backward makes the
// gradient of a bf16 weight cast from fp32 (autocast's copy of a parameter) in fp32, from the GEMM's
// accumulator, rather than as PyTorch does (rounded to bf16, then cast to fp32): one pass over the
// gradient less, and a more exact one. Process-wide, as PyTorch's numerics switches are
// (torch.backends.*.allow_tf32); on by default.
void set_fp32_weight_grads(bool enabled);
bool fp32_weight_grads();

}  // namespace amp
