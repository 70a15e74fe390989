// Runs a generic lambda once per floating storage type, on either backend:
//   dispatch_float(dtype, [&](auto tag) { using T = decltype(tag); ... });
// A lambda rather than a macro, so that OpenMP pragmas and device launches may appear inside.
#pragma once
#include <stdexcept>
#include <string>

#include "runtime/core/dtype.h"

namespace amp {

template <class F>
void dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::f32: f(float{}); return;
    case DType::f64: f(double{}); return;
    case DType::f16: f(Half{}); return;
    case DType::bf16: f(BFloat16{}); return;
    default: throw std::invalid_argument(std::string("expected a floating dtype, got ") + dtype_name(t));
  }
}

// The element type of an optimizer step's low-precision parameter copies (Backend::sgd_step):
// NoCopy for DType::f32 (no copies), else Half or BFloat16.
struct NoCopy {};
template <class F>
void dispatch_copies(DType t, F&& f) {
  switch (t) {
    case DType::f32: f(NoCopy{}); return;
    case DType::f16: f(Half{}); return;
    case DType::bf16: f(BFloat16{}); return;
    default: throw std::invalid_argument(std::string("low-precision copies must be float16 or bfloat16, got ") +
                                         dtype_name(t));
  }
}

}  // namespace amp
