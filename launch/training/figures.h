// The trainer's checks and formatting of its figures, shared by the loop (trainer.cpp) and resume.
#pragma once
#include <cmath>
#include <cstdio>
#include <string>

namespace amp::launch {

// A number for the progress line: "nan" and "inf" as PyTorch prints them, never "-nan".
inline std::string number_str(double v) {
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// True when the scale's float32 inverse, which unscales the gradients (amp_math.h inverse_scale), is
// not finite: below about 2.9e-39 every gradient unscales to inf or NaN, and every step is skipped.
inline bool scale_collapsed(double scale) {
  return !std::isfinite(static_cast<float>(1.0 / static_cast<double>(static_cast<float>(scale))));
}

}  // namespace amp::launch
