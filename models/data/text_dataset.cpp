#include "models/data/text_dataset.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <vector>

#include "runtime/core/file_kind.h"
#include "runtime/core/fnv1a.h"

namespace amp::models {

namespace {

class Text final : public TextDataset {
 public:
  Text(std::string bytes, int64_t block, Device device, std::string name)
      : bytes_(std::move(bytes)), block_(block), device_(device), name_(std::move(name)) {
    const int64_t n = static_cast<int64_t>(bytes_.size());
    train_ = n * 9 / 10;
    auto check = [&](int64_t size, const char* split) {
      if (size < block_ + 2)
        throw std::invalid_argument(name_ + ": the " + std::string(split) + " split holds " + std::to_string(size) +
                                    " bytes, fewer than --block-size + 2 = " + std::to_string(block_ + 2) +
                                    " (the file has " + std::to_string(n) + " bytes; 9/10 train, 1/10 validation)");
    };
    check(train_, "training");
    check(n - train_, "validation");
    checksum_ = hex64(fnv1a_words(bytes_.data(), bytes_.size()));
  }
  Batch rows(int64_t first, int64_t count) override { return batch(0, train_, first, count); }
  Batch validation_rows(int64_t first, int64_t count) override {
    return batch(train_, static_cast<int64_t>(bytes_.size()) - train_, first, count);
  }
  int64_t train_bytes() const override { return train_; }
  int64_t validation_bytes() const override { return static_cast<int64_t>(bytes_.size()) - train_; }
  nlohmann::json content_checksums() const override { return checksum_; }
  std::string describe() const override {
    return name_ + " (" + std::to_string(train_) + " training bytes, " + std::to_string(validation_bytes()) +
           " validation bytes)";
  }

 private:
  Batch batch(int64_t base, int64_t size, int64_t first, int64_t count) const {
    const int64_t T = block_, span = size - T - 1;
    std::vector<int64_t> x(static_cast<size_t>(count * T)), y(x.size());
    for (int64_t j = 0; j < count; ++j) {
      // (first + j)·T mod span, reduced first so that long runs cannot overflow.
      const int64_t start = (first + j) % span * T % span;
      for (int64_t t = 0; t < T; ++t) {
        x[static_cast<size_t>(j * T + t)] = static_cast<unsigned char>(bytes_[static_cast<size_t>(base + start + t)]);
        y[static_cast<size_t>(j * T + t)] = static_cast<unsigned char>(bytes_[static_cast<size_t>(base + start + t + 1)]);
      }
    }
    Batch b;
    b.x = from_int64(x, {count, T}, device_);
    b.targets = {from_int64(y, {count, T}, device_)};
    b.first = first;
    return b;
  }

  std::string bytes_;
  std::string checksum_;  // of the whole file (both splits)
  int64_t block_;
  Device device_;
  std::string name_;
  int64_t train_ = 0;
};

}  // namespace

std::unique_ptr<TextDataset> make_text_dataset(std::string bytes, int64_t block_size, Device device, std::string name) {
  return std::make_unique<Text>(std::move(bytes), block_size, device, std::move(name));
}

std::unique_ptr<TextDataset> load_text_dataset(const std::string& path, int64_t block_size, Device device) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw std::invalid_argument(
        path + ": --data must be a text file (" +
        (std::filesystem::exists(path, ec) ? "it is " + irregular_file(path)
         : path.find_first_of("*?[") != std::string::npos
             ? "no such file: a glob names token shards, llm.c's or --data-format u16's; text is one file"
             : missing_file(path)) +
        ")");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(path + ": cannot open the --data file");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::invalid_argument(path + ": error reading the --data file");
  return make_text_dataset(std::move(bytes), block_size, device, path);
}

}  // namespace amp::models
