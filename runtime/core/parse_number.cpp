#include "runtime/core/parse_number.h"

#include <charconv>
#include <system_error>

namespace amp {

namespace {
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Whether text is [sign] digits, and for a real number [sign] digits [. digits] [e [sign] digits]
// with a digit before or after the point.
bool well_formed(std::string_view s, bool real) {
  size_t i = !s.empty() && (s[0] == '-' || s[0] == '+') ? 1 : 0, digits = 0;
  for (; i < s.size() && is_digit(s[i]); ++i) ++digits;
  if (real && i < s.size() && s[i] == '.')
    for (++i; i < s.size() && is_digit(s[i]); ++i) ++digits;
  if (real && digits > 0 && i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t j = i + 1 < s.size() && (s[i + 1] == '-' || s[i + 1] == '+') ? i + 2 : i + 1, exponent = 0;
    for (; j < s.size() && is_digit(s[j]); ++j) ++exponent;
    if (exponent == 0) return false;
    i = j;
  }
  return digits > 0 && i == s.size();
}

// value from text of the given form; from_chars takes a '-' but no '+'.
template <class T>
NumberError read(std::string_view text, bool real, T& value) {
  if (!well_formed(text, real)) return NumberError::malformed;
  const std::string_view s = !text.empty() && text[0] == '+' ? text.substr(1) : text;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec == std::errc::result_out_of_range) return NumberError::out_of_range;
  return ec != std::errc() || ptr != s.data() + s.size() ? NumberError::malformed : NumberError::none;
}
}  // namespace

ParsedInteger parse_integer(std::string_view text) {
  ParsedInteger out;
  out.error = read(text, false, out.value);
  return out;
}

ParsedReal parse_real(std::string_view text) {
  ParsedReal out;
  out.error = read(text, true, out.value);
  return out;
}

}  // namespace amp
