// Each op's autocast cast policy (DESIGN §5), as one table, and the seam through which amp/'s
// autocast casts an op's inputs. runtime/ only declares the policy; amp/autocast.cpp installs the hook.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "runtime/tensor.h"

namespace amp {

enum class CastPolicy : uint8_t {
  lower_precision,  // inputs go to the autocast dtype (fp16/bf16)
  fp32,             // inputs go to fp32
  promote,          // inputs go to the widest input dtype
  passthrough,      // run in the input dtype
};

// X(op, policy): adding an op to a category is a one-line change.
#define AMP_FOR_EACH_OP_POLICY(X)   \
  X(linear, lower_precision)        \
  X(matmul, lower_precision)        \
  X(mse_loss, fp32)                 \
  X(cross_entropy, fp32)            \
  X(nll_loss, fp32)                 \
  X(softmax, fp32)                  \
  X(log_softmax, fp32)              \
  X(exp, fp32)                      \
  X(log, fp32)                      \
  X(pow, fp32)                      \
  X(sum, fp32)                      \
  X(norm, fp32)                     \
  X(add, promote)                   \
  X(sub, promote)                   \
  X(mul, promote)                   \
  X(div, promote)                   \
  X(relu, passthrough)              \
  X(gelu, passthrough)              \
  X(neg, passthrough)               \
  X(sqrt, passthrough)              \
  X(mean, passthrough)

enum class OpKind : uint8_t {
#define AMP_OP_ENUM(op, policy) op,
  AMP_FOR_EACH_OP_POLICY(AMP_OP_ENUM)
#undef AMP_OP_ENUM
};

constexpr CastPolicy cast_policy(OpKind op) {
  switch (op) {
#define AMP_OP_POLICY(op, policy) \
  case OpKind::op:                \
    return CastPolicy::policy;
    AMP_FOR_EACH_OP_POLICY(AMP_OP_POLICY)
#undef AMP_OP_POLICY
  }
  return CastPolicy::passthrough;
}
const char* op_name(OpKind op);

// Casts the op's floating inputs in place according to its policy. Null when autocast is off.
using AutocastHook = void (*)(OpKind op, CastPolicy policy, Tensor* const* inputs, size_t n);
AutocastHook autocast_hook();           // this thread's hook
void set_autocast_hook(AutocastHook h);  // amp/autocast.cpp uses this

// Applies the current thread's autocast to an op's inputs (no-op when autocast is off).
void autocast_inputs(OpKind op, std::initializer_list<Tensor*> inputs);

// Backward runs with autocast off (DESIGN §5): the engine holds one of these.
class AutocastSuspend {
 public:
  AutocastSuspend() : prev_(autocast_hook()) { set_autocast_hook(nullptr); }
  ~AutocastSuspend() { set_autocast_hook(prev_); }
  AutocastSuspend(const AutocastSuspend&) = delete;
  AutocastSuspend& operator=(const AutocastSuspend&) = delete;

 private:
  AutocastHook prev_;
};

}  // namespace amp
