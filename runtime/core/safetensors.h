// safetensors files: an 8-byte little-endian header length, a JSON header, then raw little-endian
// data. Parameters keep PyTorch's names and layouts, so files interoperate with torch.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "runtime/core/safetensors_format.h"
#include "runtime/core/tensor.h"

namespace amp::safetensors {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// One header entry with its bytes, for dtypes this runtime has no tensor type for (U16, U8, ...).
struct RawEntry {
  std::string name;
  std::string dtype;  // safetensors' name, e.g. "F32", "U16"
  Shape shape;
  std::vector<char> bytes;
};
// Reads and validates the whole file (safetensors_format.h), in data order.
std::vector<RawEntry> load_raw(const std::string& path);

// Loads every tensor onto the CPU, in data order. Rejects truncated or corrupt files.
NamedTensors load(const std::string& path);
// The same from a file's bytes already read (and checked: a checkpoint's checksum), path naming it.
NamedTensors parse(const std::string& bytes, const std::string& path);
// Writes to a temporary file in the same folder (NAME.tmp.PID), then renames it: no half-written file
// is left under NAME.
inline constexpr const char* kTemporaryInfix = ".tmp.";
void save(const std::string& path, const NamedTensors& tensors);
// The bytes save() would write (for callers that write and checksum them themselves).
std::string serialize(const NamedTensors& tensors);
// The tensor called name, or an Error naming the file and the missing tensor.
const Tensor& find(const NamedTensors& tensors, const std::string& name, const std::string& path);

}  // namespace amp::safetensors
