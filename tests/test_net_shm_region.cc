// net/transport/shm_region.h on region files laid out as libfabric 1.17's shm provider lays out its
// regions (the provider itself: Faults/KillLocked.* in test_train_faults.cc).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/transport/shm_region.h"

namespace qring::net {
namespace {

using ::testing::Contains;
using ::testing::Not;

// The region files live in a private directory of each test, not in /dev/shm: the shm
// endpoints of ranks in tests running beside this one (ctest -j) watch /dev/shm for dead
// processes' locks (DeadShmLockWatch) and would release these first.
std::string g_dir;

// <dir>/<pid>:<n>:7 with smr_region's header: the version at byte 0, the owner's pid at
// byte 4 (`header_pid` if not 0), the region lock at byte 24 (held when `locked`).
std::string make_region(pid_t pid, int n, uint8_t version, bool locked, pid_t header_pid = 0) {
  const std::string name = std::to_string(pid) + ":" + std::to_string(n) + ":7";
  const int fd = ::open((g_dir + "/" + name).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  if (fd < 0 || ::ftruncate(fd, 4096) != 0) return "";
  auto* p = static_cast<uint8_t*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  if (p == MAP_FAILED) return "";
  p[0] = version;
  const int32_t owner = header_pid ? header_pid : pid;
  std::memcpy(p + 4, &owner, sizeof(owner));
  auto* lock = reinterpret_cast<pthread_spinlock_t*>(p + 24);
  ::pthread_spin_init(lock, PTHREAD_PROCESS_SHARED);
  if (locked) ::pthread_spin_lock(lock);
  ::munmap(p, 4096);
  return name;
}

// Whether the region's lock is free now (taken and given back if so).
bool lock_free(const std::string& name) {
  const int fd = ::open((g_dir + "/" + name).c_str(), O_RDWR);
  if (fd < 0) return false;
  auto* p = static_cast<uint8_t*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  if (p == MAP_FAILED) return false;
  auto* lock = reinterpret_cast<pthread_spinlock_t*>(p + 24);
  const bool free = ::pthread_spin_trylock(lock) == 0;
  if (free) ::pthread_spin_unlock(lock);
  ::munmap(p, 4096);
  return free;
}

// A process that made `versions.size()` regions (region i with versions[i], its lock held;
// `claim` > 0: a header that names that pid as the owner instead of its own) and then died;
// reaped. Returns the regions' names.
std::vector<std::string> dead_process_regions(std::vector<uint8_t> versions, pid_t claim = 0) {
  const pid_t child = ::fork();
  if (child == 0) {
    for (size_t i = 0; i < versions.size(); ++i)
      make_region(::getpid(), int(i), versions[i], true, claim);
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  std::vector<std::string> names;
  for (size_t i = 0; i < versions.size(); ++i)
    names.push_back(std::to_string(child) + ":" + std::to_string(i) + ":7");
  return names;
}

class ShmRegion : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qring-shm-region-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    g_dir = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(g_dir); }
};

TEST_F(ShmRegion, TheLockADeadProcessHeldIsReleased) {
  const auto names = dead_process_regions({4, 4});
  ASSERT_EQ(names.size(), 2u);
  ASSERT_FALSE(lock_free(names[0]));
  const auto released = release_locks_of_dead_processes(std::chrono::milliseconds(10), g_dir);
  EXPECT_THAT(released, Contains(names[0]));
  EXPECT_THAT(released, Contains(names[1]));
  EXPECT_TRUE(lock_free(names[0]));
  EXPECT_TRUE(lock_free(names[1]));
  // Nothing left to do the second time.
  EXPECT_THAT(release_locks_of_dead_processes(std::chrono::milliseconds(10), g_dir),
              Not(Contains(names[0])));
  EXPECT_THAT(shm_regions_of(::atoi(names[0].c_str()), g_dir),
              ::testing::UnorderedElementsAreArray(names));
  for (const auto& n : names) ::unlink((g_dir + "/" + n).c_str());
}

TEST_F(ShmRegion, LiveOwnersAndFilesOfAnotherLayoutAreLeftAlone) {
  // This process is alive: its held lock stays held.
  const std::string mine = make_region(::getpid(), 90, 4, true);
  // A dead process's file of another version, and one whose header names another process.
  const auto other_version = dead_process_regions({5});
  const auto other_owner = dead_process_regions({4}, /*claim=*/::getpid());
  ASSERT_EQ(other_version.size(), 1u);
  ASSERT_EQ(other_owner.size(), 1u);
  for (const auto& n : {mine, other_version[0], other_owner[0]})
    ASSERT_EQ(::access((g_dir + "/" + n).c_str(), F_OK), 0) << n;
  ASSERT_FALSE(lock_free(other_owner[0]));
  const auto released = release_locks_of_dead_processes(std::chrono::milliseconds(10), g_dir);
  EXPECT_THAT(released, Not(Contains(mine)));
  EXPECT_THAT(released, Not(Contains(other_version[0])));
  EXPECT_THAT(released, Not(Contains(other_owner[0])));
  EXPECT_FALSE(lock_free(mine));
  EXPECT_FALSE(lock_free(other_version[0]));
  EXPECT_FALSE(lock_free(other_owner[0]));
  // release_dead_shm_lock trusts its caller that the owner died (the reaper), but the header
  // must name the owner the file is named after.
  EXPECT_FALSE(release_dead_shm_lock(other_owner[0], ::atoi(other_owner[0].c_str()),
                                     std::chrono::milliseconds(10), g_dir));
  EXPECT_TRUE(release_dead_shm_lock(mine, ::getpid(), std::chrono::milliseconds(10), g_dir));
  EXPECT_TRUE(lock_free(mine));
  for (const auto& n : {mine, other_version[0], other_owner[0]})
    ::unlink((g_dir + "/" + n).c_str());
}

// Several releasers of one region at once (the survivors' watches, the launcher): one acts.
// A sender spinning on the lock takes it the moment that one releases it; a second releaser
// that also unlocked then would break the sender's hold, which the sender sees.
TEST_F(ShmRegion, OnlyOneOfSeveralReleasersActs) {
  const auto names = dead_process_regions({4});
  ASSERT_EQ(names.size(), 1u);
  const pid_t owner = ::atoi(names[0].c_str());
  const int fd = ::open((g_dir + "/" + names[0]).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  auto* p = static_cast<uint8_t*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  ASSERT_NE(p, MAP_FAILED);
  auto* lock = reinterpret_cast<pthread_spinlock_t*>(p + 24);
  std::atomic<bool> got{false}, broken{false};
  std::thread sender([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (::pthread_spin_trylock(lock) != 0)
      if (std::chrono::steady_clock::now() > until) return;
    got = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(40));  // under the releasers' 100
    broken = ::pthread_spin_trylock(lock) == 0;  // free: somebody unlocked it meanwhile
    ::pthread_spin_unlock(lock);
  });
  std::atomic<int> released{0};
  std::vector<std::thread> releasers;
  for (int i = 0; i < 4; ++i)
    releasers.emplace_back([&] {
      released += release_dead_shm_lock(names[0], owner, std::chrono::milliseconds(100), g_dir);
    });
  for (auto& t : releasers) t.join();
  sender.join();
  EXPECT_EQ(released.load(), 1);
  EXPECT_TRUE(got.load());
  EXPECT_FALSE(broken.load()) << "a second releaser unlocked the sender's hold";
  EXPECT_TRUE(lock_free(names[0]));
  ::munmap(p, 4096);
  ::unlink((g_dir + "/" + names[0]).c_str());
}

// The regions a watch reported (from its thread, or its constructor's).
class Reports {
 public:
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& name) {
      std::lock_guard<std::mutex> lock(mu_);
      names_.push_back(name);
      cv_.notify_all();
    };
  }
  // Waits up to 10 s for `name` to be reported.
  bool wait_for(const std::string& name) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] {
      return std::find(names_.begin(), names_.end(), name) != names_.end();
    });
  }
  std::vector<std::string> names() {
    std::lock_guard<std::mutex> lock(mu_);
    return names_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> names_;
};

