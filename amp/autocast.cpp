#include "amp/autocast.h"

#include <array>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {

struct CachedCast {
  Tensor source;  // kept alive so that its address cannot be reused within the region
  Tensor cast;
};

struct DeviceState {
  bool enabled = false;
  DType dtype;
  CastLists lists = CastLists::of_device_type;
};

struct AutocastState {
  DeviceState cuda{false, DType::f16, CastLists::of_device_type};
  DeviceState cpu{false, DType::bf16, CastLists::of_device_type};
  bool cache_enabled = true;
  int depth = 0;
  // (fp32 leaf parameter, target dtype) -> its cast: a bf16 region nested in an fp16 one gets its own.
  std::map<std::pair<const TensorImpl*, DType>, CachedCast> cache;
  DeviceState& of(DeviceType t) { return t == DeviceType::cuda ? cuda : cpu; }
};

thread_local AutocastState t_state;

// Floating, not float64, and on the region's device type (PyTorch's is_autocast_eligible).
bool eligible(const Tensor& t, DeviceType device_type) {
  return t.defined() && is_floating(t.dtype()) && t.dtype() != DType::f64 && t.device().type == device_type;
}

Tensor cast_to(const Tensor& t, DType dtype, DType region_dtype) {
  if (t.dtype() == dtype) return t;
  // A parameter (fp32 leaf that requires grad) cast to the region's dtype is cast once per region.
  const bool cacheable = t_state.cache_enabled && dtype == region_dtype && t.is_leaf() && t.requires_grad() &&
                         t.dtype() == DType::f32;
  if (!cacheable) return cast(t, dtype);
  const auto key = std::make_pair(static_cast<const TensorImpl*>(t.impl()), dtype);
  auto it = t_state.cache.find(key);
  if (it != t_state.cache.end()) return it->second.cast;
  Tensor c = cast(t, dtype);
  t_state.cache.emplace(key, CachedCast{t, c});
  return c;
}

// Floating, not float64 (PyTorch's is_autocast_eligible, for a dtype on the region's device type).
bool eligible_dtype(DType dtype) { return is_floating(dtype) && dtype != DType::f64; }

// What op casts its eligible inputs on device type t to, or nullopt when it leaves them (autocast off
// there, or a passthrough op). A promote op (PyTorch's promote_type) starts from the region's dtype;
// fp32 wins; fp64 inputs are ignored (and left as they are); a float16 input in a bfloat16 region
// (PyTorch raises) promotes to fp32. dtypes: the op's inputs', eligible or not.
std::optional<DType> target(OpKind op, DeviceType t, const DType* dtypes, size_t n) {
  const DeviceState& st = t_state.of(t);
  if (!st.enabled) return std::nullopt;
  switch (cast_policy(op, st.lists == CastLists::cuda ? DeviceType::cuda : t)) {
    case CastPolicy::lower_precision: return st.dtype;
    case CastPolicy::fp32: return DType::f32;
    case CastPolicy::promote: {
      DType to = st.dtype;
      for (size_t i = 0; i < n; ++i)
        if (eligible_dtype(dtypes[i])) to = promote_types(to, dtypes[i]);
      return to;
    }
    case CastPolicy::passthrough: return std::nullopt;
  }
  return std::nullopt;
}

void cast_inputs(OpKind op, Tensor* const* inputs, size_t n) {
  // The op's device type is its inputs' (PyTorch dispatches on them the same way).
  const Tensor* first = nullptr;
  for (size_t i = 0; i < n && first == nullptr; ++i)
    if (inputs[i]->defined()) first = inputs[i];
  if (first == nullptr) return;
  const DeviceType device_type = first->device().type;
  std::array<DType, 8> few;  // every op has fewer inputs: no allocation on the hot path
  std::vector<DType> many;
  DType* dtypes = n <= few.size() ? few.data() : (many.resize(n), many.data());
  size_t m = 0;
  for (size_t i = 0; i < n; ++i)
    if (eligible(*inputs[i], device_type)) dtypes[m++] = inputs[i]->dtype();
  const std::optional<DType> to = target(op, device_type, dtypes, m);
  if (!to) return;
  const DType region = t_state.of(device_type).dtype;
  for (size_t i = 0; i < n; ++i)
    if (eligible(*inputs[i], device_type)) *inputs[i] = cast_to(*inputs[i], *to, region);
}

