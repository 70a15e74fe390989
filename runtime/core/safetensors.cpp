#include "runtime/core/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>
#include "runtime/core/file_kind.h"

namespace amp::safetensors {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw Error(path + ": " + what); }

std::vector<char> read_all(const std::string& path) {
  if (const std::string kind = irregular_file(path); !kind.empty()) fail(path, "is " + kind + ", not a safetensors file");
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

namespace {
std::vector<RawEntry> raw_entries(const char* data, size_t size, const std::string& path) {
  const Layout layout = parse_layout(data, size, path);
  std::vector<RawEntry> out;
  for (const EntryLayout& e : layout.entries) {
    const char* src = data + layout.data_start + e.begin;
    out.push_back(RawEntry{e.name, e.dtype, e.shape, std::vector<char>(src, src + (e.end - e.begin))});
  }
  return out;
}

NamedTensors tensors_of(std::vector<RawEntry> raw, const std::string& path) {
  NamedTensors out;
  for (RawEntry& e : raw) {
    DType dtype;
    if (!dtype_from_safetensors_name(e.dtype, &dtype))
      fail(path, "tensor '" + e.name + "' has dtype " + e.dtype + ", which the runtime does not support");
    Tensor t = empty(e.shape, dtype, kCPU);
    if (!e.bytes.empty()) std::memcpy(t.data_ptr(), e.bytes.data(), e.bytes.size());
    out.emplace_back(e.name, t);
  }
  return out;
}
}  // namespace

std::vector<RawEntry> load_raw(const std::string& path) {
  const std::vector<char> bytes = read_all(path);
  return raw_entries(bytes.data(), bytes.size(), path);
}

NamedTensors load(const std::string& path) { return tensors_of(load_raw(path), path); }

NamedTensors parse(const std::string& bytes, const std::string& path) {
  return tensors_of(raw_entries(bytes.data(), bytes.size(), path), path);
}

namespace {
// The file: the header's length (8 bytes, little-endian), the header, then every tensor's bytes.
// What load() would refuse, refused before anything is written: a name twice (the header kept one
// of them over both tensors' bytes), the header's own key, an undefined tensor.
void check_writable(const NamedTensors& tensors, const std::string& path) {
  std::set<std::string> names;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") fail(path, "'__metadata__' is the header's own key, not a tensor's name");
    if (!names.insert(name).second) fail(path, "two tensors are named '" + name + "'");
    if (!t.defined()) fail(path, "tensor '" + name + "' is undefined (amp::Tensor())");
  }
}

void write_to(std::ostream& out, const NamedTensors& tensors) {
  // {"format": "pt"}, as PyTorch's save_pretrained writes: transformers' from_pretrained reads it, and
  // some of its versions fail on a file without metadata.
  nlohmann::ordered_json header = {{"__metadata__", {{"format", "pt"}}}};
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t n = t.nbytes();
    header[name] = {{"dtype", dtype_safetensors_name(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');  // the data section starts 8-byte aligned
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
}
}  // namespace

std::string serialize(const NamedTensors& tensors) {
  check_writable(tensors, "safetensors::serialize");
  std::ostringstream out(std::ios::binary);
  write_to(out, tensors);
  return out.str();
}

void save(const std::string& path, const NamedTensors& tensors) {
  // Through a symbolic link, the file it names is replaced and the link stays; a directory, device
  // or FIFO is never replaced.
  const std::string target = written_through(path).string();  // a dangling link too: the file it names
  if (std::error_code ec; std::filesystem::is_symlink(target, ec))
    fail(path, "is a symbolic link that does not resolve (a loop, or links unreadable); refusing to replace it");
  if (const std::string kind = irregular_file(target); !kind.empty())
    fail(path, "exists and is " + kind + "; refusing to replace it");
  check_writable(tensors, path);
  const std::string tmp = target + kTemporaryInfix + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail(path, "cannot open '" + tmp + "' for writing");
    write_to(out, tensors);
    out.flush();
    if (!out) {
      const int err = errno;  // the failed write's (EFBIG under ulimit -f, ENOSPC)
      std::remove(tmp.c_str());
      fail(path, std::string("write failed: ") + std::strerror(err) + " (disk full?)");
    }
  }
  // On the disk before it takes the name: a crash after the rename never leaves it on an empty file.
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    std::remove(tmp.c_str());
    fail(path, std::string("cannot flush to disk: ") + std::strerror(err));
  }
  ::close(fd);
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
