// Numbers as a person types them in a flag or a list: an optional sign and digits, and for a real
// number a decimal point and an exponent (3, -2, 0.5, .5, 2., 1e-3, 6.5E+4); nothing else. std::stod
// and std::stoll also took a leading space, a hexadecimal number (0x10 was 16 to stod, 0 and "x10"
// left over to stoll), "inf" and "nan".
#pragma once
#include <cstdint>
#include <string_view>

namespace amp {

enum class NumberError { none, malformed, out_of_range };

// A whole number: out_of_range beyond int64's range.
struct ParsedInteger {
  int64_t value = 0;
  NumberError error = NumberError::malformed;
};
ParsedInteger parse_integer(std::string_view text);

// A real number, the double nearest to it: out_of_range beyond double's range, or so small that it
// would read as 0 (1e-400); a subnormal reads as itself (the callers bound what they take).
struct ParsedReal {
  double value = 0.0;
  NumberError error = NumberError::malformed;
};
ParsedReal parse_real(std::string_view text);

}  // namespace amp
