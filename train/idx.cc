#include "train/idx.h"

#include <fmt/format.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "net/error.h"

namespace qring::train {
namespace {

constexpr size_t kMaxIdxBytes = size_t{1} << 32;  // 4 GiB: far above any dataset we read

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

std::vector<uint8_t> read_all(const std::string& path) {
  errno = 0;
  GzFile f(gzopen(path.c_str(), "rb"));
  if (!f) {
    throw DataError(fmt::format("{}: cannot open: {}", path,
                                errno != 0 ? std::strerror(errno) : "out of memory"));
  }
  std::vector<uint8_t> out;
  std::vector<uint8_t> chunk(1 << 20);
  while (true) {
    const int n = gzread(f.get(), chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n < 0) {
      int err = 0;
      const char* msg = gzerror(f.get(), &err);
      throw DataError(fmt::format("{}: corrupt or unreadable gzip data: {}", path,
                                  err == Z_ERRNO ? std::strerror(errno) : zlib_message(path, msg)));
    }
    if (n == 0) break;
    out.insert(out.end(), chunk.begin(), chunk.begin() + n);
    if (out.size() > kMaxIdxBytes) throw DataError(fmt::format("{}: file is too large", path));
  }
  int err = 0;
  const char* msg = gzerror(f.get(), &err);
  if (err != Z_OK && err != Z_STREAM_END) {
    throw DataError(
        fmt::format("{}: corrupt or truncated gzip data: {}", path, zlib_message(path, msg)));
  }
  return out;
}

void put_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
}

}  // namespace

IdxArray read_idx(const std::string& path) {
  std::vector<uint8_t> raw = read_all(path);
  if (raw.size() < 4)
    throw DataError(fmt::format("{}: truncated IDX header ({} bytes)", path, raw.size()));
  if (raw[0] != 0 || raw[1] != 0) {
    throw DataError(fmt::format("{}: bad IDX magic number 0x{:02x}{:02x}{:02x}{:02x}", path, raw[0],
                                raw[1], raw[2], raw[3]));
  }
  if (raw[2] != 0x08) {
    throw DataError(fmt::format("{}: unsupported IDX data type 0x{:02x} (only 0x08, unsigned byte)",
                                path, raw[2]));
  }
  const size_t ndims = raw[3];
  if (ndims < 1 || ndims > 4)
    throw DataError(fmt::format("{}: bad IDX dimension count {} (1..4)", path, ndims));
  const size_t header = 4 + 4 * ndims;
  if (raw.size() < header) {
    throw DataError(
        fmt::format("{}: truncated IDX header ({} bytes, need {})", path, raw.size(), header));
  }
  IdxArray a;
  size_t total = 1;
  for (size_t d = 0; d < ndims; ++d) {
    const uint8_t* p = raw.data() + 4 + 4 * d;
    const uint32_t v =
        (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
    if (v == 0 && d > 0) throw DataError(fmt::format("{}: IDX dimension {} is zero", path, d));
    a.dims.push_back(v);
    total *= v;
    if (total > kMaxIdxBytes)
      throw DataError(fmt::format("{}: IDX dimensions are too large", path));
  }
  const size_t have = raw.size() - header;
  if (have < total) {
    throw DataError(fmt::format("{}: truncated IDX data: dimensions need {} bytes, file has {}",
                                path, total, have));
  }
  if (have > total) {
    throw DataError(fmt::format("{}: {} trailing bytes after the IDX data ({} expected)", path,
                                have - total, total));
  }
  a.data.assign(raw.begin() + static_cast<std::ptrdiff_t>(header), raw.end());
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

IdxArray read_idx_images(const std::string& path, bool require_28x28) {
  IdxArray a = read_idx(path);
  if (a.dims.size() != 3) {
    throw DataError(fmt::format("{}: an images file needs 3 dimensions (count, rows, cols), has {}",
                                path, a.dims.size()));
  }
  if (require_28x28 && (a.dims[1] != 28 || a.dims[2] != 28)) {
    throw DataError(
        fmt::format("{}: images are {}x{}, expected 28x28", path, a.dims[1], a.dims[2]));
  }
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
