#include "models/gpt2_vocab.h"

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "runtime/core/file_kind.h"

namespace amp::models {

namespace {

// GPT-2's bytes_to_unicode, inverted: code point -> byte (-1: none).
std::array<int, 512> unicode_to_byte() {
  std::array<int, 512> out;
  out.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    out[static_cast<size_t>(printable ? b : next++)] = b;
  }
  return out;
}

// The code points of a UTF-8 string (as nlohmann's parser validated it).
std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int extra = c < 0x80 ? 0 : c < 0xE0 ? 1 : c < 0xF0 ? 2 : 3;
    uint32_t cp = extra == 0 ? c : extra == 1 ? (c & 0x1Fu) : extra == 2 ? (c & 0x0Fu) : (c & 0x07u);
    for (int k = 1; k <= extra && i + static_cast<size_t>(k) < s.size(); ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + static_cast<size_t>(k)]) & 0x3Fu);
    out.push_back(cp);
    i += static_cast<size_t>(extra) + 1;
  }
  return out;
}

}  // namespace

Gpt2Vocab Gpt2Vocab::load(const std::string& path, int64_t vocab_size) {
  if (const std::string kind = irregular_file(path); !kind.empty())  // never opened (a FIFO would block)
    throw std::invalid_argument("--vocab-file " + path + ": is " + kind + ", not GPT-2's vocab.json");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("--vocab-file: cannot open " + path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument("--vocab-file " + path + ": not JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument("--vocab-file " + path + ": not a JSON object of token: id");
  const auto to_byte = unicode_to_byte();
  Gpt2Vocab v;
  std::vector<bool> seen;
  for (const auto& [token, id] : j.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (int64_t{1} << 20))
      throw std::invalid_argument("--vocab-file " + path + ": token " + nlohmann::json(token).dump() + " has id " +
                                  id.dump() + ", not a whole number in [0, 2^20)");
    const auto i = static_cast<size_t>(id.get<int64_t>());
    if (i >= v.bytes_.size()) {
      v.bytes_.resize(i + 1);
      seen.resize(i + 1, false);
    }
    if (seen[i]) throw std::invalid_argument("--vocab-file " + path + ": two tokens have id " + std::to_string(i));
    seen[i] = true;
    std::string bytes;
    for (uint32_t cp : code_points(token)) {
      if (cp >= to_byte.size() || to_byte[cp] < 0) {
        char code[16];
        std::snprintf(code, sizeof code, "U+%04X", static_cast<unsigned>(cp));
        throw std::invalid_argument("--vocab-file " + path + ": token " + nlohmann::json(token).dump() +
                                    " has a character outside GPT-2's byte map (" + code + ")");
      }
      bytes.push_back(static_cast<char>(to_byte[cp]));
    }
    v.bytes_[i] = std::move(bytes);
  }
  for (int64_t i = 0; i < vocab_size; ++i)
    if (static_cast<size_t>(i) >= seen.size() || !seen[static_cast<size_t>(i)])
      throw std::invalid_argument("--vocab-file " + path + ": no token has id " + std::to_string(i) +
                                  ", below --vocab-size " + std::to_string(vocab_size));
  return v;
}

std::string Gpt2Vocab::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    if (id < 0 || id >= size()) throw std::out_of_range("Gpt2Vocab::decode: id " + std::to_string(id) + " has no token");
    out += bytes_[static_cast<size_t>(id)];
  }
  return out;
}

}  // namespace amp::models
