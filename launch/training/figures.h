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

// Why a loss scale can train nothing more, or "": its float32 inverse, which unscales the gradients
// (amp_math.h inverse_scale), is not finite (below about 2.9e-39 every gradient unscales to inf or
// NaN, and every step is skipped); or, under fp16, it is below 2^-24, fp16's smallest subnormal,
// where every scaled gradient under 1 flushes to zero (nothing trains, nothing is skipped). The
// bounds that --init-scale is held to.
inline std::string scale_collapse(double scale, bool fp16) {
  if (!std::isfinite(static_cast<float>(1.0 / static_cast<double>(static_cast<float>(scale)))))
    return "whose inverse is not finite in float32";
  if (fp16 && scale < 0x1p-24)
    return "below 2^-24, fp16's smallest subnormal, where every scaled gradient under 1 flushes to zero";
  return "";
}

}  // namespace amp::launch
