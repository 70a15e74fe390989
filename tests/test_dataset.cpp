// The text stream (--model gpt) follows the layout that the README states ("A GPT on real text", Data)
// to the byte; and the synthetic data stream: a pool of samples that repeats, each sample a function of its index
// alone (never of the batch, the chunk it was generated in, or the device), as a file would be.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/data/dataset.h"
#include "models/data/text_dataset.h"
#include "models/data/token_dataset.h"
#include "runtime/ops/ops.h"
#include "test_util.h"

namespace amp {
namespace {

std::vector<double> row_of(const Tensor& t, int64_t r) {
  const std::vector<double> all = t.to_vector();
  const int64_t w = t.shape()[1];
  return {all.begin() + r * w, all.begin() + (r + 1) * w};
}

// Bytes are tokens; the first floor(9N/10) bytes train, the rest validate; sample s of a split of
// n bytes starts at byte (s T) mod (n - T - 1), its targets shifted by one. Written out here from
// that rule, against the dataset's rows (far into the stream too, where s T would overflow int64).
TEST(TextData, RowsFollowTheLayoutToTheByte) {
  const int64_t N = 1001, T = 8;
  std::string bytes(static_cast<size_t>(N), '\0');
  for (int64_t i = 0; i < N; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((i * 7 + i / 256) % 256);
  auto data = models::make_text_dataset(bytes, T, kCPU, "generated");
  EXPECT_EQ(data->train_bytes(), 900);  // 9 * 1001 / 10, rounded down
  EXPECT_EQ(data->validation_bytes(), 101);
  auto check = [&](const models::Batch& b, int64_t base, int64_t n, int64_t first, int64_t count) {
    ASSERT_EQ(b.x.shape(), (Shape{count, T}));
    const auto x = b.x.to_vector(), y = b.targets.at(0).to_vector();
    const int64_t span = n - T - 1;
    for (int64_t j = 0; j < count; ++j) {
      int64_t start = 0;  // (first + j) T mod span, as T additions mod span (no product to overflow)
      for (int64_t k = 0; k < T; ++k) start = (start + (first + j) % span) % span;
      for (int64_t t = 0; t < T; ++t) {
        const auto at = [&](int64_t k) { return static_cast<double>(static_cast<unsigned char>(bytes[static_cast<size_t>(base + k)])); };
        ASSERT_EQ(x[static_cast<size_t>(j * T + t)], at(start + t)) << "sample " << first + j << " byte " << t;
        ASSERT_EQ(y[static_cast<size_t>(j * T + t)], at(start + t + 1)) << "sample " << first + j << " byte " << t;
      }
    }
  };
  for (const int64_t first : {int64_t{0}, int64_t{100}, int64_t{1} << 61}) {
    check(data->rows(first, 12), 0, 900, first, 12);
    check(data->validation_rows(first, 5), 900, 101, first, 5);
  }
}

// A fresh directory under the temporary one, removed at the end of the test.
struct Dir {
  explicit Dir(const std::string& name) : path(std::filesystem::temp_directory_path() / ("amp_test_tokens_" + name)) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~Dir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::filesystem::path path;
};

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// Token shards: the stream is their concatenation, laid out as text's bytes are (sample s starts at
// token (s T) mod (N - T - 1)), sequences running from one shard into the next; the same tokens as one
// headerless uint16 file (nanoGPT's) give the same rows; the glob's order is the names', not the
// order the files were written in; the validation shards are a stream of their own.
TEST(TokenData, RowsFollowTheLayoutAcrossShards) {
  Dir d("layout");
  const int64_t T = 8, V = 50257;
  const std::vector<int64_t> sizes = {37, 0, 50, 13};  // an empty shard too
  std::vector<uint16_t> all;
  for (int64_t i = 0; i < 100; ++i) all.push_back(static_cast<uint16_t>((i * 7919 + 11) % V));
  for (size_t s = sizes.size(); s-- > 0;) {  // written last to first
    int64_t from = 0;
    for (size_t k = 0; k < s; ++k) from += sizes[k];
    test::write_llmc_shard(d.file("train_" + std::to_string(s) + ".bin"),
                           std::vector<uint16_t>(all.begin() + from, all.begin() + from + sizes[s]));
  }
  std::string u16;
  for (uint16_t t : all) u16 += std::string{static_cast<char>(t & 0xff), static_cast<char>(t >> 8)};
  write_bytes(d.file("all.u16"), u16);
  test::write_llmc_shard(d.file("val_0.bin"), std::vector<uint16_t>(all.rbegin(), all.rbegin() + 30));

  models::TokenDataOptions o;
  o.train = d.file("train_*.bin");
  o.validation = d.file("val_0.bin");
  o.vocab_size = V;
  o.block_size = T;
  auto shards = models::load_token_dataset(o, kCPU);
  o.train = d.file("all.u16");
  o.validation.clear();
  o.format = models::TokenFormat::u16;
  auto one_file = models::load_token_dataset(o, kCPU);
  EXPECT_TRUE(shards->has_validation());
  EXPECT_FALSE(one_file->has_validation());
  auto check = [&](const models::Batch& b, const std::vector<uint16_t>& tokens, int64_t first, int64_t count) {
    const auto x = b.x.to_vector(), y = b.targets.at(0).to_vector();
    const int64_t span = static_cast<int64_t>(tokens.size()) - T - 1;
    for (int64_t j = 0; j < count; ++j) {
      int64_t start = 0;
      for (int64_t k = 0; k < T; ++k) start = (start + (first + j) % span) % span;
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(x[static_cast<size_t>(j * T + t)], tokens[static_cast<size_t>(start + t)]) << "sample " << first + j;
        ASSERT_EQ(y[static_cast<size_t>(j * T + t)], tokens[static_cast<size_t>(start + t + 1)]) << "sample " << first + j;
      }
    }
  };
  const std::vector<uint16_t> val(all.rbegin(), all.rbegin() + 30);
  for (const int64_t first : {int64_t{0}, int64_t{3}, int64_t{1} << 61}) {
    check(shards->rows(first, 20), all, first, 20);  // 20 x 8 tokens: every boundary crossed
    check(one_file->rows(first, 20), all, first, 20);
    check(shards->validation_rows(first, 4), val, first, 4);
  }
  const auto id = shards->resume_identity();
  EXPECT_EQ(id["data_tokens"], 100);
  EXPECT_EQ(id["data_shards"].dump(),
            R"j(["train_0.bin (37 tokens)","train_1.bin (0 tokens)","train_2.bin (50 tokens)","train_3.bin (13 tokens)"])j");
  // Each shard's checksum, of its tokens' bytes (fnv1a_words: four FNV-1a lanes over 64-bit words, a
  // tail byte-wise; values from a Python implementation of runtime/core/fnv1a.h's description).
  EXPECT_EQ(shards->content_checksums().dump(),
            R"j(["dcc9b6360037fe3e","6f5ca67cf47c745d","bbc7f3a87b14ab5f","097dfa16c5eb347e"])j");
}

// A shard that shrinks while it is mapped (another process truncates it, or rewrites it in place)
// makes the read throw naming it and the flag, where the pages past its new end used to end the
// process with SIGBUS and no word.
TEST(TokenData, AShardThatShrinksDuringTheRunIsNamedNotACrash) {
  Dir d("shrinks");
  std::vector<uint16_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i * 31 % 1000);
  test::write_llmc_shard(d.file("train_0.bin"), tokens);
  models::TokenDataOptions o;
  o.train = d.file("train_0.bin");
  o.vocab_size = 1000;
  o.block_size = 16;
  auto data = models::load_token_dataset(o, kCPU);
  (void)data->rows(500, 4);  // mapped, and tokens 8000 on (past the first pages) read once
  std::filesystem::resize_file(d.file("train_0.bin"), 1024);  // the header alone
  try {
    (void)data->rows(500, 4);
    ADD_FAILURE() << "read tokens of a shard that no longer holds them";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("--data: " + d.file("train_0.bin") + ": the file shrank while it was read"),
              std::string::npos) << e.what();
  }
  // A SIGBUS anywhere else still ends the process, as before the handler was there: by the signal,
  // or by the handler that was there first (AddressSanitizer's reports it and exits 1).
  const auto ended_by_the_fault = [](int status) {
    return (WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS) || (WIFEXITED(status) && WEXITSTATUS(status) == 1);
  };
  EXPECT_EXIT(
      {
        const int fd = ::open(d.file("other").c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || ::ftruncate(fd, 1 << 16) != 0) std::_Exit(3);
        const auto* p = static_cast<const volatile char*>(::mmap(nullptr, 1 << 16, PROT_READ, MAP_SHARED, fd, 0));
        if (::ftruncate(fd, 0) != 0) std::_Exit(4);
        (void)p[40000];
        std::_Exit(0);
      },
      ended_by_the_fault, "");
}

