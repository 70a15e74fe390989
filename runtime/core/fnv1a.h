// FNV-1a, 64 bits, over bytes: a checksum against truncation and damage, and a fingerprint of
// parameters across ranks (not a defence against an adversary). Chain calls to hash several buffers.
// fnv1a_words is its faster cousin for gigabytes (training data): four FNV-1a lanes over 64-bit
// little-endian words, about eight times the bytes a second; its values are not fnv1a's.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace amp {

static_assert(std::endian::native == std::endian::little, "fnv1a_words reads little-endian words in place");

inline constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ull;

inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnv1aOffset) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
  return h;
}

// Word i of data goes to lane i mod 4, a tail of under 8 bytes to lane 0 byte by byte; the result
// is fnv1a over the four lanes' values (in lane order, as little-endian bytes) and n.
inline uint64_t fnv1a_words(const void* data, size_t n) {
  constexpr uint64_t kPrime = 0x100000001b3ull;
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {kFnv1aOffset, kFnv1aOffset ^ 1, kFnv1aOffset ^ 2, kFnv1aOffset ^ 3};
  const size_t words = n / 8;
  size_t i = 0;
  for (; i + 4 <= words; i += 4)
    for (size_t k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, bytes + 8 * (i + k), 8);
      lane[k] = (lane[k] ^ w) * kPrime;
    }
  for (; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, bytes + 8 * i, 8);
    lane[i % 4] = (lane[i % 4] ^ w) * kPrime;
  }
  lane[0] = fnv1a(bytes + 8 * words, n % 8, lane[0]);
  const uint64_t size = n;
  return fnv1a(&size, sizeof size, fnv1a(lane, sizeof lane));
}

// 16 lowercase hex digits.
inline std::string hex64(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace amp
