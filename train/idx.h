// Reader and writer for the IDX format (MNIST / Fashion-MNIST), plain or gzip-compressed.
//
// IDX: 2 zero bytes, a type byte (only 0x08 = unsigned byte is supported), the number of
// dimensions, then one big-endian uint32 per dimension, then the data. Every problem (cannot
// open, corrupt or truncated gzip, bad magic, unsupported type, bad dimensions, short or
// trailing data, label out of range, count mismatch) throws qring::DataError with a message
// that names the file and what is wrong.
#pragma once

#include <cstdint>
#include <memory>
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

// An IDX file read in order, piece by piece: for data too large to hold twice (the images are
// converted to floats as they are inflated). The constructor reads and checks the header,
// read() hands out the data, finish() checks the end; the same checks and messages as
// read_idx.
class IdxStream;
class IdxReader {
 public:
  explicit IdxReader(const std::string& path);
  ~IdxReader();
  const std::vector<uint32_t>& dims() const { return dims_; }
  size_t total() const { return total_; }  // bytes of data: the product of dims()
  // What to hold at first: total(), or less when the file is too small to hold that much (a
  // header may claim more than the file has).
  size_t first_block() const { return first_block_; }
  // The next min(n, bytes left) bytes of data into p; throws DataError if the file ends first.
  size_t read(uint8_t* p, size_t n);
  // After the data: throws DataError if anything trails it.
  void finish();
  const std::string& path() const { return path_; }
  // CRC-32 (zlib) of the data read so far: with dims(), what tells two files apart.
  uint32_t crc() const { return crc_; }

 private:
  std::string path_;
  std::unique_ptr<IdxStream> in_;
  std::vector<uint32_t> dims_;
  size_t total_ = 0, done_ = 0, first_block_ = 0;
  uint32_t crc_ = 0;
};

// Writes an IDX file of unsigned bytes (gzip-compressed if gzip is true). For tests and tools.
void write_idx(const std::string& path, const std::vector<uint32_t>& dims,
               const std::vector<uint8_t>& data, bool gzip);

// An images file: 3 dimensions (count, rows, cols). Throws DataError unless rows == cols == 28
// when require_28x28.
IdxArray read_idx_images(const std::string& path, bool require_28x28 = true);
// The same checks on the dimensions of an images file alone.
void check_idx_image_dims(const std::string& path, const std::vector<uint32_t>& dims,
                          bool require_28x28 = true);

// A labels file: 1 dimension; every label must be < num_classes.
IdxArray read_idx_labels(const std::string& path, int num_classes = 10);

}  // namespace qring::train