// Each bad file is refused at load with a message naming it and what is wrong.
TEST(TokenData, BadFilesAreRefusedNamingTheFileAndTheProblem) {
  Dir d("bad");
  const std::vector<uint16_t> ok(40, 7);
  test::write_llmc_shard(d.file("good.bin"), ok);
  auto refused = [&](const std::string& path, models::TokenFormat format, int64_t vocab, const std::vector<std::string>& says) {
    models::TokenDataOptions o;
    o.train = path;
    o.format = format;
    o.vocab_size = vocab;
    o.block_size = 8;
    try {
      models::load_token_dataset(o, kCPU);
      ADD_FAILURE() << path << ": accepted";
    } catch (const std::invalid_argument& e) {
      for (const std::string& s : says) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
    }
  };
  std::string bytes;
  {
    std::ifstream in(d.file("good.bin"), std::ios::binary);
    bytes.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  std::string wrong = bytes;
  wrong[0] = 1;
  write_bytes(d.file("magic.bin"), wrong);
  refused(d.file("magic.bin"), models::TokenFormat::llmc, 100, {d.file("magic.bin"), "magic", "--data-format u16"});
  wrong = bytes;
  wrong[4] = 2;
  write_bytes(d.file("version.bin"), wrong);
  refused(d.file("version.bin"), models::TokenFormat::llmc, 100, {"version 2, expected 1"});
  write_bytes(d.file("short.bin"), bytes.substr(0, bytes.size() - 2));
  refused(d.file("short.bin"), models::TokenFormat::llmc, 100, {"the header says 40 tokens but the file holds 39"});
  refused(d.file("good.bin"), models::TokenFormat::u16, 65536,
          {d.file("good.bin"), "is an llm.c token shard", "40 tokens", "leave --data-format out"});
  write_bytes(d.file("odd.u16"), std::string(81, '\0'));
  refused(d.file("odd.u16"), models::TokenFormat::u16, 100, {"81 bytes: not a whole number of uint16 tokens"});
  std::vector<uint16_t> big = ok;
  big[33] = 100;
  test::write_llmc_shard(d.file("big.bin"), big);
  refused(d.file("big.bin"), models::TokenFormat::llmc, 100,
          {d.file("big.bin"), "token 100 at byte offset 1090 (token 33 of the file) is not below --vocab-size 100"});
  refused(d.file("none_*.bin"), models::TokenFormat::llmc, 100, {"--data", "matches no file"});
  test::write_llmc_shard(d.file("tiny.bin"), std::vector<uint16_t>(9, 1));
  refused(d.file("tiny.bin"), models::TokenFormat::llmc, 100, {"9 tokens in all, fewer than --block-size + 2 = 10"});
  // --data-format auto: llm.c's magic means tokens; a .bin without it is refused, other files are text.
  EXPECT_TRUE(models::is_token_data(d.file("good.bin"), "--data-format"));
  write_bytes(d.file("plain.txt"), "some text\n");
  EXPECT_FALSE(models::is_token_data(d.file("plain.txt"), "--data-format"));
  write_bytes(d.file("nano.bin"), std::string(64, '\1'));
  EXPECT_THROW(models::is_token_data(d.file("nano.bin"), "--data-format"), std::invalid_argument);
}

TEST(SyntheticData, ASampleDependsOnItsIndexAloneAndThePoolRepeats) {
  const int64_t width = 16, pool = models::pool_samples(2 * width);
  EXPECT_EQ(pool % 256, 0);
  EXPECT_GE(pool, 256);
  auto data = models::make_synthetic(width, 7, kCPU);
  // A batch that crosses a chunk boundary (256) row by row equals single-sample requests, asked
  // in another order from a fresh stream (so the chunks are generated in another order too).
  auto fresh = models::make_synthetic(width, 7, kCPU);
  const models::Batch b_x = data->rows(250, 12);
  const Tensor x = b_x.x, y = b_x.targets.at(0);
  for (int64_t k = 11; k >= 0; --k) {
    const models::Batch b_x1 = fresh->rows(250 + k, 1);
    const Tensor x1 = b_x1.x, y1 = b_x1.targets.at(0);
    EXPECT_EQ(row_of(x, k), row_of(x1, 0)) << k;
    EXPECT_EQ(row_of(y, k), row_of(y1, 0)) << k;
  }
  // The pool wraps: sample pool + j is sample j, also across the wrap inside one request.
  const models::Batch b_xw = data->rows(pool - 2, 4);
  const Tensor xw = b_xw.x, yw = b_xw.targets.at(0);
  const models::Batch b_x0 = data->rows(0, 2);
  const Tensor x0 = b_x0.x, y0 = b_x0.targets.at(0);
  EXPECT_EQ(row_of(xw, 2), row_of(x0, 0));
  EXPECT_EQ(row_of(yw, 3), row_of(y0, 1));
  EXPECT_NE(row_of(xw, 1), row_of(x0, 1));
  // Another seed, other samples; x is standard normal and y is not degenerate.
  auto other = models::make_synthetic(width, 8, kCPU);
  EXPECT_NE(row_of(other->rows(0, 1).x, 0), row_of(x0, 0));
  const models::Batch b_xs = data->rows(0, 256);
  const Tensor xs = b_xs.x, ys = b_xs.targets.at(0);
  const double m = mean(xs).item(), var = mean(mul(xs, xs)).item() - m * m;
  EXPECT_NEAR(m, 0.0, 0.05);
  EXPECT_NEAR(var, 1.0, 0.1);
  EXPECT_GT(mean(mul(ys, ys)).item(), 0.1);
}

// The multi-task stream: one [N, 1] target per task, each from its own teacher, x shared.
TEST(SyntheticData, MultiTaskTargetsComeFromATeacherEach) {
  auto data = models::make_synthetic_tasks(10, 5, 3, 7, kCPU);
  const models::Batch b = data->rows(100, 300);
  ASSERT_EQ(b.targets.size(), 3u);
  EXPECT_EQ(b.x.shape(), (Shape{300, 10}));
  for (const Tensor& t : b.targets) {
    EXPECT_EQ(t.shape(), (Shape{300, 1}));
    EXPECT_GT(mean(mul(t, t)).item(), 0.01);
  }
  EXPECT_NE(b.targets[0].to_vector(), b.targets[1].to_vector());
  auto again = models::make_synthetic_tasks(10, 5, 3, 7, kCPU);
  EXPECT_EQ(again->rows(100, 300).targets[2].to_vector(), b.targets[2].to_vector());
}

}  // namespace
}  // namespace amp
