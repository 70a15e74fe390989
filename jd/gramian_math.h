// Host-side helpers of the Gramian-based aggregators: values rounded to a dtype as each torch op in
// that dtype would round them, and the normalized, regularized Gramian of TorchJD's projector.
#pragma once
#include <vector>

#include "runtime/core/dtype.h"

namespace amp::jd {

// x rounded to dtype (float32 or float64; each float32 op is computed in float64 and rounded once,
// which gives the float32 result exactly for +, -, *, / and sqrt).
inline double round_to(double x, DType dtype) { return dtype == DType::f32 ? static_cast<double>(static_cast<float>(x)) : x; }

// TorchJD's projector input: t = trace(G); Ĝ = t < norm_eps ? 0 : G / t; G̃ = Ĝ + reg_eps I, in
// dtype; then in float64 with the upper triangle mirrored (quadprog reads only that triangle).
std::vector<double> regularized_gramian(const std::vector<double>& G, int m, DType dtype, double norm_eps, double reg_eps);

bool all_finite(const std::vector<double>& v);

// The preference vector: p (rounded to dtype), or 1/m each when empty. Throws if p's length is not m.
std::vector<double> preference(const std::vector<double>& p, int m, DType dtype);

}  // namespace amp::jd
