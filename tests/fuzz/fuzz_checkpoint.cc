// libFuzzer target: checkpoint files (train/checkpoint.cc) through a memory file. Byte 0 odd:
// the harness writes a valid CRC over the rest first, so the fuzzer gets past the checksum to
// the payload's lengths and arrays. Every bad input must be a DataError.
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "net/base/error.h"
#include "train/checkpoint.h"

// The parsers log what they reject; at fuzzing rates that is noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::vector<uint8_t> file(data + 1, data + size);
  if ((data[0] & 1) && file.size() >= 28) {
    const uLong crc = crc32(0L, file.data(), uInt(file.size() - 4));
    const uint32_t c = uint32_t(crc);
    std::memcpy(file.data() + file.size() - 4, &c, 4);
  }
  const int fd = memfd_create("ckpt", MFD_CLOEXEC);
  if (fd < 0) return 0;
  if (!file.empty() && write(fd, file.data(), file.size()) != ssize_t(file.size())) {
    close(fd);
    return 0;
  }
  try {
    qring::train::load_checkpoint("/proc/self/fd/" + std::to_string(fd));
  } catch (const qring::DataError&) {
  }
  close(fd);
  return 0;
}
