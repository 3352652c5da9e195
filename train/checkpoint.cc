#include "train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <span>
#include <utility>

#include "net/base/error.h"
#include "train/crc32.h"

namespace qring::train {
namespace {

static_assert(std::endian::native == std::endian::little, "checkpoints assume little-endian");

constexpr char kMagic[8] = {'Q', 'R', 'I', 'N', 'G', 'C', 'K', '\0'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeader = 24;

// Appends to a buffer reserved to its final size by the caller (one allocation, no copies
// as it grows: the state sent to a rejoining rank is encoded between two steps).
template <class Bytes>
class Writer {
 public:
  explicit Writer(Bytes& out, size_t size) : buf(out) {
    buf.clear();
    buf.reserve(size);
  }
  template <class U>
  void put(U v) {
    const auto* p = reinterpret_cast<const typename Bytes::value_type*>(&v);
    buf.insert(buf.end(), p, p + sizeof(U));
  }
  template <class U>
  void put_array(std::span<const U> v) {
    put<uint64_t>(v.size());
    const auto* p = reinterpret_cast<const typename Bytes::value_type*>(v.data());
    buf.insert(buf.end(), p, p + v.size() * sizeof(U));
  }
  Bytes& buf;
};

class Reader {
 public:
  Reader(const std::string& path, const uint8_t* p, size_t n) : path_(path), p_(p), n_(n) {}
  template <class U>
  U get(const char* what) {
    need(sizeof(U), what);
    U v;
    std::memcpy(&v, p_ + off_, sizeof(U));
    off_ += sizeof(U);
    return v;
  }
  // An array where it lies (the element type's alignment is checked by the caller, for the
  // buffer's start; every array of a checkpoint starts at a multiple of its element size).
  template <class U>
  std::span<const U> get_array(const char* what) {
    const uint64_t count = get<uint64_t>(what);
    if (count > (n_ - off_) / sizeof(U)) {
      throw DataError(
          fmt::format("{}: corrupt checkpoint: {} length {} exceeds the file", path_, what, count));
    }
    const U* first = reinterpret_cast<const U*>(p_ + off_);
    if (reinterpret_cast<uintptr_t>(first) % alignof(U) != 0)
      throw DataError(fmt::format("{}: corrupt checkpoint: {} is not aligned", path_, what));
    off_ += count * sizeof(U);
    return {first, size_t(count)};
  }
  size_t remaining() const { return n_ - off_; }

 private:
  void need(size_t k, const char* what) {
    if (n_ - off_ < k)
      throw DataError(fmt::format("{}: corrupt checkpoint: payload ends inside {}", path_, what));
  }
  const std::string& path_;
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
};

uint32_t crc(const uint8_t* p, size_t n) {
  return crc32_ieee(0, p, n);
}

[[noreturn]] void sys_fail(const std::string& what, const std::string& path) {
  throw Error(fmt::format("checkpoint {}: {} failed: {}", path, what, std::strerror(errno)));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// The checks of the 24-byte header against a file (or buffer) of `size` bytes: magic, version,
// payload length. Returns the payload length.
uint64_t check_header(const uint8_t* head, uint64_t size, const std::string& path) {
  if (std::memcmp(head, kMagic, sizeof(kMagic)) != 0)
    throw DataError(fmt::format("{}: not a qring checkpoint (bad magic)", path));
  uint32_t version;
  uint64_t payload;
  std::memcpy(&version, head + 8, 4);
  std::memcpy(&payload, head + 16, 8);
  if (version != kVersion)
    throw DataError(fmt::format("{}: unsupported checkpoint version {} (this build reads {})", path,
                                version, kVersion));
  if (payload != size - kHeader - 4)
    throw DataError(fmt::format("{}: {} checkpoint: header says {} payload bytes, file has {}",
                                path, payload > size - kHeader - 4 ? "truncated" : "corrupt",
                                payload, size - kHeader - 4));
  return payload;
}

}  // namespace

CheckpointView view_of(const CheckpointState& s) {
  CheckpointView v;
  v.step = s.step;
  v.position = s.position;
  v.config_fingerprint = s.config_fingerprint;
  v.world = s.world;
  v.rank = s.rank;
  v.params = s.params;
  v.velocity = s.velocity;
  v.carry = s.carry;
  v.rng_state = s.rng_state;
  v.meta = s.meta;
  return v;
}

CheckpointState state_of(const CheckpointView& v) {
  CheckpointState s;
  s.step = v.step;
  s.position = v.position;
  s.config_fingerprint = v.config_fingerprint;
  s.world = v.world;
  s.rank = v.rank;
  s.params.assign(v.params.begin(), v.params.end());
  s.velocity.assign(v.velocity.begin(), v.velocity.end());
  s.carry.assign(v.carry.begin(), v.carry.end());
  s.rng_state.assign(v.rng_state.begin(), v.rng_state.end());
  s.meta.assign(v.meta);
  return s;
}

size_t encoded_checkpoint_size(const CheckpointView& s) {
  return kHeader + 3 * 8 + 8 + 2 * 4 + 5 * 8 +
         4 * (s.params.size() + s.velocity.size() + s.carry.size()) + s.rng_state.size() +
         s.meta.size() + 4;
}

namespace {
template <class Bytes>
void encode(const CheckpointView& s, Bytes& out) {
  Writer<Bytes> w(out, encoded_checkpoint_size(s));
  const auto* magic = reinterpret_cast<const typename Bytes::value_type*>(kMagic);
  w.buf.insert(w.buf.end(), magic, magic + sizeof(kMagic));
  w.template put<uint32_t>(kVersion);
  w.template put<uint32_t>(0);
  w.template put<uint64_t>(0);  // payload length, patched below
  w.template put<uint64_t>(s.step);
  w.template put<int64_t>(s.position.epoch);
  w.template put<int64_t>(s.position.index);
  w.template put<uint64_t>(s.config_fingerprint);
  w.template put<uint32_t>(s.world);
  w.template put<uint32_t>(s.rank);
  w.put_array(s.params);
  w.put_array(s.velocity);
  w.put_array(s.carry);
  w.put_array(s.rng_state);
  w.put_array(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.meta.data()), s.meta.size()));
  const uint64_t payload = w.buf.size() - kHeader;
  std::memcpy(w.buf.data() + 16, &payload, sizeof(payload));
  w.template put<uint32_t>(crc(reinterpret_cast<const uint8_t*>(w.buf.data()), w.buf.size()));
  if (w.buf.size() != encoded_checkpoint_size(s))
    throw Error(fmt::format("checkpoint encoding: {} bytes, {} expected", w.buf.size(),
                            encoded_checkpoint_size(s)));
}
}  // namespace

std::vector<uint8_t> encode_checkpoint(const CheckpointState& s) {
  return encode_checkpoint(view_of(s));
}

std::vector<uint8_t> encode_checkpoint(const CheckpointView& s) {
  std::vector<uint8_t> out;
  encode(s, out);
  return out;
}

void encode_checkpoint_into(const CheckpointView& s, std::vector<char>& out) {
  encode(s, out);
}

void save_checkpoint(const std::string& path, const CheckpointState& s,
                     const std::function<void()>& before_rename) {
  const std::vector<uint8_t> bytes = encode_checkpoint(s);
  const std::string tmp = path + ".tmp";
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));  // the umask decides (qring-train: run.umask)
  if (fd.get() < 0) sys_fail("open " + tmp, path);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int saved = errno;
      ::unlink(tmp.c_str());
      errno = saved;
      sys_fail("write " + tmp, path);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) sys_fail("fsync " + tmp, path);
  if (::close(fd.release()) != 0) sys_fail("close " + tmp, path);
  if (before_rename) before_rename();
  if (::rename(tmp.c_str(), path.c_str()) != 0) sys_fail("rename " + tmp, path);
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0) sys_fail("open directory " + dir, path);
  if (::fsync(dfd.get()) != 0) sys_fail("fsync directory " + dir, path);
}

