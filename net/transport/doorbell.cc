#include "net/transport/doorbell.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <spdlog/spdlog.h>

namespace qring::net {

namespace {
constexpr size_t kBellPage = 4096;
constexpr const char* kPrefix = "qring-bell.";

std::string path_of(pid_t pid) {
  return "/dev/shm/" + std::string(kPrefix) + std::to_string(pid);
}

void* map_fd(int fd) {
  void* p = mmap(nullptr, kBellPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  return p == MAP_FAILED ? nullptr : p;
}

// Doorbells of processes that no longer exist (killed: nobody removed them).
void remove_dead_doorbells() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kPrefix, 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + std::char_traits<char>::length(kPrefix), &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
      std::filesystem::remove(e.path(), ec);
  }
}
}  // namespace

std::shared_ptr<Doorbell> Doorbell::own() {
  static std::mutex mu;
  static std::weak_ptr<Doorbell> shared;
  static pid_t shared_pid = 0;  // a child forked after its parent made one needs its own
  std::lock_guard<std::mutex> lock(mu);
  if (shared_pid == getpid())
    if (auto d = shared.lock()) return d;
  remove_dead_doorbells();
  const std::string path = path_of(getpid());
  // A file of an earlier process with this pid holds nothing of value: start afresh.
  ::unlink(path.c_str());
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    spdlog::debug("doorbell {}: {}", path, std::strerror(errno));
    return nullptr;
  }
  if (::ftruncate(fd, kBellPage) != 0) {
    ::close(fd);
    ::unlink(path.c_str());
    return nullptr;
  }
  void* page = map_fd(fd);
  if (!page) {
    ::unlink(path.c_str());
    return nullptr;
  }
  std::shared_ptr<Doorbell> d(new Doorbell(page, path));
  shared = d;
  shared_pid = getpid();
  return d;
}

std::shared_ptr<Doorbell> Doorbell::of(pid_t pid) {
  if (pid <= 0) return nullptr;
  int fd = ::open(path_of(pid).c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kBellPage)) {
    ::close(fd);
    return nullptr;
  }
  void* page = map_fd(fd);
  if (!page) return nullptr;
  return std::shared_ptr<Doorbell>(new Doorbell(page, {}));
}

pid_t Doorbell::pid_in_shm_address(const std::string& addr) {
  size_t pos = addr.find("://");
  pos = pos == std::string::npos ? 0 : pos + 3;
  long pid = 0;
  size_t digits = 0;
  for (; pos < addr.size() && addr[pos] >= '0' && addr[pos] <= '9' && digits < 10; ++pos, ++digits)
    pid = pid * 10 + (addr[pos] - '0');
  if (digits == 0 || pos >= addr.size() || addr[pos] != ':' || pid > INT_MAX) return 0;
  return static_cast<pid_t>(pid);
}

Doorbell::~Doorbell() {
  munmap(page_, kBellPage);
  // Only by the process that made it (not by a child forked with a reference to it).
  if (!remove_.empty() && remove_ == path_of(getpid())) ::unlink(remove_.c_str());
}

void Doorbell::ring() {
  Word& w = word();
  w.seq.fetch_add(1, std::memory_order_seq_cst);
  if (w.sleepers.load(std::memory_order_seq_cst) != 0)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&w.seq), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
            0);
}

bool Doorbell::wait(uint32_t token, std::chrono::nanoseconds max) {
  Word& w = word();
  w.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (w.seq.load(std::memory_order_seq_cst) == token && max.count() > 0) {
    timespec ts{static_cast<time_t>(max.count() / 1'000'000'000),
                static_cast<long>(max.count() % 1'000'000'000)};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&w.seq), FUTEX_WAIT, token, &ts, nullptr, 0);
  }
  w.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return w.seq.load(std::memory_order_seq_cst) != token;
}

}  // namespace qring::net
