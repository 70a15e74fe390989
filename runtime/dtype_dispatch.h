// Runs a generic lambda once per floating storage type, on either backend:
//   dispatch_float(dtype, [&](auto tag) { using T = decltype(tag); ... });
// A lambda rather than a macro, so that OpenMP pragmas and device launches may appear inside.
#pragma once
#include <stdexcept>
#include <string>

#include "runtime/dtype.h"

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

}  // namespace amp
