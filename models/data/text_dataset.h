// Text as bytes (a vocabulary of 256: no tokenizer) for the GPT. The first floor(9N/10) bytes of the
// file are the training split, the rest the validation split. With T the block size, sequence j of
// the stream (j = i·E + r·K·B + m·B + b, as for every dataset: dataset.h) starts at byte
// (j·T) mod (N_split − T − 1) of its split; x is its T bytes and the target the T bytes after each.
#pragma once
#include <memory>
#include <string>

#include "models/data/dataset.h"

namespace amp::models {

class TextDataset : public Dataset {
 public:
  bool has_validation() const override { return true; }
  int64_t resume_size() const override { return train_bytes(); }
  virtual int64_t train_bytes() const = 0;
  virtual int64_t validation_bytes() const = 0;
};

// Throws std::invalid_argument naming the file: unreadable, not a regular file, or a split shorter
// than block_size + 2 bytes.
std::unique_ptr<TextDataset> load_text_dataset(const std::string& path, int64_t block_size, Device device);
// The same from bytes in memory (tests).
std::unique_ptr<TextDataset> make_text_dataset(std::string bytes, int64_t block_size, Device device, std::string name);

}  // namespace amp::models
