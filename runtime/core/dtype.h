// Element types of tensors.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/core/half.h"

namespace amp {

enum class DType : uint8_t { f32, f16, bf16, f64, i64 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "float32", "float16", ...
// safetensors' names: "F32", "F16", "BF16", "F64", "I64".
const char* dtype_safetensors_name(DType t);
bool dtype_from_safetensors_name(const std::string& s, DType* out);
inline bool is_floating(DType t) { return t != DType::i64; }
inline bool is_reduced_float(DType t) { return t == DType::f16 || t == DType::bf16; }
// The wider of two floating dtypes, as PyTorch's type promotion picks it.
DType promote_types(DType a, DType b);
// The dtype of a binary op between tensors of dtypes a and b, as torch.result_type decides it: a
// 0-dim tensor ranks below a dimensioned one, so it decides the dtype only when its category
// (integer < floating) is higher. float16[N] * float32[] is float16; int64[N] * float32[] is float32.
DType result_type(DType a, bool a_is_0dim, DType b, bool b_is_0dim);

// Loads and stores between storage types and the compute type (float, or double for f64).
template <class S>
struct Elem;
template <>
struct Elem<float> {
  using Compute = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
template <>
struct Elem<double> {
  using Compute = double;
  static double load(double v) { return v; }
  static double store(double v) { return v; }
};
template <>
struct Elem<Half> {
  using Compute = float;
  static float load(Half v) { return f16_bits_to_f32(v.bits); }
  static Half store(float v) { return Half{f32_to_f16_bits(v)}; }
};
template <>
struct Elem<BFloat16> {
  using Compute = float;
  static float load(BFloat16 v) { return bf16_bits_to_f32(v.bits); }
  static BFloat16 store(float v) { return BFloat16{f32_to_bf16_bits(v)}; }
};

}  // namespace amp
