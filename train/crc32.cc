#include "train/crc32.h"

#include <zlib.h>

#include <algorithm>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define QRING_CRC_CLMUL 1
#endif

namespace qring::train {

uint32_t crc32_ieee_zlib(uint32_t crc, const void* p, size_t n) {
  const auto* b = static_cast<const Bytef*>(p);
  uLong c = crc;
  while (n > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    c = ::crc32(c, b, chunk);
    b += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(c);
}

#ifdef QRING_CRC_CLMUL
namespace {

#define QRING_CLMUL_TARGET __attribute__((target("pclmul,sse4.1")))

QRING_CLMUL_TARGET inline __m128i load(const uint8_t* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}

// x * k folded onto the next 128 bits: low(x)*low(k) ^ high(x)*high(k).
QRING_CLMUL_TARGET inline __m128i fold128(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(
      _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

// Folding by carry-less multiplication for the bit-reflected polynomial 0xEDB88320 (Gopal et
// al., "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", Intel 2009). The
// constants are x^k mod P(x), bit-reflected: k1/k2 fold 512 bits, k3/k4 128 bits, k5 the
// last 64 to 32; mu and P' the Barrett reduction. `state` is the running register (not
// inverted), n a multiple of 16 and at least 64.
QRING_CLMUL_TARGET uint32_t fold(uint32_t state, const uint8_t* p, size_t n) {
  const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
  const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124);
  const __m128i mu_p = _mm_set_epi64x(0x1f7011641, 0x1db710641);
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(state)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; n -= 64, p += 64) {
    x1 = fold128(x1, k1k2, load(p));
    x2 = fold128(x2, k1k2, load(p + 16));
    x3 = fold128(x3, k1k2, load(p + 32));
    x4 = fold128(x4, k1k2, load(p + 48));
  }
  x1 = fold128(x1, k3k4, x2);
  x1 = fold128(x1, k3k4, x3);
  x1 = fold128(x1, k3k4, x4);
  for (; n >= 16; n -= 16, p += 16) x1 = fold128(x1, k3k4, load(p));
  // 128 -> 64 bits (appending 32 zero bits), then 64 -> 32.
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(k3k4, x1, 0x01), _mm_srli_si128(x1, 8));
  __m128i x2b = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00), x2b);
  // Barrett reduction to 32 bits.
  x2b = x1;
  x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), mu_p, 0x10);
  x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), mu_p, 0x00);
  x1 = _mm_xor_si128(x1, x2b);
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

bool have_clmul() {
  static const bool ok = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return ok;
}

}  // namespace
#endif

uint32_t crc32_ieee(uint32_t crc, const void* p, size_t n) {
#ifdef QRING_CRC_CLMUL
  if (n >= 64 && have_clmul()) {
    const size_t bulk = n & ~size_t(15);
    crc = ~fold(~crc, static_cast<const uint8_t*>(p), bulk);
    return crc32_ieee_zlib(crc, static_cast<const uint8_t*>(p) + bulk, n - bulk);
  }
#endif
  return crc32_ieee_zlib(crc, p, n);
}

}  // namespace qring::train
