// metrics.jsonl and summary.json across coordinator changes (issue 42, case 10): the lines of
// a run written by whichever rank coordinates, each step, view and rejoin exactly once, and the
// summary's counts those of the whole run, also when the rank that writes the summary
// rejoined late. Three ranks' writers on one file, played in the order of a real run where
// the coordinator dies between a step and its line and a rank that rejoined takes over.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "train/metrics_log.h"

namespace qring::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using train::MetricsLog;
using train::RunSummary;

json step(int64_t t) { return {{"type", "step"}, {"step", t}, {"skipped", t == 3}}; }
json view(int64_t epoch, int64_t t, std::vector<int> left, std::vector<int> joined) {
  json l = json::array(), j = json::array();
  for (int r : left) l.push_back({{"rank", r}, {"why", "silent"}, {"silent_ms", 1000}});
  for (int r : joined) j.push_back({{"rank", r}, {"incarnation", 1}, {"step", t}, {"donor", 0}});
  json v{{"type", "view"}, {"step", t}, {"epoch", epoch}, {"left", l}, {"joined", j}};
  if (!left.empty()) v["recovery_s"] = 1.0 + double(epoch) / 10;
  return v;
}
json rejoin(int rank, int64_t counted, double heal) {
  return {{"type", "rejoin"}, {"rank", rank}, {"incarnation", 1}, {"join_step", counted - 1},
          {"counted_step", counted}, {"heal_s", heal}};
}

int count(const std::map<std::string, int>& keys, const std::string& key) {
  auto it = keys.find(key);
  return it == keys.end() ? 0 : it->second;
}

std::map<std::string, int> keys_in(const fs::path& p) {
  std::map<std::string, int> n;
  std::ifstream in(p);
  std::string text;
  while (std::getline(in, text)) ++n[MetricsLog::key_of(json::parse(text))];
  return n;
}

class MetricsAcrossCoordinators : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("qring-metrics-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = dir_ / "metrics.jsonl";
    std::ofstream(path_, std::ios::trunc);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_, path_;
};

// W = 3. Rank 0 coordinates; rank 1 is lost (view 1) and rejoins (view 2, counted at step 6);
// rank 0 completes step 10 and dies before its line; rank 1 takes over (view 3 without rank
// 0), and its loop is one step behind: it logs step 10 (its own, after it leads) late; rank 0
// comes back (view 4). Every step 0..14, view 1..4 and rejoin once; the summary of rank 1
// (which joined at view 2) counts both losses and both rejoins.
TEST_F(MetricsAcrossCoordinators, EveryStepViewAndRejoinOnceAndTheSummaryCountsTheRun) {
  MetricsLog r0(path_, 0), r1(path_, 0), r2(path_, 0);
  for (int64_t t = 0; t < 10; ++t) {
    r0.record(step(t), true);
    r2.record(step(t), false);
    if (t >= 5) r1.record(step(t), false);  // rank 1 is back from step 5
    if (t == 2) {
      r0.record(view(1, 2, {1}, {}), true);
      r2.record(view(1, 2, {1}, {}), false);
    }
    if (t == 5) {
      for (MetricsLog* r : {&r0, &r1, &r2}) r->record(view(2, 5, {}, {1}), r == &r0);
    }
    if (t == 6) {
      r0.record(rejoin(1, 6, 4.5), true);
      r2.record(rejoin(1, 6, 4.5), false);
    }
  }
  // Step 10: completed everywhere, rank 0 killed before its line.
  r2.record(step(10), false);
  // View 3: rank 1 coordinates; rank 2 learns the view and logs step 11 before rank 1 does.
  r2.record(view(3, 11, {0}, {}), false);
  r2.record(step(11), false);
  r1.record(view(3, 11, {0}, {}), true);  // rank 1 leads from here: step 10 comes first
  r1.record(step(10), true);              // its own line of step 10: written already
  r1.record(step(11), true);
  for (int64_t t = 12; t < 15; ++t) {
    r1.record(step(t), true);
    r2.record(step(t), false);
    if (t == 12) {
      r1.record(view(4, 12, {}, {0}), true);
      r2.record(view(4, 12, {}, {0}), false);
    }
    if (t == 13) r1.record(rejoin(0, 13, 2.5), true);
  }
  r1.close();

  const auto keys = keys_in(path_);
  for (int64_t t = 0; t < 15; ++t) EXPECT_EQ(count(keys, "step:" + std::to_string(t)), 1) << t;
  for (int e = 1; e <= 4; ++e) EXPECT_EQ(count(keys, "view:" + std::to_string(e)), 1) << e;
  EXPECT_EQ(count(keys, "rejoin:1.1"), 1);
  EXPECT_EQ(count(keys, "rejoin:0.1"), 1);
  EXPECT_EQ(keys.size(), 15u + 4u + 2u);

  RunSummary sum;  // as rank 1 counted from its own views (it joined at view 2)
  sum.failures_survived = 1;
  sum.rejoins = 1;
  sum.evicted_ranks = {0};
  r1.recount(sum);
  EXPECT_EQ(sum.failures_survived, 2);
  EXPECT_EQ(sum.evicted_ranks, (std::vector<int>{1, 0}));
  EXPECT_EQ(sum.rejoins, 2);
  EXPECT_DOUBLE_EQ(sum.heal_s, 4.5);
  EXPECT_DOUBLE_EQ(sum.recovery_s, 1.3);
  EXPECT_EQ(sum.skipped_steps, 1);
}

// A run resumed at step `start` keeps the earlier invocation's lines before it; the summary
// counts this invocation's only. A torn last line (a coordinator killed mid-write) is skipped,
// and the step it held is written by the next coordinator.
TEST_F(MetricsAcrossCoordinators, ResumedRunCountsItsOwnLinesAndATornLineIsRewritten) {
  {
    std::ofstream f(path_);
    f << view(1, 3, {2}, {}).dump() << '\n' << step(3).dump() << '\n';
    f << R"({"type":"step","step":)";  // torn
  }
  MetricsLog a(path_, 5);
  a.record(step(4), false);
  a.record(step(5), true);
  a.record(view(2, 5, {1}, {}), true);
  a.close();
  std::ifstream in(path_);
  std::string text;
  int torn = 0;
  std::map<std::string, int> keys;
  while (std::getline(in, text)) {
    try {
      ++keys[MetricsLog::key_of(json::parse(text))];
    } catch (const std::exception&) {
      ++torn;
    }
  }
  EXPECT_EQ(torn, 1);
  EXPECT_EQ(keys["step:4"], 1);
  EXPECT_EQ(keys["step:5"], 1);
  RunSummary sum;
  a.recount(sum);
  EXPECT_EQ(sum.failures_survived, 1);
  EXPECT_EQ(sum.evicted_ranks, (std::vector<int>{1}));
}

}  // namespace
}  // namespace qring::testing
