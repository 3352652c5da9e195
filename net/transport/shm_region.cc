#include "net/transport/shm_region.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <thread>
#include <unordered_map>

namespace qring::net {
namespace {

constexpr size_t kHeaderBytes = 4096;
constexpr uint8_t kVersion = 4;  // libfabric 1.17's SMR_VERSION
constexpr size_t kPidAt = 4;
constexpr size_t kLockAt = 24;

// The mapped header of region `name` when it is a libfabric 1.17 region of process `pid`.
class Header {
 public:
  Header(const std::string& dir, const std::string& name, pid_t pid) {
    const int fd = ::open((dir + "/" + name).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() &&
        size_t(st.st_size) >= kHeaderBytes) {
      void* p = ::mmap(nullptr, kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) base_ = static_cast<uint8_t*>(p);
    }
    if (!base_) {
      ::close(fd);
      return;
    }
    fd_ = fd;
    int32_t owner = 0;
    std::memcpy(&owner, base_ + kPidAt, sizeof(owner));
    if (base_[0] != kVersion || owner != pid) {
      ::munmap(base_, kHeaderBytes);
      base_ = nullptr;
    }
  }
  ~Header() {
    if (base_) ::munmap(base_, kHeaderBytes);
    if (fd_ >= 0) ::close(fd_);  // drops the flock too
  }
  Header(const Header&) = delete;
  Header& operator=(const Header&) = delete;

  pthread_spinlock_t* lock() const {
    return base_ ? reinterpret_cast<pthread_spinlock_t*>(base_ + kLockAt) : nullptr;
  }

  // Whether this process is now the one releaser of the region (an exclusive flock on its
  // file, held until the header goes). Several may try at once: the survivors of a rank each
  // look, and its launcher. A second releaser that unlocked after the first would break the
  // lock of a sender that took it in between.
  bool sole_releaser() const { return fd_ >= 0 && ::flock(fd_, LOCK_EX | LOCK_NB) == 0; }

 private:
  uint8_t* base_ = nullptr;
  int fd_ = -1;
};

struct Region {
  pid_t owner;
  std::string name;
  ino_t inode;
};

// The region files in `dir` that this user owns, each with the pid in its name
// "<pid>:<n>:<m>" (all decimal); only those of `pid` unless it is 0.
std::vector<Region> regions(pid_t pid, const std::string& dir) {
  std::vector<Region> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    const char* name = e->d_name;
    const char* end = name + std::strlen(name);
    long owner = 0;
    unsigned long n = 0;
    auto r0 = std::from_chars(name, end, owner);
    if (r0.ec != std::errc() || r0.ptr == end || *r0.ptr != ':' || owner <= 0) continue;
    if (pid != 0 && owner != pid) continue;
    auto r1 = std::from_chars(r0.ptr + 1, end, n);
    if (r1.ec != std::errc() || r1.ptr == end || *r1.ptr != ':') continue;
    auto r2 = std::from_chars(r1.ptr + 1, end, n);
    if (r2.ec != std::errc() || r2.ptr != end) continue;
    struct stat st {};
    if (::fstatat(::dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != ::geteuid())
      continue;
    out.push_back({pid_t(owner), name, st.st_ino});
  }
  ::closedir(d);
  return out;
}

// The regions in `dir` whose process no longer exists, not even as a zombie awaiting its
// reaper.
std::vector<Region> dead_regions(const std::string& dir) {
  std::vector<Region> out;
  for (Region& r : regions(0, dir))
    if (::kill(r.owner, 0) != 0 && errno == ESRCH) out.push_back(std::move(r));
  return out;
}

}  // namespace

std::vector<std::string> shm_regions_of(pid_t pid, const std::string& dir) {
  std::vector<std::string> out;
  if (pid <= 0) return out;
  for (auto& r : regions(pid, dir)) out.push_back(std::move(r.name));
  return out;
}

std::vector<std::string> release_locks_of_dead_processes(std::chrono::milliseconds confirm,
                                                         const std::string& dir) {
  std::vector<std::string> released;
  for (const Region& r : dead_regions(dir))
    if (release_dead_shm_lock(r.name, r.owner, confirm, dir)) released.push_back(r.name);
  return released;
}

bool release_dead_shm_lock(const std::string& name, pid_t pid, std::chrono::milliseconds confirm,
                           const std::string& dir) {
  Header h(dir, name, pid);
  pthread_spinlock_t* lock = h.lock();
  if (!lock || !h.sole_releaser()) return false;
  // Held (trylock fails) at every look for `confirm`: the dead owner's, not a live sender's.
  const auto until = std::chrono::steady_clock::now() + confirm;
  while (true) {
    if (::pthread_spin_trylock(lock) == 0) {
      ::pthread_spin_unlock(lock);
      return false;
    }
    if (std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::pthread_spin_unlock(lock);
  return true;
}

DeadShmLockWatch::DeadShmLockWatch(std::chrono::milliseconds period,
                                   std::chrono::milliseconds confirm,
                                   std::function<void(const std::string&)> released,
                                   std::string dir)
    : period_(period), confirm_(confirm), released_(std::move(released)), dir_(std::move(dir)) {
  thread_ = std::thread([this] { run(); });
}

DeadShmLockWatch::~DeadShmLockWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

// Each dead process's region file is looked at once (by its name and inode): a lock that
// nobody owns any more is not taken again for longer than a sender's post, so a region found
// free, released, or not libfabric's stays so. Leftover files of dead processes pile up on a
// node without qring-launch; mapping each of them five times a second would cost more than
// the watch is worth.
void DeadShmLockWatch::run() {
  std::unordered_map<std::string, ino_t> seen;  // dead processes' regions already looked at
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period_, [this] { return stop_; })) {
    lock.unlock();
    std::unordered_map<std::string, ino_t> now;
    for (const Region& r : dead_regions(dir_)) {
      now.emplace(r.name, r.inode);
      auto it = seen.find(r.name);
      if (it != seen.end() && it->second == r.inode) continue;
      if (release_dead_shm_lock(r.name, r.owner, confirm_, dir_) && released_) released_(r.name);
    }
    seen = std::move(now);  // files gone are forgotten
    lock.lock();
  }
}

int take_own_shm_locks() {
  int taken = 0;
  for (const std::string& name : shm_regions_of(::getpid())) {
    Header h(kShmDir, name, ::getpid());
    if (pthread_spinlock_t* lock = h.lock()) {
      ::pthread_spin_lock(lock);  // the mapping goes, the lock in the file stays taken
      ++taken;
    }
  }
  return taken;
}

}  // namespace qring::net
