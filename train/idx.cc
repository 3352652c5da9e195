#include "train/idx.h"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "net/base/error.h"

namespace qring::train {
namespace {

constexpr size_t kMaxIdxBytes = size_t{1} << 32;    // 4 GiB: far above any dataset we read
constexpr size_t kTrailingLimit = size_t{1} << 16;  // trailing bytes counted before giving up

struct GzCloser {
  void operator()(gzFile_s* f) const {
    if (f != nullptr) gzclose(f);
  }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

// zlib's gzerror text starts with the path it was opened with; drop that repetition.
std::string zlib_message(const std::string& path, const char* msg) {
  std::string m = msg != nullptr ? msg : "unknown zlib error";
  const std::string prefix = path + ": ";
  if (m.rfind(prefix, 0) == 0) m.erase(0, prefix.size());
  return m;
}

}  // namespace

// A gzip (or plain) stream read in bounded pieces: nothing is inflated beyond what the
// caller asks for, so a small file that inflates to gigabytes costs no more than the IDX
// header says the data needs (a "gzip bomb" is refused after its header).
class IdxStream {
 public:
  explicit IdxStream(const std::string& path) : path_(path) {
    errno = 0;
    f_.reset(gzopen(path.c_str(), "rb"));
    if (!f_) {
      throw DataError(fmt::format("{}: cannot open: {}", path,
                                  errno != 0 ? std::strerror(errno) : "out of memory"));
    }
  }

  // Reads up to n bytes into p; fewer only at the end of the stream. Throws DataError on
  // corrupt or truncated gzip data.
  size_t read(uint8_t* p, size_t n) {
    size_t got = 0;
    while (got < n) {
      const unsigned want = static_cast<unsigned>(std::min<size_t>(n - got, 1 << 20));
      const int k = gzread(f_.get(), p + got, want);
      if (k < 0) {
        int err = 0;
        const char* msg = gzerror(f_.get(), &err);
        throw DataError(
            fmt::format("{}: corrupt or unreadable gzip data: {}", path_,
                        err == Z_ERRNO ? std::strerror(errno) : zlib_message(path_, msg)));
      }
      if (k == 0) break;
      got += static_cast<size_t>(k);
    }
    if (got < n) check_end();
    return got;
  }

 private:
  // At the end of the stream: a truncated or corrupt trailer shows up here.
  void check_end() {
    int err = 0;
    const char* msg = gzerror(f_.get(), &err);
    if (err != Z_OK && err != Z_STREAM_END) {
      throw DataError(
          fmt::format("{}: corrupt or truncated gzip data: {}", path_, zlib_message(path_, msg)));
    }
  }

