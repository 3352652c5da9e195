// Checkpoint files for tests that need one without a model: a sparse file of a given size,
// with the header a real checkpoint of that size would have, or none (zeros).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace qring::testing {

inline void sparse_checkpoint(const std::string& path, uint64_t size, bool with_header) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (with_header) {
      const uint64_t payload = size - 28;  // header 24, CRC 4 (train/checkpoint.h)
      const uint32_t version = 1, reserved = 0;
      out.write("QRINGCK", 8);
      out.write(reinterpret_cast<const char*>(&version), 4);
      out.write(reinterpret_cast<const char*>(&reserved), 4);
      out.write(reinterpret_cast<const char*>(&payload), 8);
    }
  }
  std::filesystem::resize_file(path, size);
}

}  // namespace qring::testing
