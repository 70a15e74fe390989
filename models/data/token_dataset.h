// Token data for the GPT: the tokens of one or more shard files, read in place, laid out as text's
// bytes are (text_dataset.h): with N the tokens of the shards' concatenation and T the block size,
// sequence j of the stream (j = i·E + r·K·B + m·B + b: dataset.h) starts at token (j·T) mod (N − T − 1)
// (a sequence may run from one shard into the next); x is its T tokens, the target the T after each.
//
// Formats:
//   llmc  llm.c's shards: a header of 256 int32 (magic 20240520, version 1, the token count, the rest
//         unused), then the tokens as little-endian uint16. Recognised by the magic.
//   u16   nanoGPT's train.bin / val.bin: little-endian uint16 tokens, no header.
// A pattern with * ? or [ is a glob: its files in sorted (byte) order. Every token is checked
// against the vocabulary at load, one shard at a time. The shards are memory-mapped two at a time
// (the stream reads them in order), so resident memory and address space stay about two shards
// whatever the dataset's size.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "models/data/dataset.h"

namespace amp::models {

enum class TokenFormat { llmc, u16 };

// Whether FILE begins with llm.c's magic (20240520): token shards, whatever the file is named.
bool has_llmc_magic(const std::string& path);

// What --data-format auto makes of FILE (the first match of a pattern): llm.c's magic means token
// shards; other files are text, unless named *.bin (refused: a headerless uint16 file needs
// --data-format u16). Throws std::invalid_argument naming the flag and the file.
bool is_token_data(const std::string& pattern, const std::string& format_flag);

// The files of a pattern: itself when it names a file, else its glob's matches, sorted. Throws
// std::invalid_argument naming `flag` when nothing matches.
std::vector<std::string> expand_data_pattern(const std::string& pattern, const std::string& flag);

struct TokenDataOptions {
  std::string train;       // --data: a file or a glob
  std::string validation;  // --val-data: a file or a glob, or empty (no validation)
  TokenFormat format = TokenFormat::llmc;
  int64_t vocab_size = 0;  // every token must be below it
  int64_t block_size = 0;
};

// Throws std::invalid_argument naming the flag or the file: no match, a wrong magic, version or count,
// an odd size, a token not below the vocabulary (with the file, the byte offset and the token's index
// in the file), fewer than block_size + 2 tokens in all.
std::unique_ptr<Dataset> load_token_dataset(const TokenDataOptions& options, Device device);

}  // namespace amp::models
