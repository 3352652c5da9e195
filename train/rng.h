// Deterministic, platform-independent random numbers for the trainer.
//
// xoshiro256** seeded through splitmix64. Unlike <random>'s distributions, every value here is
// specified bit for bit, so the same seed gives the same parameters, shuffles and delays on
// every machine and compiler; the state can be saved in a checkpoint as 32 bytes.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <vector>

namespace qring::train {

// One step of splitmix64: a good 64-bit mixer, used for seeding and for deriving sub-seeds.
inline uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Derives an independent seed from a base seed and a stream id (e.g. seed and epoch).
inline uint64_t derive_seed(uint64_t seed, uint64_t stream) {
  uint64_t x = seed ^ (0xd1b54a32d192ed03ULL * (stream + 1));
  splitmix64(x);
  return splitmix64(x);
}

class Rng {
 public:
  static constexpr size_t kStateBytes = 32;

  explicit Rng(uint64_t seed = 0) { reseed(seed); }

  void reseed(uint64_t seed) {
    uint64_t x = seed;
    for (auto& s : s_) s = splitmix64(x);
  }

  uint64_t next_u64() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

  // Uniform integer in [0, n), n >= 1, without modulo bias (rejection sampling).
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t r;
    do {
      r = next_u64();
    } while (r >= limit);
    return r % n;
  }

  // Standard normal by Box-Muller (one value per call, no cached state).
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

  std::vector<uint8_t> state_bytes() const {
    std::vector<uint8_t> out(kStateBytes);
    for (size_t i = 0; i < 4; ++i)
      for (size_t b = 0; b < 8; ++b) out[i * 8 + b] = static_cast<uint8_t>(s_[i] >> (8 * b));
    return out;
  }

  // Restores a state from state_bytes(); returns false if the size is wrong.
  bool set_state_bytes(const std::vector<uint8_t>& in) {
    if (in.size() != kStateBytes) return false;
    for (size_t i = 0; i < 4; ++i) {
      uint64_t v = 0;
      for (size_t b = 0; b < 8; ++b) v |= static_cast<uint64_t>(in[i * 8 + b]) << (8 * b);
      s_[i] = v;
    }
    return true;
  }

  bool operator==(const Rng& o) const { return s_ == o.s_; }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::array<uint64_t, 4> s_{};
};

}  // namespace qring::train
