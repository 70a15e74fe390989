#include "amp/autocast.h"

#include <stdexcept>
#include <map>
#include <utility>

#include "runtime/autocast_policy.h"
#include "runtime/ops.h"

namespace amp {

namespace {

struct CachedCast {
  Tensor source;  // kept alive so that its address cannot be reused within the region
  Tensor cast;
};

struct AutocastState {
  bool enabled = false;
  DType dtype = DType::f16;
  int depth = 0;
  // (fp32 leaf parameter, target dtype) -> its cast: a bf16 region nested in an fp16 one gets its own.
  std::map<std::pair<const TensorImpl*, DType>, CachedCast> cache;
};

thread_local AutocastState t_state;

bool eligible(const Tensor& t) { return t.defined() && is_floating(t.dtype()) && t.dtype() != DType::f64; }

Tensor cast_to(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  // A parameter (fp32 leaf that requires grad) is cast once per region and reused.
  const bool cacheable = dtype == t_state.dtype && t.is_leaf() && t.requires_grad() && t.dtype() == DType::f32;
  if (!cacheable) return cast(t, dtype);
  const auto key = std::make_pair(static_cast<const TensorImpl*>(t.impl()), dtype);
  auto it = t_state.cache.find(key);
  if (it != t_state.cache.end()) return it->second.cast;
  Tensor c = cast(t, dtype);
  t_state.cache.emplace(key, CachedCast{t, c});
  return c;
}

void hook(OpKind, CastPolicy policy, Tensor* const* inputs, size_t n) {
  switch (policy) {
    case CastPolicy::lower_precision:
      for (size_t i = 0; i < n; ++i)
        if (eligible(*inputs[i])) *inputs[i] = cast_to(*inputs[i], t_state.dtype);
      break;
    case CastPolicy::fp32:
      for (size_t i = 0; i < n; ++i)
        if (eligible(*inputs[i])) *inputs[i] = cast_to(*inputs[i], DType::f32);
      break;
    case CastPolicy::promote: {
      bool any = false;
      DType widest = DType::f16;
      for (size_t i = 0; i < n; ++i) {
        const Tensor& t = *inputs[i];
        if (!t.defined() || !is_floating(t.dtype())) continue;
        widest = any ? promote_types(widest, t.dtype()) : t.dtype();
        any = true;
      }
      for (size_t i = 0; i < n; ++i)
        if (inputs[i]->defined() && is_floating(inputs[i]->dtype())) *inputs[i] = inputs[i]->to(widest);
      break;
    }
    case CastPolicy::passthrough:
      break;
  }
}

}  // namespace

autocast::autocast(DType dtype, bool enabled) : prev_enabled_(t_state.enabled), prev_dtype_(t_state.dtype) {
  if (enabled && dtype != DType::f16 && dtype != DType::bf16)
    throw std::invalid_argument(std::string("autocast: dtype must be float16 or bfloat16, got ") + dtype_name(dtype));
  t_state.enabled = enabled;
  t_state.dtype = dtype;
  ++t_state.depth;
  set_autocast_hook(enabled ? &hook : nullptr);
}

autocast::~autocast() {
  t_state.enabled = prev_enabled_;
  t_state.dtype = prev_dtype_;
  set_autocast_hook(prev_enabled_ ? &hook : nullptr);
  if (--t_state.depth == 0) t_state.cache.clear();
}

bool is_autocast_enabled() { return t_state.enabled; }
DType get_autocast_dtype() { return t_state.dtype; }
size_t autocast_cache_size() { return t_state.cache.size(); }
void clear_autocast_cache() { t_state.cache.clear(); }

}  // namespace amp
