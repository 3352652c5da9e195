// libFuzzer target: IDX files (train/idx.cc), plain or gzip, through a memory file. Every bad
// input must be a DataError; a gzip bomb must be refused without inflating it (libFuzzer's
// -rss_limit_mb catches one that is not).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <spdlog/spdlog.h>

#include "net/base/error.h"
#include "train/idx.h"

// The parsers log what they reject; at fuzzing rates that is noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("idx", MFD_CLOEXEC);
  if (fd < 0) return 0;
  if (size > 0 && write(fd, data, size) != ssize_t(size)) {
    close(fd);
    return 0;
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    qring::train::read_idx(path);
  } catch (const qring::DataError&) {
  }
  try {
    qring::train::read_idx_labels(path);
  } catch (const qring::DataError&) {
  }
  close(fd);
  return 0;
}
