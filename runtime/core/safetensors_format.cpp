#include "runtime/core/safetensors_format.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "runtime/core/dtype.h"

namespace amp::safetensors {

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // as the reference implementation
constexpr uint64_t kMaxElements = uint64_t{1} << 56;

using Json = nlohmann::ordered_json;

// Parses the header, refusing duplicate keys in any object (a JSON parser keeps one of them
// silently, so two readers could see two different files).
Json parse_header(const char* first, const char* last, std::string* duplicate) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto cb = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) keys.emplace_back();
    else if (event == Json::parse_event_t::object_end) keys.pop_back();
    else if (event == Json::parse_event_t::key && !keys.back().insert(parsed.get<std::string>()).second &&
             duplicate->empty())
      *duplicate = parsed.get<std::string>();
    return true;
  };
  return Json::parse(first, last, cb);
}

}  // namespace

size_t format_dtype_size(const std::string& dt) {
  DType t;
  if (dtype_from_safetensors_name(dt, &t)) return dtype_size(t);
  if (dt == "U8" || dt == "I8" || dt == "BOOL" || dt == "F8_E4M3" || dt == "F8_E5M2") return 1;
  if (dt == "U16" || dt == "I16") return 2;
  if (dt == "U32" || dt == "I32") return 4;
  if (dt == "U64") return 8;
  return 0;
}

Layout parse_layout(const char* bytes, size_t size, const std::string& source) {
  auto fail = [&](const std::string& what) -> Error { return Error(source + ": " + what); };
  if (size < 8) throw fail("truncated: " + std::to_string(size) + " bytes, no header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
  if (header_len > kMaxHeaderBytes || header_len > size - 8)
    throw fail("corrupt or truncated: header length " + std::to_string(header_len) + " exceeds the file (" +
               std::to_string(size) + " bytes)");
  const char* h = bytes + 8;
  const char* h_end = h + header_len;
  if (header_len == 0 || h[0] != '{')
    throw fail("corrupt header: it must begin with '{' (a wrong header length shifts it)");
  const char* json_end = h_end;
  while (json_end > h && json_end[-1] == ' ') --json_end;  // the format's padding: spaces only
  if (json_end[-1] != '}')
    throw fail("corrupt header: it must end with '}' and may be padded with spaces only (a wrong header length "
               "shifts it)");

  Json header;
  std::string duplicate;
  try {
    header = parse_header(h, json_end, &duplicate);
  } catch (const nlohmann::json::exception& e) {
    throw fail(std::string("corrupt header: ") + e.what());
  }
  if (!duplicate.empty()) throw fail("corrupt header: the key '" + duplicate + "' appears twice");

  Layout out;
  out.data_start = 8 + header_len;
  const uint64_t data_size = size - out.data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const Json& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) throw fail("__metadata__ must be an object of strings");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string())
          throw fail("__metadata__ must map strings to strings; '" + m.key() + "' is " + m.value().type_name());
        out.metadata.emplace_back(m.key(), m.value().get<std::string>());
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (!e.is_object()) throw fail(what + " is not an object");
    for (auto f = e.begin(); f != e.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        throw fail(what + " has an unknown field '" + f.key() + "'");
    if (!e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      throw fail(what + " needs dtype, shape and data_offsets");
    EntryLayout entry;
    entry.name = name;
    if (!e["dtype"].is_string()) throw fail(what + " has a dtype that is not a string");
    entry.dtype = e["dtype"].get<std::string>();
    const size_t elem = format_dtype_size(entry.dtype);
    if (elem == 0) throw fail(what + " has unknown dtype " + entry.dtype);

    const Json& dims = e["shape"];
    if (!dims.is_array()) throw fail(what + " has a malformed shape (not an array)");
    uint64_t count = 1;
    for (const Json& d : dims) {
      if (!d.is_number_unsigned()) throw fail(what + " has a malformed shape (dimensions must be integers >= 0)");
      const uint64_t v = d.get<uint64_t>();
      if (v > kMaxElements || __builtin_mul_overflow(count, v, &count) || count > kMaxElements)
        throw fail(what + " has an impossibly large shape " + dims.dump());
      entry.shape.push_back(static_cast<int64_t>(v));
    }
    const Json& offs = e["data_offsets"];
    if (!offs.is_array() || offs.size() != 2 || !offs[0].is_number_unsigned() || !offs[1].is_number_unsigned())
      throw fail(what + " has malformed data_offsets (two integers >= 0 are needed): " + offs.dump());
    entry.begin = offs[0].get<uint64_t>();
    entry.end = offs[1].get<uint64_t>();
    if (entry.begin > entry.end || entry.end > data_size)
      throw fail("truncated or corrupt: " + what + " spans bytes [" + std::to_string(entry.begin) + ", " +
                 std::to_string(entry.end) + ") of a " + std::to_string(data_size) + "-byte data section");
    if (entry.end - entry.begin != count * elem)
      throw fail(what + " holds " + std::to_string(entry.end - entry.begin) + " bytes, but " + entry.dtype + " " +
                 dims.dump() + " needs " + std::to_string(count * elem));
    out.entries.push_back(std::move(entry));
  }

  // The tensors tile the data section: each begins where the one before it ends.
  std::stable_sort(out.entries.begin(), out.entries.end(),
                   [](const EntryLayout& a, const EntryLayout& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;  // empty ones first
                   });
  uint64_t at = 0;
  for (const EntryLayout& e : out.entries) {
    if (e.begin > at)
      throw fail("corrupt: bytes [" + std::to_string(at) + ", " + std::to_string(e.begin) +
                 ") of the data section belong to no tensor (before '" + e.name + "')");
    if (e.begin < at)
      throw fail("corrupt: tensor '" + e.name + "' overlaps the tensor before it (it begins at byte " +
                 std::to_string(e.begin) + ", which is before byte " + std::to_string(at) + ")");
    at = e.end;
  }
  if (at != data_size)
    throw fail("corrupt: " + std::to_string(data_size - at) + " trailing byte(s) after the last tensor (the data "
               "section has " + std::to_string(data_size) + " bytes, the tensors cover " + std::to_string(at) + ")");
  return out;
}

}  // namespace amp::safetensors
