// CRC-32 (the IEEE polynomial of zlib, gzip and PNG), as zlib's crc32(): the checkpoints' and
// the rejoin state's checksum. On x86 with carry-less multiplication (PCLMULQDQ) the bulk is
// folded 64 bytes at a time, 3-4x faster than zlib's table code here; elsewhere, and for the
// tail, it is zlib. Same values either way.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qring::train {

// The CRC-32 of p[0, n) continued from `crc` (0 to start), the value zlib's crc32() gives.
uint32_t crc32_ieee(uint32_t crc, const void* p, size_t n);

// The same with zlib alone (for tests and comparisons).
uint32_t crc32_ieee_zlib(uint32_t crc, const void* p, size_t n);

}  // namespace qring::train
