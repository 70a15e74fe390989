// Numbers as a person writes them, the way Python's repr(float) prints them: the shortest digits
// that read back as the same double, "2.0" rather than "2.000000", "0.9" rather than
// "0.90000000000000002", "1e-08" rather than "1.0000000000000001e-08".
#pragma once
#include <string>

namespace amp {

std::string float_repr(double v);

}  // namespace amp
