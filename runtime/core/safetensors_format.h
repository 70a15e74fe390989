// The safetensors container format, parsed strictly: an 8-byte little-endian header length N, N
// bytes of UTF-8 JSON that begin with '{' and may be padded with spaces, then the data section.
// Every tensor names its dtype, shape and [begin, end) bytes of the data section; the tensors tile
// the data section exactly (no hole, no overlap, no trailing byte), names are unique, and the
// optional "__metadata__" maps strings to strings. Anything else is an Error naming the source.
//
// This file depends on nothing but the dtype table and the JSON parser, so that the fuzz target
// (tests/fuzz/) can drive it directly on bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace amp::safetensors {

// Every error names the file and what is wrong with it.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct EntryLayout {
  std::string name;
  std::string dtype;  // safetensors' name, e.g. "F32", "U16"
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // bytes of the data section
};

struct Layout {
  uint64_t data_start = 0;           // file offset of the data section (8 + header length)
  std::vector<EntryLayout> entries;  // data order: by begin, an empty one first
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Parses and checks the whole layout of a file held in memory; source names it in errors.
Layout parse_layout(const char* bytes, size_t size, const std::string& source);

// Bytes per element of a safetensors dtype name; 0 for a name the format does not define.
size_t format_dtype_size(const std::string& dtype);

}  // namespace amp::safetensors
