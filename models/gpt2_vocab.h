// Decoding GPT-2's token ids to text with its vocab.json (the byte-level BPE's vocabulary: each token a
// string of the code points that GPT-2's bytes_to_unicode gives its bytes: the printable bytes 33-126,
// 161-172 and 174-255 as themselves, the other 68 as 256, 257, ... in byte order; "Ġ" is a space,
// "Ċ" a newline). Decoding only: there is no encoder here (token data comes tokenized).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace amp::models {

class Gpt2Vocab {
 public:
  // Reads vocab.json ({"token": id, ...}). Throws std::invalid_argument naming the file: not JSON, an
  // id that is not a whole number, two tokens with one id, a code point outside the byte map, or an id
  // below vocab_size that no token has.
  static Gpt2Vocab load(const std::string& path, int64_t vocab_size);
  // The bytes of the tokens, in order (they need not be valid UTF-8 one token at a time).
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }

 private:
  std::vector<std::string> bytes_;  // by id
};

}  // namespace amp::models