DType cast_dtype(OpKind op, DType dtype, DeviceType t, const DType* dtypes, size_t n) {
  if (!eligible_dtype(dtype)) return dtype;
  return target(op, t, dtypes, n).value_or(dtype);
}

constexpr AutocastHooks kHooks{&cast_inputs, &cast_dtype};

bool any_enabled() { return t_state.cuda.enabled || t_state.cpu.enabled; }

}  // namespace

autocast::autocast(DeviceType device_type, std::optional<DType> dtype, bool enabled, std::optional<bool> cache_enabled,
                   std::optional<CastLists> lists)
    : device_type_(device_type) {
  DeviceState& st = t_state.of(device_type);
  // No dtype: the one in force (the enclosing region's; outside any, the device type's default), as
  // torch.autocast's dtype=None. A bf16 region re-entered after an enabled=False one stays bf16.
  const DType d = dtype.value_or(st.dtype);
  if (enabled && d != DType::f16 && d != DType::bf16)
    throw std::invalid_argument(std::string("autocast: dtype must be float16 or bfloat16, got ") + dtype_name(d));
  prev_enabled_ = st.enabled;
  prev_dtype_ = st.dtype;
  prev_lists_ = st.lists;
  prev_cache_enabled_ = t_state.cache_enabled;
  st.enabled = enabled;
  if (d == DType::f16 || d == DType::bf16) st.dtype = d;  // a disabled region given float32 leaves it
  st.lists = lists.value_or(st.lists);
  t_state.cache_enabled = cache_enabled.value_or(t_state.cache_enabled);
  ++t_state.depth;
  set_autocast_hook(any_enabled() ? &kHooks : nullptr);
}

autocast::~autocast() {
  DeviceState& st = t_state.of(device_type_);
  st.enabled = prev_enabled_;
  st.dtype = prev_dtype_;
  st.lists = prev_lists_;
  t_state.cache_enabled = prev_cache_enabled_;
  set_autocast_hook(any_enabled() ? &kHooks : nullptr);
  if (--t_state.depth == 0) t_state.cache.clear();
}

void autocast_provide_casts(const std::vector<Tensor>& params, const std::vector<Tensor>& casts) {
  if (params.size() != casts.size())
    throw std::invalid_argument("autocast_provide_casts: " + std::to_string(casts.size()) + " casts for " +
                                std::to_string(params.size()) + " parameters");
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    const Tensor& c = casts[i];
    const DeviceState& st = t_state.of(p.device().type);
    if (!st.enabled)
      throw std::invalid_argument("autocast_provide_casts: not inside an enabled autocast region of device type " +
                                  p.device().str());
    if (c.dtype() != st.dtype)
      throw std::invalid_argument(std::string("autocast_provide_casts: cast ") + std::to_string(i) + " is " +
                                  dtype_name(c.dtype()) + ", the region's dtype is " + dtype_name(st.dtype));
    if (!p.is_leaf() || !p.requires_grad() || p.dtype() != DType::f32)
      throw std::invalid_argument("autocast_provide_casts: parameter " + std::to_string(i) +
                                  " is not a float32 leaf that requires grad");
    if (!t_state.cache_enabled) continue;
    const Tensor provided = cast_precomputed(p, c);  // checks shape and device
    t_state.cache.insert_or_assign(std::make_pair(static_cast<const TensorImpl*>(p.impl()), c.dtype()),
                                   CachedCast{p, provided});
  }
}

bool is_autocast_enabled(DeviceType device_type) { return t_state.of(device_type).enabled; }
DType get_autocast_dtype(DeviceType device_type) { return t_state.of(device_type).dtype; }
bool is_autocast_cache_enabled() { return t_state.cache_enabled; }
size_t autocast_cache_size() { return t_state.cache.size(); }
void clear_autocast_cache() { t_state.cache.clear(); }

}  // namespace amp