uint64_t max_checkpoint_bytes(size_t n_params) {
  return kHeader + 4 + 3 * 8 + 8 + 2 * 4 + 5 * 8 + 3 * 4 * uint64_t(n_params) + 2 * (1u << 20);
}

CheckpointState load_checkpoint(const std::string& path, uint64_t max_bytes) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0)
    throw DataError(fmt::format("{}: cannot open checkpoint: {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    throw DataError(fmt::format("{}: cannot stat checkpoint: {}", path, std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    throw DataError(fmt::format("{}: not a regular file", path));
  const uint64_t size = uint64_t(st.st_size);
  if (max_bytes > 0 && size > max_bytes)
    throw DataError(fmt::format("{}: {} bytes, more than the limit of {} bytes that a "
                                "checkpoint of this model can have",
                                path, size, max_bytes));
  auto read_all = [&](uint8_t* p, size_t n, const char* what) {
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::read(fd.get(), p + got, n - got);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0)
        throw DataError(fmt::format("{}: read error in the {}: {}", path, what,
                                    std::strerror(errno)));
      if (r == 0) break;
      got += size_t(r);
    }
    if (got < n)
      throw DataError(fmt::format("{}: truncated checkpoint: the file ended in the {}", path,
                                  what));
  };
  if (size < kHeader + 4)
    throw DataError(fmt::format("{}: truncated checkpoint ({} bytes, header alone is {})", path,
                                size, kHeader + 4));
  // The header first: a wrong one costs 24 bytes of reading, whatever the file's size.
  std::vector<uint8_t> buf(kHeader);
  read_all(buf.data(), kHeader, "header");
  check_header(buf.data(), size, path);
  buf.resize(size_t(size));
  read_all(buf.data() + kHeader, size_t(size) - kHeader, "body");
  return decode_checkpoint(buf, path);
}

