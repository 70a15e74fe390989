// safetensors I/O: round trip, PyTorch's files, and rejection of corrupt or truncated files.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "runtime/core/safetensors.h"
#include "test_util.h"

namespace amp {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("amp_st_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& n) const { return (path / n).string(); }
};

std::string read_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const std::string& p, const std::string& b) {
  std::ofstream out(p, std::ios::binary);
  out << b;
}

TEST(Safetensors, RoundTripEveryDtype) {
  TempDir dir;
  Generator g(1);
  safetensors::NamedTensors ts = {{"a", randn({3, 4}, g)},
                                  {"b.half", cast(randn({5}, g), DType::f16)},
                                  {"c.bf16", cast(randn({2, 2}, g), DType::bf16)},
                                  {"d", cast(randn({1}, g), DType::f64)},
                                  {"idx", from_int64({1, -2, 3}, {3})},
                                  {"empty", empty({0, 3})}};
  safetensors::save(dir.file("t.safetensors"), ts);
  const auto back = safetensors::load(dir.file("t.safetensors"));
  ASSERT_EQ(back.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_EQ(back[i].first, ts[i].first);
    EXPECT_TRUE(test::bitwise_equal(back[i].second, ts[i].second)) << ts[i].first;
  }
  // The header is 8-byte aligned, as the format requires.
  const std::string bytes = read_bytes(dir.file("t.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  // The metadata save_pretrained writes, which transformers' from_pretrained reads (some of its
  // versions fail on a file without it).
  const safetensors::Layout layout = safetensors::parse_layout(bytes.data(), bytes.size(), "t.safetensors");
  EXPECT_EQ(layout.metadata, (std::vector<std::pair<std::string, std::string>>{{"format", "pt"}}));
  // No temporary file is left behind.
  int files = 0;
  for (auto& e : fs::directory_iterator(dir.path)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, ReadsPyTorchFiles) {
  const auto& t = test::fixture("mlp_pytorch.safetensors");
  const Tensor& w = safetensors::find(t, "0.weight", "mlp");
  EXPECT_EQ(w.shape(), (Shape{16, 16}));
  EXPECT_EQ(w.dtype(), DType::f32);
  EXPECT_THROW(safetensors::find(t, "nope", "mlp"), safetensors::Error);
  // U16 is not a tensor dtype here: load() names it, load_raw() reads it.
  EXPECT_THROW(safetensors::load(test::data_path("casts.safetensors")), safetensors::Error);
  EXPECT_EQ(safetensors::load_raw(test::data_path("casts.safetensors")).size(), 3u);
}

void expect_rejected(const std::string& path, const std::string& needle) {
  try {
    safetensors::load(path);
    ADD_FAILURE() << "accepted a bad file; expected an error containing '" << needle << "'";
  } catch (const safetensors::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
}

TEST(Safetensors, RejectsCorruptAndTruncatedFiles) {
  TempDir dir;
  Generator g(2);
  const std::string good = dir.file("good.safetensors");
  safetensors::save(good, {{"w", randn({4, 4}, g)}});
  const std::string bytes = read_bytes(good);

  const std::string trunc = dir.file("trunc.safetensors");
  write_bytes(trunc, bytes.substr(0, bytes.size() - 10));
  expect_rejected(trunc, "truncated");

  // A directory or a FIFO is named, never read (a FIFO would wait for a writer) nor replaced.
  fs::create_directories(dir.file("dir.safetensors"));
  expect_rejected(dir.file("dir.safetensors"), "dir.safetensors: is a directory, not a safetensors file");
  ASSERT_EQ(::mkfifo(dir.file("fifo.safetensors").c_str(), 0600), 0);
  expect_rejected(dir.file("fifo.safetensors"), "is not a regular file (a device, FIFO or socket), not a safetensors");
  try {
    safetensors::save(dir.file("fifo.safetensors"), {{"w", randn({4, 4}, g)}});
    ADD_FAILURE() << "saved into a FIFO";
  } catch (const safetensors::Error& e) {
    EXPECT_NE(std::string(e.what()).find("exists and is not a regular file (a device, FIFO or socket); refusing"),
              std::string::npos)
        << e.what();
  }

  const std::string tiny = dir.file("tiny.safetensors");
  write_bytes(tiny, "abc");
  expect_rejected(tiny, "truncated");

  std::string huge = bytes;
  huge[7] = 0x7f;  // absurd header length
  const std::string hl = dir.file("hl.safetensors");
  write_bytes(hl, huge);
  expect_rejected(hl, "header length");

  std::string garbled = bytes;
  garbled[9] = '!';
  const std::string gj = dir.file("gj.safetensors");
  write_bytes(gj, garbled);
  expect_rejected(gj, "corrupt header");

  expect_rejected(dir.file("missing.safetensors"), "cannot open");

  // Hand-written headers: a shape whose element count wraps around, and a shape that is no array.
  auto with_header = [&](const std::string& name, const std::string& json) {
    std::string h = json;
    while (h.size() % 8) h.push_back(' ');
    std::string b(8, '\0');
    uint64_t n = h.size();
    std::memcpy(b.data(), &n, 8);
    write_bytes(dir.file(name), b + h);
    return dir.file(name);
  };
  expect_rejected(with_header("wrap.safetensors",
                              R"({"x":{"dtype":"F32","shape":[72057594037927936,256],"data_offsets":[0,0]}})"),
                  "impossibly large");
  expect_rejected(with_header("scalar.safetensors", R"({"x":{"dtype":"F32","shape":5,"data_offsets":[0,4]}})"),
                  "malformed shape");
  expect_rejected(with_header("frac.safetensors", R"({"x":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})"),
                  "malformed shape");
}

// The format, enforced: each of these files was once read as data instead of refused.
TEST(Safetensors, EnforcesTheFormat) {
  TempDir dir;
  // A file from a header and a data section; pad: what follows the JSON in the header.
  auto file = [&](const std::string& name, const std::string& json, const std::string& data,
                  const std::string& pad = "") {
    std::string h = json + pad;
    std::string b(8, '\0');
    const uint64_t n = h.size();
    std::memcpy(b.data(), &n, 8);
    write_bytes(dir.file(name), b + h + data);
    return dir.file(name);
  };
  const std::string eight(8, '\x01');
  const std::string two_f32 =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  // The control: a well-formed file loads, padded with spaces or not, with string metadata.
  EXPECT_EQ(safetensors::load(file("ok.st", two_f32, eight)).size(), 2u);
  EXPECT_EQ(safetensors::load(file("pad.st", two_f32, eight, "   ")).size(), 2u);
  EXPECT_EQ(safetensors::load(file("meta.st", R"({"__metadata__":{"format":"pt"},)" + two_f32.substr(1), eight)).size(),
            2u);
  // An empty tensor may sit anywhere, also where another begins.
  EXPECT_EQ(safetensors::load(file("empty.st",
                                   R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]}})",
                                   eight))
                .size(),
            2u);

  expect_rejected(file("overlap.st",
                       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                       eight),
                  "overlaps");
  expect_rejected(file("hole.st",
                       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})",
                       eight),
                  "belong to no tensor");
  expect_rejected(file("trailing.st", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight),
                  "trailing byte");
  expect_rejected(file("dup.st",
                       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                       eight),
                  "appears twice");
  expect_rejected(file("dupfield.st", R"({"a":{"dtype":"F32","shape":[1],"dtype":"U8","data_offsets":[0,4]}})",
                       eight.substr(0, 4)),
                  "appears twice");
  expect_rejected(file("fracoff.st", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.5]}})",
                       eight.substr(0, 4)),
                  "data_offsets");
  expect_rejected(file("negoff.st", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", ""),
                  "data_offsets");
  expect_rejected(file("strdtype.st", R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", eight.substr(0, 4)),
                  "dtype");
  expect_rejected(file("field.st", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})",
                       eight.substr(0, 4)),
                  "unknown field 'x'");
  expect_rejected(file("notobj.st", R"({"a":[1,2]})", ""), "not an object");
  expect_rejected(file("meta_num.st", R"({"__metadata__":{"epoch":3}})", ""), "strings to strings");
  expect_rejected(file("meta_arr.st", R"({"__metadata__":["x"]})", ""), "__metadata__");
  expect_rejected(file("nulpad.st", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight.substr(0, 4),
                       std::string(3, '\0')),
                  "padded with spaces");
  expect_rejected(file("nlpad.st", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight.substr(0, 4),
                       "\n"),
                  "padded with spaces");
  expect_rejected(file("array.st", "[]", ""), "begin with '{'");

  // A header length one byte off in either direction shifts everything: refused, never read.
  Generator g(3);
  const std::string good = dir.file("good.st");
  safetensors::save(good, {{"w", randn({4, 4}, g)}, {"b", randn({4}, g)}});
  const std::string bytes = read_bytes(good);
  for (int delta : {-1, 1, -8, 8}) {
    std::string b = bytes;
    uint64_t n = 0;
    std::memcpy(&n, b.data(), 8);
    n += static_cast<uint64_t>(static_cast<int64_t>(delta));
    std::memcpy(b.data(), &n, 8);
    const std::string f = dir.file("shift" + std::to_string(delta) + ".st");
    write_bytes(f, b);
    EXPECT_THROW(safetensors::load(f), safetensors::Error) << "header length off by " << delta;
  }
}