  const std::string& path_;
  GzFile f_;
};

namespace {

void put_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
}

// The data's first block: what the header claims, but no more than the file can hold. Deflate
// expands at most 1032:1, so a small file whose header claims gigabytes costs no more than
// this; the rest grows as data really arrives.
size_t plausible_bytes(const std::string& path, size_t total) {
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(path, ec);
  if (ec) return std::min(total, size_t{1} << 20);
  return std::min(total, static_cast<size_t>(bytes) * 1040 + (size_t{1} << 20));
}

}  // namespace

IdxReader::IdxReader(const std::string& path)
    : path_(path), in_(std::make_unique<IdxStream>(path_)) {
  uint8_t head[4 + 4 * 4];
  size_t got = in_->read(head, 4);
  if (got < 4) throw DataError(fmt::format("{}: truncated IDX header ({} bytes)", path, got));
  if (head[0] != 0 || head[1] != 0) {
    throw DataError(fmt::format("{}: bad IDX magic number 0x{:02x}{:02x}{:02x}{:02x}", path,
                                head[0], head[1], head[2], head[3]));
  }
  if (head[2] != 0x08) {
    throw DataError(fmt::format("{}: unsupported IDX data type 0x{:02x} (only 0x08, unsigned byte)",
                                path, head[2]));
  }
  const size_t ndims = head[3];
  if (ndims < 1 || ndims > 4)
    throw DataError(fmt::format("{}: bad IDX dimension count {} (1..4)", path, ndims));
  const size_t header = 4 + 4 * ndims;
  got += in_->read(head + 4, header - 4);
  if (got < header) {
    throw DataError(fmt::format("{}: truncated IDX header ({} bytes, need {})", path, got, header));
  }
  total_ = 1;
  for (size_t d = 0; d < ndims; ++d) {
    const uint8_t* p = head + 4 + 4 * d;
    const uint32_t v =
        (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
    if (v == 0 && d > 0) throw DataError(fmt::format("{}: IDX dimension {} is zero", path, d));
    dims_.push_back(v);
    total_ *= v;
    if (total_ > kMaxIdxBytes)
      throw DataError(fmt::format("{}: IDX dimensions are too large", path));
  }
  first_block_ = plausible_bytes(path, total_);
}

IdxReader::~IdxReader() = default;

size_t IdxReader::read(uint8_t* p, size_t n) {
  n = std::min(n, total_ - done_);
  const size_t got = in_->read(p, n);
  if (got < n) {
    throw DataError(fmt::format("{}: truncated IDX data: dimensions need {} bytes, file has {}",
                                path_, total_, done_ + got));
  }
  crc_ = static_cast<uint32_t>(crc32_z(crc_, p, n));
  done_ += n;
  return n;
}

void IdxReader::finish() {
  // At most kTrailingLimit bytes more, to tell a clean end from trailing data.
  std::vector<uint8_t> extra(kTrailingLimit + 1);
  const size_t trailing = in_->read(extra.data(), extra.size());
  if (trailing > kTrailingLimit) {
    throw DataError(fmt::format("{}: more than {} trailing bytes after the IDX data ({} expected)",
                                path_, kTrailingLimit, total_));
  }
  if (trailing > 0) {
    throw DataError(fmt::format("{}: {} trailing bytes after the IDX data ({} expected)", path_,
                                trailing, total_));
  }
}

IdxArray read_idx(const std::string& path) {
  IdxReader in(path);
  IdxArray a;
  a.dims = in.dims();
  // The data, read as it arrives (a header may claim more than the file holds).
  a.data.resize(in.first_block());
  size_t at = 0;
  while (at < in.total()) {
    if (at == a.data.size()) a.data.resize(std::min(in.total(), 2 * at));
    at += in.read(a.data.data() + at, a.data.size() - at);
  }
  in.finish();
  return a;
}

void write_idx(const std::string& path, const std::vector<uint32_t>& dims,
               const std::vector<uint8_t>& data, bool gzip) {
  if (dims.empty() || dims.size() > 4)
    throw UsageError(fmt::format("write_idx {}: {} dimensions (1..4)", path, dims.size()));
  std::vector<uint8_t> out = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) put_be32(out, d);
  out.insert(out.end(), data.begin(), data.end());
  errno = 0;
  GzFile f(gzopen(path.c_str(), gzip ? "wb6" : "wbT"));
  if (!f) throw Error(fmt::format("{}: cannot create: {}", path, std::strerror(errno)));
  if (gzwrite(f.get(), out.data(), static_cast<unsigned>(out.size())) !=
      static_cast<int>(out.size())) {
    int err = 0;
    throw Error(fmt::format("{}: write failed: {}", path, gzerror(f.get(), &err)));
  }
  if (gzclose(f.release()) != Z_OK) throw Error(fmt::format("{}: close failed", path));
}

void check_idx_image_dims(const std::string& path, const std::vector<uint32_t>& dims,
                          bool require_28x28) {
  if (dims.size() != 3) {
    throw DataError(fmt::format("{}: an images file needs 3 dimensions (count, rows, cols), has {}",
                                path, dims.size()));
  }
  if (require_28x28 && (dims[1] != 28 || dims[2] != 28))
    throw DataError(fmt::format("{}: images are {}x{}, expected 28x28", path, dims[1], dims[2]));
}

IdxArray read_idx_images(const std::string& path, bool require_28x28) {
  IdxArray a = read_idx(path);
  check_idx_image_dims(path, a.dims, require_28x28);
  return a;
}

IdxArray read_idx_labels(const std::string& path, int num_classes) {
  IdxArray a = read_idx(path);
  if (a.dims.size() != 1) {
    throw DataError(
        fmt::format("{}: a labels file needs 1 dimension, has {}", path, a.dims.size()));
  }
  for (size_t i = 0; i < a.data.size(); ++i) {
    if (a.data[i] >= num_classes) {
      throw DataError(fmt::format("{}: label {} at index {} is out of range 0..{}", path, a.data[i],
                                  i, num_classes - 1));
    }
  }
  return a;
}

}  // namespace qring::train
