#include "runtime/core/dtype.h"

#include <stdexcept>

namespace amp {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::i64: return 8;
  }
  throw std::invalid_argument("unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f64: return "float64";
    case DType::i64: return "int64";
  }
  return "unknown";
}

const char* dtype_safetensors_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::f64: return "F64";
    case DType::i64: return "I64";
  }
  return "unknown";
}

bool dtype_from_safetensors_name(const std::string& s, DType* out) {
  static constexpr DType all[] = {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i64};
  for (DType t : all) {
    if (s == dtype_safetensors_name(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (a == DType::f64 || b == DType::f64) return DType::f64;
  if (a == DType::f32 || b == DType::f32) return DType::f32;
  if (a == DType::i64) return b;
  if (b == DType::i64) return a;
  return DType::f32;  // f16 with bf16 promotes to f32, as in PyTorch
}

DType result_type(DType a, bool a_is_0dim, DType b, bool b_is_0dim) {
  if (a_is_0dim == b_is_0dim) return promote_types(a, b);
  const DType dimensioned = a_is_0dim ? b : a;
  const DType zero_dim = a_is_0dim ? a : b;
  // Categories: a floating 0-dim tensor outranks an integer dimensioned one; nothing else does.
  return !is_floating(dimensioned) && is_floating(zero_dim) ? zero_dim : dimensioned;
}

}  // namespace amp
