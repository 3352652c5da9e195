// FNV-1a, 64 bits: the one implementation of the hash that qring's digests and checksums use
// (config fingerprints and per-key digests, replica checksums of the parameters, the
// members hash of an operation's shape).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace qring {

constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ULL;  // FNV's 64-bit offset basis
constexpr uint64_t kFnv1aPrime = 0x100000001b3ULL;

// h, continued over `len` bytes at `data`.
constexpr uint64_t fnv1a64(const void* data, size_t len, uint64_t h = kFnv1aOffset) {
  const auto* b = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < len; ++i) {
    h ^= b[i];
    h *= kFnv1aPrime;
  }
  return h;
}

inline uint64_t fnv1a64(std::string_view text, uint64_t h = kFnv1aOffset) {
  return fnv1a64(text.data(), text.size(), h);
}

}  // namespace qring
