#include "models/data/token_dataset.h"

#include <fcntl.h>
#include <glob.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/core/file_kind.h"
#include "runtime/core/fnv1a.h"

namespace amp::models {

namespace {

static_assert(std::endian::native == std::endian::little, "token files hold little-endian uint16: read in place");

constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

std::string errno_text() { return std::strerror(errno); }

// A file open for reading, closed on scope exit. Opened without blocking, so that a FIFO (which
// file_size then refuses) does not wait for a writer.
struct File {
  explicit File(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)) {
    if (fd < 0) throw std::invalid_argument(path + ": cannot open: " + errno_text());
  }
  ~File() { ::close(fd); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  int fd;
};

int64_t file_size(const File& f, const std::string& path) {
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw std::invalid_argument(path + ": cannot stat: " + errno_text());
  if (const std::string kind = irregular_file_mode(st.st_mode); !kind.empty())
    throw std::invalid_argument(path + ": is " + kind);
  return static_cast<int64_t>(st.st_size);
}

// A mapped file that shrinks while mapped (another process truncates a shard, or rewrites it in
// place) faults with SIGBUS on the pages past its new end, which would end the process without a
// word. Reads out of a mapping run under a handler that jumps back to them, and the caller throws
// naming the file; any other SIGBUS goes to the handler that was there before (the default: a core).
thread_local sigjmp_buf* volatile t_mapped_read = nullptr;  // volatile: the handler reads it, not the code
struct sigaction g_previous_sigbus {};

void on_sigbus(int, siginfo_t*, void*) {
  if (t_mapped_read != nullptr) siglongjmp(*t_mapped_read, 1);
  ::sigaction(SIGBUS, &g_previous_sigbus, nullptr);  // not ours: delivered again, to the previous handler,
  ::raise(SIGBUS);                                   // once this one returns (SIGBUS is blocked in it)
}

// Once per process (not per read_mapped instance: a second install would keep ours as the previous).
void install_sigbus_handler() {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous_sigbus);
  });
}

// Runs read() (plain loads and stores, nothing to unwind); false where a page of the mapping was gone.
template <class Read>
bool read_mapped(Read&& read) {
  install_sigbus_handler();
  sigjmp_buf env;
  if (sigsetjmp(env, 1) != 0) {
    t_mapped_read = nullptr;
    return false;
  }
  t_mapped_read = &env;
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the guard is set before the first load, cleared after the last
  read();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_mapped_read = nullptr;
  return true;
}

[[noreturn]] void shard_changed(const std::string& path, const std::string& flag) {
  throw std::runtime_error(flag + ": " + path +
                           ": the file shrank while it was read (truncated, or rewritten in place): a token file "
                           "must not change during a run");
}


