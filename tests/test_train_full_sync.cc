// The backup workers' saving (train/full_sync.h) on made-up arrivals: a pure function, no
// processes, no clocks.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "train/full_sync.h"

namespace {

using qring::train::FullSyncEstimate;

double no_delay(int, uint64_t) { return 0; }

const std::vector<int> kFour{0, 1, 2, 3};

// Quorum = world: every step is decided at its last arrival, so waiting for every rank costs
// nothing more, whatever the arrivals.
TEST(FullSync, QuorumOfTheWholeWorldSavesNothing) {
  FullSyncEstimate e(no_delay);
  for (uint64_t t = 0; t < 100; ++t) {
    std::vector<double> a{0, 3.5 + double(t % 7), 1.25, 40.0 * double(t % 3)};
    double last = 0;
    for (double x : a) last = std::max(last, x);
    e.add(t, a, last + 0.01, kFour);  // decided just after the last one arrived
  }
  EXPECT_EQ(e.steps(), 100);
  EXPECT_DOUBLE_EQ(e.saved_ms(), 0.0);
}

// Quorum 3 of 4, rank 3 arrives late but before it gave up: waiting for it would have cost
// the time from the decision to its arrival.
TEST(FullSync, ALateArrivalCountsFromTheDecision) {
  FullSyncEstimate e(no_delay);
  e.add(0, {0, 1, 2, 12}, 2, kFour);
  EXPECT_DOUBLE_EQ(e.saved_ms(), 10.0);
}

// A rank that never contributed slept its straggler delay: its arrival is its delay beyond
// the first arrival's (rank 1 here, delayed 5 ms; rank 2 delayed 100 ms).
TEST(FullSync, ARankThatGaveUpArrivesAfterItsStragglerDelay) {
  FullSyncEstimate e([](int r, uint64_t) { return r == 2 ? 100.0 : r == 1 ? 5.0 : 20.0; });
  // Ranks 0 and 3 arrive 15 ms after rank 1 (their delays are 20 ms, rank 1's 5 ms).
  e.add(0, {15, 0, -1, 15}, 15, kFour);
  EXPECT_DOUBLE_EQ(e.saved_ms(), 95.0 - 15.0);
}

// A rank still computing step t-1 when the others went on starts step t late: in full sync it
// would have started with them, so its lateness then is not counted again in step t.
TEST(FullSync, TheLagFromTheStepBeforeIsNotCountedTwice) {
  FullSyncEstimate e(no_delay);
  e.add(0, {0, 1, 2, 30}, 2, kFour);   // rank 3 28 ms past the decision
  e.add(1, {0, 1, 2, 31}, 31, kFour);  // waited for rank 3: it was 28 ms behind, 3 ms late
  EXPECT_DOUBLE_EQ(e.saved_ms(), 28.0);
  // After a gap in the steps no lag carries over.
  e.add(5, {0, 1, 2, 31}, 2, kFour);
  EXPECT_DOUBLE_EQ(e.saved_ms(), 28.0 + 29.0);
}

// Ranks outside the view (lost) are not waited for, and a step where nothing arrived (skipped)
// adds nothing.
TEST(FullSync, OnlyTheViewsMembersCount) {
  FullSyncEstimate e([](int r, uint64_t) { return r == 3 ? 1000.0 : 0.0; });
  e.add(0, {0, 1, 2, -1}, 2, {0, 1, 2});
  EXPECT_DOUBLE_EQ(e.saved_ms(), 0.0);
  e.add(1, {-1, -1, -1, -1}, 0, kFour);
  EXPECT_DOUBLE_EQ(e.saved_ms(), 0.0);
  EXPECT_EQ(e.steps(), 1);
}

}  // namespace
