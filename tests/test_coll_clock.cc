// The virtual clock (collectives/virtual_clock.h) and the engine under it: one thread at a
// time, waits that cost no real time, frozen groups, teardown, and collectives that complete
// with no engine thread.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <vector>

#include "coll_harness.h"
#include "collectives/engine.h"
#include "collectives/virtual_clock.h"
#include "sim_harness.h"

namespace qring::testing {
namespace {

using collectives::Deadline;
using std::chrono::milliseconds;

double real_ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

TEST(VirtualClock, SleepsCostNoRealTimeAndWakeInOrder) {
  VirtualClock clock;
  std::vector<int> order;
  const auto t0 = clock.now();
  const auto real0 = std::chrono::steady_clock::now();
  std::vector<std::function<void()>> programs;
  for (int i = 0; i < 3; ++i)
    programs.push_back([&, i] {
      clock.sleep_until(clock.now() + std::chrono::seconds(30 - 10 * i));
      order.push_back(i);
    });
  clock.run(std::move(programs));
  EXPECT_EQ(order, (std::vector<int>{2, 1, 0}));
  EXPECT_GE(clock.now() - t0, std::chrono::seconds(30));
  EXPECT_LT(real_ms_since(real0), 5000) << "virtual seconds took real ones";
}

TEST(VirtualClock, OneThreadRunsAtATime) {
  VirtualClock clock;
  std::atomic<int> inside{0};
  int most = 0;
  std::vector<std::function<void()>> programs;
  for (int i = 0; i < 4; ++i)
    programs.push_back([&] {
      for (int k = 0; k < 50; ++k) {
        most = std::max(most, ++inside);
        std::this_thread::yield();
        --inside;
        clock.sleep_until(clock.now() + milliseconds(1));
      }
    });
  clock.run(std::move(programs));
  EXPECT_EQ(most, 1);
}

TEST(VirtualClock, WaitEndsWhenAnotherThreadMakesItsConditionTrue) {
  VirtualClock clock;
  std::mutex mu;
  std::condition_variable cv;
  bool flag = false;
  double waited_ms = -1;
  clock.run({[&] {
               std::unique_lock<std::mutex> lock(mu);
               const auto t0 = clock.now();
               EXPECT_TRUE(clock.wait_until(lock, cv, clock.now() + std::chrono::hours(1),
                                            [&] { return flag; }));
               waited_ms = std::chrono::duration<double, std::milli>(clock.now() - t0).count();
             },
             [&] {
               clock.sleep_until(clock.now() + milliseconds(700));
               std::lock_guard<std::mutex> lock(mu);
               flag = true;
             }});
  EXPECT_GE(waited_ms, 700);
  EXPECT_LT(waited_ms, 702);
}

TEST(VirtualClock, AWaitPastItsDeadlineReturnsFalseThenAndNotBefore) {
  VirtualClock clock;
  bool got = true;
  double at_ms = 0;
  clock.run({[&] {
    std::mutex mu;
    std::condition_variable cv;
    std::unique_lock<std::mutex> lock(mu);
    const auto t0 = clock.now();
    got = clock.wait_until(lock, cv, t0 + milliseconds(1234), [] { return false; });
    at_ms = std::chrono::duration<double, std::milli>(clock.now() - t0).count();
  }});
  EXPECT_FALSE(got);
  EXPECT_DOUBLE_EQ(at_ms, 1234.0);
}

TEST(VirtualClock, FrozenGroupDoesNotRunUntilItsTimeAndForGoodEndsAtTeardown) {
  VirtualClock clock;
  double woke_ms = -1;
  bool dead_went_on = false;
  clock.run({[&] {
               const auto t0 = clock.now();
               clock.freeze(0, t0 + milliseconds(300));  // SIGSTOP for 300 ms, itself
               woke_ms = std::chrono::duration<double, std::milli>(clock.now() - t0).count();
             },
             [&] {
               clock.freeze(1, Deadline::max());  // SIGKILL: ends with Teardown
               dead_went_on = true;
             },
             [&] { clock.sleep_until(clock.now() + milliseconds(500)); }});
  EXPECT_DOUBLE_EQ(woke_ms, 300.0);
  EXPECT_FALSE(dead_went_on);
}

TEST(VirtualClock, AProgramThatNeverEndsIsStoppedAtTheLimit) {
  VirtualClock clock;
  int rounds = 0;
  EXPECT_THROW(clock.run({[&] {
                            std::mutex mu;
                            std::condition_variable cv;
                            std::unique_lock<std::mutex> lock(mu);
                            // Torn down, the wait returns at once and the loop ends.
                            while (!clock.wait_until(lock, cv, Deadline::max(), [] { return false; }))
                              if (++rounds > 1) break;
                          }},
                          std::chrono::seconds(5)),
               UsageError);
}

// Engines start no thread under the clock: the clock runs their passes while the callers
// block, and a ring all-reduce completes bit-exactly.
TEST(VirtualClock, CollectivesRunOnEnginesTheClockDrives) {
  SimWorld w(4);
  std::vector<size_t> wrong(4, 1);
  w.run([&](int rank, Communicator& comm) {
    const size_t n = 3000;
    std::vector<float> buf(n);
    for (size_t j = 0; j < n; ++j) buf[j] = float(pattern(j, rank));
    comm.allreduce(buf.data(), buf.data(), n, DataType::kFloat32, RedOp::kSum);
    comm.barrier();
    wrong[size_t(rank)] = count_wrong(buf.data(), n, DataType::kFloat32, RedOp::kSum, 4);
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(w.error(r), "") << "rank " << r;
    EXPECT_EQ(wrong[size_t(r)], 0u) << "rank " << r;
  }
}

// A collective whose peer is frozen for good times out on virtual time, naming it.
TEST(VirtualClock, ACollectiveWaitingForAFrozenRankTimesOutOnVirtualTime) {
  CommOptions co;
  co.timeout = milliseconds(2000);
  SimWorld w(3, co);
  const auto real0 = std::chrono::steady_clock::now();
  w.run([&](int rank, Communicator& comm) {
    if (rank == 2) w.kill(2);
    std::vector<float> buf(10, 1.f);
    comm.allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
  });
  for (int r : {0, 1}) {
    EXPECT_NE(w.error(r).find("timed out after"), std::string::npos) << w.error(r);
    EXPECT_NE(w.error(r).find("no answer to a liveness probe from rank(s) 2"), std::string::npos)
        << w.error(r);
  }
  EXPECT_GE(w.elapsed_ms(), 2000);
  EXPECT_LT(real_ms_since(real0), 10000);
}

}  // namespace
}  // namespace qring::testing
