// Reader and writer for the IDX format (MNIST / Fashion-MNIST), plain or gzip-compressed.
//
// IDX: 2 zero bytes, a type byte (only 0x08 = unsigned byte is supported), the number of
// dimensions, then one big-endian uint32 per dimension, then the data. Every problem (cannot
// open, corrupt or truncated gzip, bad magic, unsupported type, bad dimensions, short or
// trailing data, label out of range, count mismatch) throws qring::DataError with a message
// that names the file and what is wrong.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qring::train {

struct IdxArray {
  std::vector<uint32_t> dims;
  std::vector<uint8_t> data;  // product(dims) bytes, row-major
};

// Reads an IDX file of unsigned bytes; gzip is detected and decompressed through zlib. The
// header is checked first and the stream is inflated no further than the size it implies
// (plus a little, to detect trailing data): a small file that inflates to gigabytes is
// refused at the cost of its header's claim, never read whole.
IdxArray read_idx(const std::string& path);

// Writes an IDX file of unsigned bytes (gzip-compressed if gzip is true). For tests and tools.
void write_idx(const std::string& path, const std::vector<uint32_t>& dims,
               const std::vector<uint8_t>& data, bool gzip);

// An images file: 3 dimensions (count, rows, cols). Throws DataError unless rows == cols == 28
// when require_28x28.
IdxArray read_idx_images(const std::string& path, bool require_28x28 = true);

// A labels file: 1 dimension; every label must be < num_classes.
IdxArray read_idx_labels(const std::string& path, int num_classes = 10);

}  // namespace qring::train