// A whole file mapped read-only; unmapped with the object.
class Mapping {
 public:
  Mapping(const std::string& path, int64_t bytes) : bytes_(static_cast<size_t>(bytes)) {
    const File f(path);
    void* p = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, f.fd, 0);
    if (p == MAP_FAILED) throw std::runtime_error(path + ": cannot map: " + errno_text());
    (void)::madvise(p, bytes_, MADV_SEQUENTIAL);  // read ahead, drop behind
    data_ = static_cast<const char*>(p);
  }
  ~Mapping() { ::munmap(const_cast<char*>(data_), bytes_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const char* data() const { return data_; }

 private:
  const char* data_ = nullptr;
  size_t bytes_;
};

struct Shard {
  std::string path;
  int64_t header = 0;  // bytes before the first token
  int64_t tokens = 0;
  int64_t first = 0;  // its first token's index in the concatenation
  std::string checksum;  // fnv1a_words of its tokens' bytes (the header excluded)
};

// Checks one file's header and size; returns the shard (first left 0).
Shard open_shard(const std::string& path, TokenFormat format) {
  const File f(path);
  const int64_t size = file_size(f, path);
  Shard s{path, 0, 0, 0, ""};
  int32_t header[3] = {0, 0, 0};
  (void)::pread(f.fd, header, sizeof header, 0);  // what a short file lacks stays 0: no magic
  if (format == TokenFormat::llmc) {
    if (header[0] != kLlmcMagic)
      throw std::invalid_argument(path + ": not an llm.c token shard: magic " + std::to_string(header[0]) + ", expected " +
                                  std::to_string(kLlmcMagic) +
                                  " (a headerless uint16 file, as nanoGPT's train.bin, needs --data-format u16)");
    if (size < kLlmcHeaderBytes)
      throw std::invalid_argument(path + ": " + std::to_string(size) + " bytes, shorter than an llm.c shard's " +
                                  std::to_string(kLlmcHeaderBytes) + "-byte header");
    if (header[1] != kLlmcVersion)
      throw std::invalid_argument(path + ": llm.c shard version " + std::to_string(header[1]) + ", expected " +
                                  std::to_string(kLlmcVersion) + " (uint16 tokens)");
    s.header = kLlmcHeaderBytes;
    const int64_t body = size - kLlmcHeaderBytes;
    if (header[2] < 0 || body != 2 * static_cast<int64_t>(header[2]))
      throw std::invalid_argument(path + ": the header says " + std::to_string(header[2]) + " tokens but the file holds " +
                                  std::to_string(body / 2) + (body % 2 ? " and one byte" : "") + " (" +
                                  std::to_string(body) + " bytes after the header)");
    s.tokens = header[2];
  } else {
    // A whole llm.c header (magic, version, a count that matches the size) is no run of tokens: read as
    // uint16 it would train on 512 of them, which a large --vocab-size would accept.
    if (header[0] == kLlmcMagic && header[1] == kLlmcVersion && header[2] >= 0 &&
        size == kLlmcHeaderBytes + 2 * static_cast<int64_t>(header[2]))
      throw std::invalid_argument(path + ": is an llm.c token shard (its header: magic " + std::to_string(kLlmcMagic) +
                                  ", version 1, " + std::to_string(header[2]) +
                                  " tokens), which --data-format u16 would read as tokens: leave --data-format out "
                                  "(or give llmc)");
    if (size % 2 != 0)
      throw std::invalid_argument(path + ": " + std::to_string(size) +
                                  " bytes: not a whole number of uint16 tokens (--data-format u16)");
    s.tokens = size / 2;
  }
  return s;
}

// Every token below vocab_size, and the shard's checksum, read one shard at a time (mapped, then
// unmapped).
void check_tokens(Shard& s, int64_t vocab_size, const std::string& flag) {
  s.checksum = hex64(fnv1a_words(nullptr, 0));
  if (s.tokens == 0) return;
  const Mapping m(s.path, s.header + 2 * s.tokens);
  const auto* t = reinterpret_cast<const uint16_t*>(m.data() + s.header);
  const uint16_t* bad = nullptr;
  uint16_t value = 0;  // read under the guard too
  uint64_t checksum = 0;
  if (!read_mapped([&] {
        bad = std::find_if(t, t + s.tokens, [&](uint16_t v) { return v >= vocab_size; });
        if (bad != t + s.tokens) value = *bad;
        else checksum = fnv1a_words(t, static_cast<size_t>(2 * s.tokens));
      }))
    shard_changed(s.path, flag);
  if (bad == t + s.tokens) {
    s.checksum = hex64(checksum);
    return;
  }
  const int64_t index = bad - t;
  throw std::invalid_argument(s.path + ": token " + std::to_string(value) + " at byte offset " +
                              std::to_string(s.header + 2 * index) + " (token " + std::to_string(index) +
                              " of the file) is not below --vocab-size " + std::to_string(vocab_size) + " (" + flag +
                              ")");
}

// The concatenation of shards, mapped two at a time.
class ShardStream {
 public:
  ShardStream(const std::string& pattern, const std::string& flag, TokenFormat format, int64_t vocab_size)
      : flag_(flag) {
    for (const std::string& path : expand_data_pattern(pattern, flag)) {
      Shard s;
      try {
        s = open_shard(path, format);
      } catch (const std::invalid_argument& e) {  // named by its flag: a glob's files are not on the command line
        throw std::invalid_argument(flag + ": " + e.what());
      }
      check_tokens(s, vocab_size, flag);
      s.first = total_;
      total_ += s.tokens;
      shards_.push_back(std::move(s));
    }
  }
  int64_t tokens() const { return total_; }
  const std::vector<Shard>& shards() const { return shards_; }

  // Tokens [start, start + n) of the concatenation (start + n <= tokens()) as int64.
  void read(int64_t start, int64_t n, int64_t* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (n > 0) {
      // The last shard whose first token is at or before start (empty shards skipped by the search).
      const auto it = std::upper_bound(shards_.begin(), shards_.end(), start,
                                       [](int64_t v, const Shard& s) { return v < s.first; });
      size_t i = static_cast<size_t>(it - shards_.begin()) - 1;
      while (shards_[i].tokens == 0 || start >= shards_[i].first + shards_[i].tokens) ++i;
      const Shard& s = shards_[i];
      const int64_t at = start - s.first, take = std::min(n, s.tokens - at);
      const auto* t = reinterpret_cast<const uint16_t*>(mapped(i) + s.header) + at;
      if (!read_mapped([&] {
            for (int64_t k = 0; k < take; ++k) out[k] = t[k];
          }))
        shard_changed(s.path, flag_);
      out += take;
      start += take;
      n -= take;
    }
  }

 private:
  // The shard's mapping: one of two slots, the one used less recently replaced.
  const char* mapped(size_t i) {
    ++clock_;
    for (Slot& s : slots_)
      if (s.shard == i && s.map) {
        s.used = clock_;
        return s.map->data();
      }
    Slot& victim = slots_[0].used <= slots_[1].used ? slots_[0] : slots_[1];
    victim.map.reset();  // unmapped before the next is mapped: two at most
    victim.map = std::make_unique<Mapping>(shards_[i].path, shards_[i].header + 2 * shards_[i].tokens);
    victim.shard = i;
    victim.used = clock_;
    return victim.map->data();
  }

  struct Slot {
    size_t shard = 0;
    std::unique_ptr<Mapping> map;
    uint64_t used = 0;
  };
  std::string flag_;
  std::vector<Shard> shards_;
  int64_t total_ = 0;
  std::mutex mutex_;
  Slot slots_[2];
  uint64_t clock_ = 0;
};

class Tokens final : public Dataset {
 public:
  Tokens(const TokenDataOptions& o, Device device)
      : block_(o.block_size), device_(device), format_(o.format),
        train_(std::make_unique<ShardStream>(o.train, "--data", o.format, o.vocab_size)) {
    check_size(*train_, "--data", o.train);
    if (!o.validation.empty()) {
      validation_ = std::make_unique<ShardStream>(o.validation, "--val-data", o.format, o.vocab_size);
      check_size(*validation_, "--val-data", o.validation);
    }
  }
  Batch rows(int64_t first, int64_t count) override { return batch(*train_, first, count); }
  bool has_validation() const override { return validation_ != nullptr; }
  Batch validation_rows(int64_t first, int64_t count) override {
    if (!validation_) return Dataset::validation_rows(first, count);
    return batch(*validation_, first, count);
  }
  int64_t resume_size() const override { return train_->tokens(); }
  // The shards by name (not path: moved files resume) and size, in order.
  nlohmann::json resume_identity() const override {
    nlohmann::json shards = nlohmann::json::array();
    for (const Shard& s : train_->shards())
      shards.push_back(std::filesystem::path(s.path).filename().string() + " (" + std::to_string(s.tokens) + " tokens)");
    return {{"data_tokens", train_->tokens()},
            {"data_format", format_ == TokenFormat::llmc ? "llmc" : "u16"},
            {"data_shards", shards}};
  }
  nlohmann::json validation_identity() const override {
    if (!validation_) return nullptr;
    nlohmann::json shards = nlohmann::json::array();
    for (const Shard& s : validation_->shards())
      shards.push_back(std::filesystem::path(s.path).filename().string() + " (" + std::to_string(s.tokens) +
                       " tokens, " + s.checksum + ")");
    return shards;
  }
  nlohmann::json content_checksums() const override {
    nlohmann::json sums = nlohmann::json::array();
    for (const Shard& s : train_->shards()) sums.push_back(s.checksum);
    return sums;
  }
  std::string describe() const override {
    std::string d = std::to_string(train_->shards().size()) + " shard(s) of " +
                    (format_ == TokenFormat::llmc ? "llm.c" : "uint16") + " tokens (" +
                    std::to_string(train_->tokens()) + " training tokens";
    if (validation_)
      d += ", " + std::to_string(validation_->tokens()) + " validation tokens in " +
           std::to_string(validation_->shards().size()) + " shard(s)";
    return d + ")";
  }

 private:
  void check_size(const ShardStream& s, const std::string& flag, const std::string& pattern) const {
    if (s.tokens() < block_ + 2)
      throw std::invalid_argument(flag + " " + pattern + ": " + std::to_string(s.tokens()) +
                                  " tokens in all, fewer than --block-size + 2 = " + std::to_string(block_ + 2));
  }

  Batch batch(ShardStream& s, int64_t first, int64_t count) const {
    const int64_t T = block_, span = s.tokens() - T - 1;
    std::vector<int64_t> x(static_cast<size_t>(count * T)), y(x.size()), window(static_cast<size_t>(T + 1));
    for (int64_t j = 0; j < count; ++j) {
      const int64_t start = (first + j) % span * T % span;  // as text's: reduced first, no overflow
      s.read(start, T + 1, window.data());
      std::copy(window.begin(), window.end() - 1, x.begin() + j * T);
      std::copy(window.begin() + 1, window.end(), y.begin() + j * T);
    }
    Batch b;
    b.x = from_int64(x, {count, T}, device_);
    b.targets = {from_int64(y, {count, T}, device_)};
    b.first = first;
    return b;
  }

  int64_t block_;
  Device device_;
  TokenFormat format_;
  std::unique_ptr<ShardStream> train_, validation_;
};

bool has_glob_characters(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<std::string> expand_data_pattern(const std::string& pattern, const std::string& flag) {
  std::error_code ec;
  if (!has_glob_characters(pattern) || std::filesystem::exists(pattern, ec)) {
    if (!std::filesystem::exists(pattern, ec)) throw std::invalid_argument(flag + ": " + pattern + ": " + missing_file(pattern));
    return {pattern};
  }
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (out.empty()) throw std::invalid_argument(flag + ": '" + pattern + "' matches no file");
  std::sort(out.begin(), out.end());  // glob sorts by the locale's collation: bytes here, always
  return out;
}

bool has_llmc_magic(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO: no wait (its loader refuses it)
  if (fd < 0) return false;
  int32_t v = 0;
  const bool read = ::pread(fd, &v, sizeof v, 0) == static_cast<ssize_t>(sizeof v);
  ::close(fd);
  return read && v == kLlmcMagic;
}

bool is_token_data(const std::string& pattern, const std::string& format_flag) {
  const std::vector<std::string> files = expand_data_pattern(pattern, "--data");
  // What is no file is named as such (the guesses below called a directory or /dev/zero text).
  for (const std::string& f : files)
    if (const std::string kind = irregular_file(f); !kind.empty()) throw std::invalid_argument("--data: " + f + ": is " + kind);
  if (has_llmc_magic(files[0])) return true;
  for (const std::string& f : files)
    if (f.size() >= 4 && f.compare(f.size() - 4, 4, ".bin") == 0)
      throw std::invalid_argument("--data: " + f + " has no llm.c header (magic " + std::to_string(kLlmcMagic) +
                                  "): a headerless uint16 token file, as nanoGPT's train.bin, needs " + format_flag +
                                  " u16; a text file named .bin needs " + format_flag + " text");
  if (files.size() > 1 || files[0] != pattern)
    throw std::invalid_argument("--data: '" + pattern + "' matches " + std::to_string(files.size()) +
                                (files.size() > 1 ? " files" : " file") + " with no llm.c header: text is one file, "
                                "named as it is (or give " + format_flag + " u16 for headerless uint16 tokens)");
  return false;
}

std::unique_ptr<Dataset> load_token_dataset(const TokenDataOptions& options, Device device) {
  if (options.vocab_size < 1 || options.vocab_size > 65536)
    throw std::invalid_argument("--vocab-size must be in [1, 65536] for uint16 tokens, got " +
                                std::to_string(options.vocab_size));
  return std::make_unique<Tokens>(options, device);
}

}  // namespace amp::models
