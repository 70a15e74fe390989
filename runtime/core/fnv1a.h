// FNV-1a, 64 bits, over bytes: a checksum against truncation and damage, and a fingerprint of
// parameters across ranks (not a defence against an adversary). Chain calls to hash several buffers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace amp {

inline constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ull;

inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnv1aOffset) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
  return h;
}

// 16 lowercase hex digits.
inline std::string hex64(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace amp
