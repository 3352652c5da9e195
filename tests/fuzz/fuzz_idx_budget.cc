// libFuzzer target: a Fashion-MNIST directory whose IDX headers are honest (issue 44, N5):
// their counts are what the input says, the data is what the header implies (a sparse file:
// zeros for free), plus trailing bytes from the input. load_fashion_mnist must check all four
// headers, their counts and the memory they imply against the budget before it allocates:
// every outcome is a DataError or a dataset within the budget, and libFuzzer's -rss_limit_mb
// catches an allocation that is not.
//
// Input: u8 flags | u32 train images | u32 train labels | u32 test images | u32 test labels |
// u8 rows | u8 cols | u32 budget in KiB (at most 64 MiB) | trailing bytes of the images file.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "net/base/error.h"
#include "train/dataset.h"

namespace {

std::string dir;

uint32_t u32(const uint8_t*& p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  p += 4;
  return v;
}

void be32(std::string& s, uint32_t v) {
  for (int k = 24; k >= 0; k -= 8) s.push_back(char((v >> k) & 0xff));
}

// An IDX file of `dims` with a hole for its data, then `tail`.
void write_idx(const std::string& name, const std::vector<uint32_t>& dims, const uint8_t* tail,
               size_t tail_len) {
  std::string head = {0, 0, 8, char(dims.size())};
  uint64_t total = 1;
  for (uint32_t d : dims) {
    be32(head, d);
    total *= d;
  }
  const std::string path = dir + "/" + name;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) std::abort();
  if (::write(fd, head.data(), head.size()) != ssize_t(head.size())) std::abort();
  // Beyond 16 GiB the header alone is the test (the data would not be read anyway).
  const uint64_t end = head.size() + std::min<uint64_t>(total, uint64_t{1} << 34);
  if (::ftruncate(fd, off_t(end)) != 0) std::abort();
  if (tail_len > 0 && ::pwrite(fd, tail, tail_len, off_t(end)) != ssize_t(tail_len)) std::abort();
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  dir = "/dev/shm/qring-fuzz-idx-budget-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  std::atexit([] { std::filesystem::remove_all(dir); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 27) return 0;
  const uint8_t* p = data;
  const uint8_t flags = *p++;
  const uint32_t n_train = u32(p), n_train_labels = u32(p), n_test = u32(p), n_test_labels = u32(p);
  const uint8_t rows = *p++, cols = *p++;
  qring::train::MemoryBudget budget;
  budget.bytes = uint64_t(u32(p) % (64u << 10)) << 10;
  budget.source = "fuzz";
  const size_t tail = std::min<size_t>(size - size_t(p - data), 4096);
  // Mostly 28x28 (what the loader accepts), sometimes what the input says.
  const uint32_t r = (flags & 1) ? rows : 28, c = (flags & 2) ? cols : 28;
  write_idx("train-images-idx3-ubyte", {n_train, r, c}, p, (flags & 4) ? tail : 0);
  write_idx("train-labels-idx1-ubyte", {n_train_labels}, nullptr, 0);
  write_idx("t10k-images-idx3-ubyte", {n_test, r, c}, nullptr, 0);
  write_idx("t10k-labels-idx1-ubyte", {n_test_labels}, nullptr, 0);
  try {
    qring::train::DatasetPair d = qring::train::load_fashion_mnist(dir, budget);
    const uint64_t held = (d.train.images.size() + d.test.images.size()) * sizeof(float);
    if (held > budget.bytes) std::abort();  // loaded more than the budget allows
  } catch (const qring::DataError&) {
  }
  return 0;
}
