#include "runtime/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace amp::safetensors {

namespace {
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw Error(path + ": " + what); }

std::vector<char> read_all(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    fail(path, std::filesystem::is_directory(st) ? "is a directory, not a safetensors file"
                                                 : "is not a regular file (a device or FIFO?)");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail(path, "cannot open file for reading");
  const std::streamsize size = in.tellg();
  if (size < 0) fail(path, "cannot tell the file's size");
  std::vector<char> bytes(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(bytes.data(), size)) fail(path, "cannot read file");
  return bytes;
}
}  // namespace

static size_t raw_dtype_size(const std::string& dt) {
  DType t;
  if (dtype_from_safetensors_name(dt, &t)) return dtype_size(t);
  if (dt == "U8" || dt == "I8" || dt == "BOOL") return 1;
  if (dt == "U16" || dt == "I16") return 2;
  if (dt == "U32" || dt == "I32") return 4;
  if (dt == "U64") return 8;
  return 0;
}

std::vector<RawEntry> load_raw(const std::string& path) {
  const std::vector<char> bytes = read_all(path);
  if (bytes.size() < 8) fail(path, "truncated: " + std::to_string(bytes.size()) + " bytes, no header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  if (header_len > kMaxHeaderBytes || header_len > bytes.size() - 8)
    fail(path, "corrupt or truncated: header length " + std::to_string(header_len) + " exceeds the file (" +
                   std::to_string(bytes.size()) + " bytes)");
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header_len));
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("corrupt header: ") + e.what());
  }
  if (!header.is_object()) fail(path, "corrupt header: not a JSON object");
  const size_t data_start = 8 + header_len;
  const size_t data_size = bytes.size() - data_start;

  std::vector<std::pair<uint64_t, RawEntry>> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const auto& e = it.value();
    try {
      const std::string dt = e.at("dtype").get<std::string>();
      const size_t elem = raw_dtype_size(dt);
      if (elem == 0) fail(path, "tensor '" + name + "' has unknown dtype " + dt);
      const auto& dims = e.at("shape");
      if (!dims.is_array()) fail(path, "tensor '" + name + "' has a malformed shape (not an array)");
      Shape shape;
      uint64_t count = 1;
      for (const auto& d : dims) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0)
          fail(path, "tensor '" + name + "' has a malformed shape (dimensions must be integers >= 0)");
        const int64_t v = d.get<int64_t>();
        if (__builtin_mul_overflow(count, static_cast<uint64_t>(v), &count) || count > (uint64_t{1} << 56))
          fail(path, "tensor '" + name + "' has an impossibly large shape");
        shape.push_back(v);
      }
      const auto& offs = e.at("data_offsets");
      if (!offs.is_array() || offs.size() != 2) fail(path, "tensor '" + name + "' has malformed data_offsets");
      const uint64_t begin = offs[0].get<uint64_t>(), end = offs[1].get<uint64_t>();
      const uint64_t expect = count * elem;
      if (begin > end || end > data_size)
        fail(path, "truncated or corrupt: tensor '" + name + "' spans bytes [" + std::to_string(begin) + ", " +
                       std::to_string(end) + ") of a " + std::to_string(data_size) + "-byte data section");
      if (end - begin != expect)
        fail(path, "tensor '" + name + "' holds " + std::to_string(end - begin) + " bytes, but " + dt + " " +
                       shape_str(shape) + " needs " + std::to_string(expect));
      const char* src = bytes.data() + data_start + begin;
      entries.emplace_back(begin, RawEntry{name, dt, shape, std::vector<char>(src, src + expect)});
    } catch (const nlohmann::json::exception& ex) {
      fail(path, "tensor '" + name + "' has a malformed header entry: " + ex.what());
    }
  }
  // File order: by data offset, header order among equals.
  std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<RawEntry> out;
  for (auto& e : entries) out.push_back(std::move(e.second));
  return out;
}

NamedTensors load(const std::string& path) {
  NamedTensors out;
  for (RawEntry& e : load_raw(path)) {
    DType dtype;
    if (!dtype_from_safetensors_name(e.dtype, &dtype))
      fail(path, "tensor '" + e.name + "' has dtype " + e.dtype + ", which the runtime does not support");
    Tensor t = empty(e.shape, dtype, kCPU);
    if (!e.bytes.empty()) std::memcpy(t.data_ptr(), e.bytes.data(), e.bytes.size());
    out.emplace_back(e.name, t);
  }
  return out;
}

void save(const std::string& path, const NamedTensors& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t n = t.nbytes();
    header[name] = {{"dtype", dtype_safetensors_name(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');  // the data section starts 8-byte aligned

  // Through a symbolic link, the file it names is replaced and the link stays; a directory, device
  // or FIFO is never replaced.
  std::error_code ec;
  std::string target = path;
  if (std::filesystem::is_symlink(path, ec)) {  // (a path that does not exist yet is no link)
    target = std::filesystem::weakly_canonical(path, ec).string();
    if (ec) fail(path, "cannot resolve the symbolic link: " + ec.message());
  }
  const auto st = std::filesystem::status(target, ec);
  if (std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    fail(path, "exists and is not a regular file; refusing to replace it");
  const std::string tmp = target + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail(path, "cannot open '" + tmp + "' for writing");
    unsigned char len[8];
    uint64_t v = text.size();
    for (unsigned char& b : len) {
      b = static_cast<unsigned char>(v & 0xff);
      v >>= 8;
    }
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& [name, t] : tensors) {
      const Tensor host = t.to(kCPU);
      out.write(static_cast<const char*>(host.data_ptr()), static_cast<std::streamsize>(host.nbytes()));
    }
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      fail(path, "write failed (disk full?)");
    }
  }
  if (std::rename(tmp.c_str(), target.c_str()) != 0) {
    std::remove(tmp.c_str());
    fail(path, std::string("cannot rename temporary file: ") + std::strerror(errno));
  }
}

const Tensor& find(const NamedTensors& tensors, const std::string& name, const std::string& path) {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  fail(path, "has no tensor named '" + name + "'");
}

}  // namespace amp::safetensors
