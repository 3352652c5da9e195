#include "net/transport/shm_region.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>
#include <unordered_map>

namespace qring::net {

constexpr size_t kHeaderBytes = 4096;
constexpr uint8_t kVersion = 4;  // libfabric 1.17's SMR_VERSION
constexpr size_t kPidAt = 4;
constexpr size_t kLockAt = 24;

// The mapped header of region `name` when it is a libfabric 1.17 region of process `pid`.
class ShmHeader {
 public:
  ShmHeader(const std::string& dir, const std::string& name, pid_t pid) {
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
  ~ShmHeader() {
    if (base_) ::munmap(base_, kHeaderBytes);
    if (fd_ >= 0) ::close(fd_);  // drops the flock too
  }
  ShmHeader(const ShmHeader&) = delete;
  ShmHeader& operator=(const ShmHeader&) = delete;

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

namespace {


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

// The state letter of process `pid` (/proc/PID/stat, after the command's closing paren);
// 0 when it cannot be read (the process is gone).
char process_state(pid_t pid) {
  const int fd = ::open(("/proc/" + std::to_string(pid) + "/stat").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');
  return paren && paren[1] == ' ' ? paren[2] : 0;
}

bool alive(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  const char st = process_state(pid);
  return st != 0 && st != 'Z' && st != 'X';
}

// Whether a live process that maps one of the files `paths` is stopped (SIGSTOP, a tracer):
// such a process may be inside a region's lock. Reads every process's /proc/PID/maps (only
// after a death, so the cost does not matter). One flag per path.
std::vector<bool> mapped_by_a_stopped_process(const std::vector<std::string>& paths) {
  std::vector<bool> stopped(paths.size(), false);
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return stopped;
  while (dirent* e = ::readdir(d)) {
    pid_t pid = 0;
    const char* end = e->d_name + std::strlen(e->d_name);
    if (std::from_chars(e->d_name, end, pid).ptr != end || pid <= 0) continue;
    const char st = process_state(pid);
    if (st != 'T' && st != 't') continue;
    std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
    for (std::string line; std::getline(maps, line);)
      for (size_t i = 0; i < paths.size(); ++i)
        if (line.size() > paths[i].size() &&
            line.compare(line.size() - paths[i].size(), paths[i].size(), paths[i]) == 0 &&
            line[line.size() - paths[i].size() - 1] == ' ')
          stopped[i] = true;
  }
  ::closedir(d);
  return stopped;
}

bool held_now(pthread_spinlock_t* lock) {
  if (::pthread_spin_trylock(lock) != 0) return true;
  ::pthread_spin_unlock(lock);
  return false;
}

}  // namespace

std::vector<std::string> release_locks_held_by_the_dead(std::chrono::milliseconds confirm,
                                                        const std::string& dir,
                                                        const std::function<bool()>& give_up) {
  struct Candidate {
    Region region;
    std::unique_ptr<ShmHeader> header;
    std::string path;
  };
  std::vector<Candidate> cands;
  for (Region& r : regions(0, dir)) {
    if (!alive(r.owner)) continue;  // the dead's own regions: release_dead_shm_lock
    auto h = std::make_unique<ShmHeader>(dir, r.name, r.owner);
    if (!h->lock() || !held_now(h->lock()) || !h->sole_releaser()) continue;
    std::string path = dir + "/" + r.name;
    cands.push_back({std::move(r), std::move(h), std::move(path)});
  }
  // Held at every look (every 2 ms) for `confirm`, and no process that maps it stopped at
  // any of the looks for that (at the start, every 50 ms, at the end).
  const auto start = std::chrono::steady_clock::now(), until = start + confirm;
  auto next_maps = start;
  while (!cands.empty()) {
    if (give_up && give_up()) return {};
    const auto now = std::chrono::steady_clock::now();
    const bool last = now >= until;
    if (now >= next_maps || last) {
      std::vector<std::string> paths;
      for (const Candidate& c : cands) paths.push_back(c.path);
      const std::vector<bool> stopped = mapped_by_a_stopped_process(paths);
      for (size_t i = cands.size(); i-- > 0;)
        if (stopped[i]) cands.erase(cands.begin() + long(i));
      next_maps = now + std::chrono::milliseconds(50);
    }
    for (size_t i = cands.size(); i-- > 0;)
      if (!held_now(cands[i].header->lock())) cands.erase(cands.begin() + long(i));
    if (last) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::vector<std::string> released;
  for (Candidate& c : cands) {
    ::pthread_spin_unlock(c.header->lock());
    released.push_back(c.region.name);
  }
  return released;
}

std::vector<std::string> shm_regions_of(pid_t pid, const std::string& dir) {
  std::vector<std::string> out;
  if (pid <= 0) return out;
  for (auto& r : regions(pid, dir)) out.push_back(std::move(r.name));
  return out;
}

namespace {

// release_locks_of_dead_processes, adding each region looked at to `seen` (name and inode).
std::vector<std::string> release_dead_locks(std::chrono::milliseconds confirm,
                                            const std::string& dir,
                                            std::unordered_map<std::string, ino_t>& seen) {
  std::vector<std::string> released;
  for (const Region& r : dead_regions(dir)) {
    seen.emplace(r.name, r.inode);
    if (release_dead_shm_lock(r.name, r.owner, confirm, dir)) released.push_back(r.name);
  }
  return released;
}

}  // namespace

std::vector<std::string> release_locks_of_dead_processes(std::chrono::milliseconds confirm,
                                                         const std::string& dir) {
  std::unordered_map<std::string, ino_t> seen;
  return release_dead_locks(confirm, dir, seen);
}

bool release_dead_shm_lock(const std::string& name, pid_t pid, std::chrono::milliseconds confirm,
                           const std::string& dir) {
  ShmHeader h(dir, name, pid);
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
                                   std::chrono::milliseconds live_confirm,
                                   std::function<void(const std::string&)> released,
                                   std::string dir)
    : period_(period),
      confirm_(confirm),
      live_confirm_(live_confirm),
      released_(std::move(released)),
      dir_(std::move(dir)) {
  for (const std::string& name : release_dead_locks(confirm_, dir_, seen_))
    if (released_) released_(name);
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
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period_, [this] { return stop_; })) {
    lock.unlock();
    std::unordered_map<std::string, ino_t> now;
    bool a_death = false;
    for (const Region& r : dead_regions(dir_)) {
      now.emplace(r.name, r.inode);
      auto it = seen_.find(r.name);
      if (it != seen_.end() && it->second == r.inode) continue;
      a_death = true;
      if (release_dead_shm_lock(r.name, r.owner, confirm_, dir_) && released_) released_(r.name);
    }
    seen_ = std::move(now);  // files gone are forgotten
    if (a_death) {  // it may have died posting to a live rank
      const auto stopping = [this] {
        std::lock_guard<std::mutex> l(mu_);
        return stop_;
      };
      for (const std::string& name : release_locks_held_by_the_dead(live_confirm_, dir_, stopping))
        if (released_) released_(name);
    }
    lock.lock();
  }
}

int take_own_shm_locks() {
  int taken = 0;
  for (const std::string& name : shm_regions_of(::getpid())) {
    ShmHeader h(kShmDir, name, ::getpid());
    if (pthread_spinlock_t* lock = h.lock()) {
      ::pthread_spin_lock(lock);  // the mapping goes, the lock in the file stays taken
      ++taken;
    }
  }
  return taken;
}

void give_back_own_shm_locks() {
  for (const std::string& name : shm_regions_of(::getpid())) {
    ShmHeader h(kShmDir, name, ::getpid());
    if (pthread_spinlock_t* lock = h.lock()) ::pthread_spin_unlock(lock);
  }
}

PeerRegionLock::PeerRegionLock(const std::string& name, const std::string& dir) {
  pid_t owner = 0;
  const auto r = std::from_chars(name.data(), name.data() + name.size(), owner);
  if (r.ec == std::errc() && r.ptr != name.data() + name.size() && *r.ptr == ':' && owner > 0) {
    header_ = std::make_unique<ShmHeader>(dir, name, owner);
    if (!header_->lock()) header_.reset();
  }
}

PeerRegionLock::~PeerRegionLock() = default;

bool PeerRegionLock::held() const { return header_ && held_now(header_->lock()); }

std::string take_a_peer_shm_lock() {
  std::vector<std::string> mapped;
  std::ifstream maps("/proc/self/maps");
  const std::string prefix = std::string(" ") + kShmDir + "/";
  for (std::string line; std::getline(maps, line);)
    if (const size_t at = line.find(prefix); at != std::string::npos)
      mapped.push_back(line.substr(at + prefix.size()));
  std::vector<Region> peers;
  for (Region& r : regions(0, kShmDir))
    if (r.owner != ::getpid() && alive(r.owner) &&
        std::find(mapped.begin(), mapped.end(), r.name) != mapped.end())
      peers.push_back(std::move(r));
  std::sort(peers.begin(), peers.end(),
            [](const Region& a, const Region& b) { return a.name < b.name; });
  for (const Region& r : peers) {
    ShmHeader h(kShmDir, r.name, r.owner);
    if (pthread_spinlock_t* lock = h.lock()) {
      ::pthread_spin_lock(lock);  // the mapping goes, the lock in the file stays taken
      return r.name;
    }
  }
  return "";
}

}  // namespace qring::net
