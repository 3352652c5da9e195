#include "net/base/out_of_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace qring {
namespace {

thread_local const AllocationScope* innermost = nullptr;

// MemAvailable in bytes from /proc/meminfo, read without allocating; 0 when unknown.
size_t mem_available() noexcept {
  const int fd = ::open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[4096];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char* p = std::strstr(buf, "MemAvailable:");
  if (p == nullptr) return 0;
  return size_t(std::strtoull(p + 13, nullptr, 10)) * 1024;
}

double gib(size_t bytes) {
  return double(bytes) / double(size_t{1} << 30);
}

}  // namespace

AllocationFailed::AllocationFailed(size_t bytes) noexcept : bytes_(bytes) {
  const char* what = AllocationScope::current();
  const size_t avail = mem_available();
  char size[96];
  if (bytes > 0)
    std::snprintf(size, sizeof(size), "%zu bytes (%.1f GiB)", bytes, gib(bytes));
  else
    std::snprintf(size, sizeof(size), "memory");
  char tail[64] = "";
  if (avail > 0) std::snprintf(tail, sizeof(tail), " (MemAvailable %.1f GiB)", gib(avail));
  std::snprintf(msg_, sizeof(msg_), "out of memory: cannot allocate %s for %s%s", size,
                what != nullptr ? what : "(unnamed)", tail);
}

AllocationScope::AllocationScope(std::string what) : what_(std::move(what)), outer_(innermost) {
  innermost = this;
}

AllocationScope::~AllocationScope() {
  innermost = outer_;
}

const char* AllocationScope::current() noexcept {
  return innermost != nullptr ? innermost->what_.c_str() : nullptr;
}

std::string out_of_memory_message(const std::bad_alloc& e) {
  if (dynamic_cast<const AllocationFailed*>(&e) != nullptr) return e.what();
  return std::string("out of memory (") + e.what() + ")";
}

}  // namespace qring