// Every input that once got through, or crashed the reader, under tests/fuzz/corpus/regressions:
// each one is an Error now (the fuzz target runs them too, under the sanitizers).
TEST(Safetensors, RegressionCorpusIsRejected) {
  const fs::path dir = fs::path(AMP_FUZZ_CORPUS_DIR) / "regressions";
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    ++n;
    EXPECT_THROW(safetensors::load_raw(e.path().string()), safetensors::Error) << e.path();
  }
  EXPECT_GT(n, 10);
}

// What load() would refuse is never written: a name twice (the header kept one over both tensors'
// bytes, and the file was unreadable), the header's own key, an undefined tensor; nothing is left.
TEST(Safetensors, SaveRefusesWhatLoadWouldRefuse) {
  const std::string path = (std::filesystem::temp_directory_path() / "amp_test_refused.safetensors").string();
  std::filesystem::remove(path);
  const std::vector<std::pair<safetensors::NamedTensors, std::string>> bad = {
      {{{"x", ones({1})}, {"x", ones({1})}}, "two tensors are named 'x'"},
      {{{"__metadata__", ones({1})}}, "'__metadata__' is the header's own key"},
      {{{"x", Tensor()}}, "tensor 'x' is undefined"}};
  for (const auto& [tensors, says] : bad) {
    try {
      safetensors::save(path, tensors);
      ADD_FAILURE() << says << ": written";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(path + ": " + says), std::string::npos) << e.what();
    }
    EXPECT_THROW(safetensors::serialize(tensors), std::invalid_argument) << says;
    EXPECT_FALSE(std::filesystem::exists(path)) << says;
    for (const auto& e : std::filesystem::directory_iterator(std::filesystem::temp_directory_path()))
      EXPECT_NE(e.path().filename().string(), "amp_test_refused.safetensors.tmp." + std::to_string(::getpid()));
  }
}

}  // namespace
}  // namespace amp