CheckpointView decode_checkpoint_view(std::span<const uint8_t> buf, const std::string& path) {
  if (reinterpret_cast<uintptr_t>(buf.data()) % alignof(float) != 0)
    throw UsageError(fmt::format("{}: checkpoint bytes must start at a 4-byte boundary", path));
  if (buf.size() < kHeader + 4) {
    throw DataError(fmt::format("{}: truncated checkpoint ({} bytes, header alone is {})", path,
                                buf.size(), kHeader + 4));
  }
  const uint64_t payload = check_header(buf.data(), buf.size(), path);
  uint32_t stored;
  std::memcpy(&stored, buf.data() + kHeader + payload, 4);
  const uint32_t actual = crc(buf.data(), kHeader + payload);
  if (stored != actual) {
    throw DataError(fmt::format("{}: corrupt checkpoint: CRC-32 {:08x}, expected {:08x}", path,
                                actual, stored));
  }
  Reader r(path, buf.data() + kHeader, payload);
  CheckpointView s;
  s.step = r.get<uint64_t>("step");
  s.position.epoch = r.get<int64_t>("epoch");
  s.position.index = r.get<int64_t>("batch index");
  s.config_fingerprint = r.get<uint64_t>("config fingerprint");
  s.world = r.get<uint32_t>("world");
  s.rank = r.get<uint32_t>("rank");
  s.params = r.get_array<float>("params");
  s.velocity = r.get_array<float>("velocity");
  s.carry = r.get_array<float>("carry");
  s.rng_state = r.get_array<uint8_t>("rng state");
  const auto meta = r.get_array<uint8_t>("meta");
  s.meta = std::string_view(reinterpret_cast<const char*>(meta.data()), meta.size());
  if (r.remaining() != 0)
    throw DataError(
        fmt::format("{}: corrupt checkpoint: {} unexpected bytes", path, r.remaining()));
  if (s.position.epoch < 0 || s.position.index < 0)
    throw DataError(fmt::format("{}: corrupt checkpoint: negative data position", path));
  return s;
}

CheckpointState decode_checkpoint(const std::vector<uint8_t>& buf, const std::string& path) {
  return state_of(decode_checkpoint_view(buf, path));
}

std::string checkpoint_path(const std::string& dir, uint64_t step) {
  return fmt::format("{}/ckpt-{:012d}.qck", dir, step);
}

std::vector<uint64_t> checkpoint_steps(const std::string& dir) {
  std::vector<uint64_t> steps;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return steps;
  const std::regex pattern("ckpt-([0-9]{12,20})\\.qck");
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (!e.is_regular_file(ec)) continue;
    const std::string name = e.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, pattern)) continue;
    // Parsed by hand: a stray name past the largest step (ckpt-99999999999999999999.qck)
    // is not a checkpoint this code wrote, and is skipped instead of aborting the resume.
    uint64_t step = 0;
    bool fits = true;
    for (char ch : m[1].str()) {
      const uint64_t digit = uint64_t(ch - '0');
      if (step > (kMaxCheckpointStep - digit) / 10) {
        fits = false;
        break;
      }
      step = step * 10 + digit;
    }
    if (fits && name == fmt::format("ckpt-{:012d}.qck", step)) steps.push_back(step);
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  const std::vector<uint64_t> steps = checkpoint_steps(dir);
  if (steps.empty()) return std::nullopt;
  return checkpoint_path(dir, steps.front());
}

}  // namespace qring::train
