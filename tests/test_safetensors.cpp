// safetensors I/O: round trip, PyTorch's files, and rejection of corrupt or truncated files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "runtime/ops.h"
#include "runtime/random.h"
#include "runtime/safetensors.h"
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

}  // namespace
}  // namespace amp