// The endpoint's watch: a lock held by a process that died after the watch started is released
// by the watch's own thread, within a few periods, and reported once.
TEST_F(ShmRegion, WatchReleasesALockLeftAfterItStarted) {
  Reports reports;
  std::vector<std::string> names;
  {
    DeadShmLockWatch watch(std::chrono::milliseconds(20), std::chrono::milliseconds(10),
                           std::chrono::milliseconds(10), reports.sink(), g_dir);
    names = dead_process_regions({4});
    ASSERT_EQ(names.size(), 1u);
    ASSERT_TRUE(reports.wait_for(names[0])) << "the watch did not release " << names[0];
    EXPECT_TRUE(lock_free(names[0]));
    // Released once: later looks find it free.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto reported = reports.names();
  EXPECT_EQ(std::count(reported.begin(), reported.end(), names[0]), 1);
  ::unlink((g_dir + "/" + names[0]).c_str());
}

// A process that takes the lock of region `name` as a sender posting to it does, then dies
// (kStop: stops itself with SIGSTOP instead, the region still mapped). Returns its pid.
enum class Then { kDie, kStop };
pid_t sender_holding(const std::string& name, Then then) {
  const pid_t child = ::fork();
  if (child == 0) {
    const int fd = ::open((g_dir + "/" + name).c_str(), O_RDWR);
    auto* p = static_cast<uint8_t*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    if (fd < 0 || p == MAP_FAILED) ::_exit(1);
    ::pthread_spin_lock(reinterpret_cast<pthread_spinlock_t*>(p + 24));
    if (then == Then::kStop) ::raise(SIGSTOP);
    ::_exit(0);
  }
  if (then == Then::kDie) {
    int status = 0;
    ::waitpid(child, &status, 0);
  } else {
    int status = 0;
    ::waitpid(child, &status, WUNTRACED);  // stopped, holding the lock
  }
  return child;
}

// A sender killed while it posted to a live rank: that rank's own region stays locked, and
// the rank would wait inside the provider for its own lock for good.
TEST_F(ShmRegion, ALiveRanksRegionLockedByASenderThatDiedIsReleased) {
  const std::string live = make_region(::getpid(), 91, 4, false);
  sender_holding(live, Then::kDie);
  ASSERT_FALSE(lock_free(live));
  // Not the dead's own region: the reaper's release leaves it alone.
  EXPECT_THAT(release_locks_of_dead_processes(std::chrono::milliseconds(10), g_dir),
              Not(Contains(live)));
  ASSERT_FALSE(lock_free(live));
  EXPECT_THAT(release_locks_held_by_the_dead(std::chrono::milliseconds(30), g_dir),
              ::testing::ElementsAre(live));
  EXPECT_TRUE(lock_free(live));
  EXPECT_THAT(release_locks_held_by_the_dead(std::chrono::milliseconds(30), g_dir),
              ::testing::IsEmpty());
  ::unlink((g_dir + "/" + live).c_str());
}

// A stopped process that maps the region may be the holder (a sender paused inside its post):
// left alone, however long; once it is dead, released.
TEST_F(ShmRegion, ALockAStoppedProcessMayHoldIsLeftAlone) {
  const std::string live = make_region(::getpid(), 92, 4, false);
  const pid_t stopped = sender_holding(live, Then::kStop);
  EXPECT_THAT(release_locks_held_by_the_dead(std::chrono::milliseconds(60), g_dir),
              ::testing::IsEmpty());
  EXPECT_FALSE(lock_free(live));
  ::kill(stopped, SIGKILL);
  int status = 0;
  ::waitpid(stopped, &status, 0);
  EXPECT_THAT(release_locks_held_by_the_dead(std::chrono::milliseconds(30), g_dir),
              ::testing::ElementsAre(live));
  EXPECT_TRUE(lock_free(live));
  ::unlink((g_dir + "/" + live).c_str());
}

// A live holder (the owner copying what it received, a sender posting) gives the lock back
// within the confirm time: its hold is never broken.
TEST_F(ShmRegion, ALiveHoldShorterThanTheConfirmTimeIsNotBroken) {
  const std::string live = make_region(::getpid(), 93, 4, false);
  const int fd = ::open((g_dir + "/" + live).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  auto* p = static_cast<uint8_t*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  ASSERT_NE(p, MAP_FAILED);
  auto* lock = reinterpret_cast<pthread_spinlock_t*>(p + 24);
  ::pthread_spin_lock(lock);
  std::atomic<bool> broken{false};
  std::thread holder([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    broken = ::pthread_spin_trylock(lock) == 0;  // free: somebody unlocked it meanwhile
    ::pthread_spin_unlock(lock);
  });
  EXPECT_THAT(release_locks_held_by_the_dead(std::chrono::milliseconds(400), g_dir),
              ::testing::IsEmpty());
  holder.join();
  EXPECT_FALSE(broken.load());
  EXPECT_TRUE(lock_free(live));
  ::munmap(p, 4096);
  ::unlink((g_dir + "/" + live).c_str());
}

// The watch: a process that dies (its own region left behind, as where no qring-launch reaps
// it) after it took a live rank's lock: the watch releases both.
TEST_F(ShmRegion, WatchReleasesALiveRanksLockADeadSenderHeld) {
  Reports reports;
  const std::string live = make_region(::getpid(), 94, 4, false);
  std::vector<std::string> dead;
  {
    DeadShmLockWatch watch(std::chrono::milliseconds(20), std::chrono::milliseconds(10),
                           std::chrono::milliseconds(30), reports.sink(), g_dir);
    sender_holding(live, Then::kDie);
    dead = dead_process_regions({4});
    ASSERT_TRUE(reports.wait_for(live)) << "the watch did not release " << live;
  }
  EXPECT_TRUE(lock_free(live));
  EXPECT_THAT(reports.names(), Contains(dead[0]));
  for (const auto& n : {live, dead[0]}) ::unlink((g_dir + "/" + n).c_str());
}

// Regions left by processes dead before the watch started: their locks are released by the
// constructor (reported before it returns), and they are no new death for the thread, which
// therefore leaves alone a live region whose lock stays held for longer than live_confirm (a
// death since the start would make it look, and release that lock).
TEST_F(ShmRegion, WatchLooksAtDeathsFromBeforeItStartedOnlyWhenItStarts) {
  const std::vector<std::string> dead = dead_process_regions({4});
  ASSERT_EQ(dead.size(), 1u);
  ASSERT_FALSE(lock_free(dead[0]));
  const std::string live = make_region(::getpid(), 95, 4, true);  // held, its owner alive
  Reports reports;
  {
    DeadShmLockWatch watch(std::chrono::milliseconds(20), std::chrono::milliseconds(10),
                           std::chrono::milliseconds(30), reports.sink(), g_dir);
    EXPECT_EQ(reports.names(), std::vector<std::string>{dead[0]});
    EXPECT_TRUE(lock_free(dead[0]));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // 10 periods
  }
  EXPECT_EQ(reports.names(), std::vector<std::string>{dead[0]});
  EXPECT_FALSE(lock_free(live));
  for (const auto& n : {live, dead[0]}) ::unlink((g_dir + "/" + n).c_str());
}

// Stopping does not wait for the next period.
TEST_F(ShmRegion, WatchStopsAtOnce) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    DeadShmLockWatch watch(std::chrono::hours(1), std::chrono::milliseconds(10),
                           std::chrono::milliseconds(10), nullptr, g_dir);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

}  // namespace
}  // namespace qring::net
