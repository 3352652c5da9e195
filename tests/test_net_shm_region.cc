// net/shm_region.h on region files laid out as libfabric 1.17's shm provider lays out its
// regions (the provider itself: Faults/KillLocked.* in test_train_faults.cc).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "net/shm_region.h"

namespace qring::net {
namespace {

using ::testing::Contains;
using ::testing::Not;

// /dev/shm/<pid>:<n>:7 with smr_region's header: the version at byte 0, the owner's pid at
// byte 4 (`header_pid` if not 0), the region lock at byte 24 (held when `locked`).
std::string make_region(pid_t pid, int n, uint8_t version, bool locked, pid_t header_pid = 0) {
  const std::string name = std::to_string(pid) + ":" + std::to_string(n) + ":7";
  const int fd = ::open(("/dev/shm/" + name).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
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
  const int fd = ::open(("/dev/shm/" + name).c_str(), O_RDWR);
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

TEST(ShmRegion, TheLockADeadProcessHeldIsReleased) {
  const auto names = dead_process_regions({4, 4});
  ASSERT_EQ(names.size(), 2u);
  ASSERT_FALSE(lock_free(names[0]));
  const auto released = release_locks_of_dead_processes(std::chrono::milliseconds(10));
  EXPECT_THAT(released, Contains(names[0]));
  EXPECT_THAT(released, Contains(names[1]));
  EXPECT_TRUE(lock_free(names[0]));
  EXPECT_TRUE(lock_free(names[1]));
  // Nothing left to do the second time.
  EXPECT_THAT(release_locks_of_dead_processes(std::chrono::milliseconds(10)),
              Not(Contains(names[0])));
  EXPECT_THAT(shm_regions_of(::atoi(names[0].c_str())),
              ::testing::UnorderedElementsAreArray(names));
  for (const auto& n : names) ::unlink(("/dev/shm/" + n).c_str());
}

TEST(ShmRegion, LiveOwnersAndFilesOfAnotherLayoutAreLeftAlone) {
  // This process is alive: its held lock stays held.
  const std::string mine = make_region(::getpid(), 90, 4, true);
  // A dead process's file of another version, and one whose header names another process.
  const auto other_version = dead_process_regions({5});
  const auto other_owner = dead_process_regions({4}, /*claim=*/::getpid());
  ASSERT_EQ(other_version.size(), 1u);
  ASSERT_EQ(other_owner.size(), 1u);
  for (const auto& n : {mine, other_version[0], other_owner[0]})
    ASSERT_EQ(::access(("/dev/shm/" + n).c_str(), F_OK), 0) << n;
  ASSERT_FALSE(lock_free(other_owner[0]));
  const auto released = release_locks_of_dead_processes(std::chrono::milliseconds(10));
  EXPECT_THAT(released, Not(Contains(mine)));
  EXPECT_THAT(released, Not(Contains(other_version[0])));
  EXPECT_THAT(released, Not(Contains(other_owner[0])));
  EXPECT_FALSE(lock_free(mine));
  EXPECT_FALSE(lock_free(other_version[0]));
  EXPECT_FALSE(lock_free(other_owner[0]));
  // release_dead_shm_lock trusts its caller that the owner died (the reaper), but the header
  // must name the owner the file is named after.
  EXPECT_FALSE(release_dead_shm_lock(other_owner[0], ::atoi(other_owner[0].c_str()),
                                     std::chrono::milliseconds(10)));
  EXPECT_TRUE(release_dead_shm_lock(mine, ::getpid(), std::chrono::milliseconds(10)));
  EXPECT_TRUE(lock_free(mine));
  for (const auto& n : {mine, other_version[0], other_owner[0]})
    ::unlink(("/dev/shm/" + n).c_str());
}

}  // namespace
}  // namespace qring::net
