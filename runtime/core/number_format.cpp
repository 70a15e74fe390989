#include "runtime/core/number_format.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace amp {

std::string float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0.0) return std::signbit(v) ? "-0.0" : "0.0";
  char buf[64];
  int digits = 1;
  for (; digits < 17; ++digits) {  // the fewest significant digits that round-trip
    std::snprintf(buf, sizeof buf, "%.*e", digits - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::snprintf(buf, sizeof buf, "%.*e", digits - 1, v);
  const int exponent = std::atoi(std::strchr(buf, 'e') + 1);
  if (exponent >= -4 && exponent < 16) {  // Python's switch to scientific notation
    const int decimals = digits - 1 - exponent > 0 ? digits - 1 - exponent : 0;
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
    std::string s = buf;
    if (s.find('.') == std::string::npos) s += ".0";
    return s;
  }
  std::string mantissa(buf, std::strchr(buf, 'e'));
  std::snprintf(buf, sizeof buf, "e%+03d", exponent);
  return mantissa + buf;
}

}  // namespace amp
