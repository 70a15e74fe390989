// libFuzzer target for the safetensors reader (runtime/core/safetensors_format.cpp): any input either
// parses into a layout that tiles the data section exactly, or is an Error. Anything else (a crash,
// another exception, a sanitizer report, a layout that breaks the invariants) is a finding.
// Built and run by tests/scripts/fuzz_safetensors.sh; corpus/regressions keeps every input that
// once got through, and the unit test test_safetensors replays it too.
#include <cstdint>
#include <cstdlib>

#include "runtime/core/safetensors_format.h"

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace amp::safetensors;
  try {
    const Layout layout = parse_layout(reinterpret_cast<const char*>(data), size, "input");
    uint64_t at = 0;
    for (const EntryLayout& e : layout.entries) {
      require(e.begin == at && e.end >= e.begin);
      uint64_t count = format_dtype_size(e.dtype);
      for (int64_t d : e.shape) count *= static_cast<uint64_t>(d);
      require(count == e.end - e.begin);
      at = e.end;
    }
    require(layout.data_start >= 8 && layout.data_start + at == size);
  } catch (const Error&) {
  }
  return 0;
}
