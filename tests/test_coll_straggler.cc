#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "collectives/fault_inject.h"
#include "collectives/straggler.h"
#include "net/base/error.h"

namespace qring::collectives {
namespace {

using std::chrono::microseconds;

TEST(Straggler, NoneAndFixed) {
  auto none = StragglerModel::parse("none");
  EXPECT_EQ(none.delay(1, 0, 0), microseconds(0));
  auto f = StragglerModel::parse("fixed:2:200");
  EXPECT_EQ(f.delay(1, 2, 7), microseconds(200000));
  EXPECT_EQ(f.delay(1, 1, 7), microseconds(0));
}

TEST(Straggler, DeterministicPerSeedRankStepAndDistinctAcrossThem) {
  for (const char* spec : {"exp:20", "lognormal:2:0.5", "tail:0.5:100", "shiftexp:5:20"}) {
    auto m = StragglerModel::parse(spec);
    EXPECT_EQ(m.delay(7, 3, 11), m.delay(7, 3, 11)) << spec;
    int differ = 0;
    for (uint64_t s = 0; s < 50; ++s) differ += m.delay(7, 3, s) != m.delay(7, 2, s);
    EXPECT_GT(differ, 10) << spec;
  }
}

TEST(Straggler, ExpMeanAndTailProbabilityAreRight) {
  auto e = StragglerModel::parse("exp:20");
  double sum = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) sum += double(e.delay(1, i % 4, uint64_t(i)).count());
  EXPECT_NEAR(sum / n / 1000.0, 20.0, 1.0);
  auto t = StragglerModel::parse("tail:0.1:100");
  int hits = 0;
  for (int i = 0; i < n; ++i) hits += t.delay(3, i % 4, uint64_t(i)).count() == 100000;
  EXPECT_NEAR(double(hits) / n, 0.1, 0.01);
  auto l = StragglerModel::parse("lognormal:0:0");
  EXPECT_EQ(l.delay(1, 0, 0), microseconds(1000));  // exp(0) ms
}

TEST(Straggler, ShiftedExponentialShiftMeanAndSpread) {
  auto m = StragglerModel::parse("shiftexp:10:20");
  EXPECT_EQ(m.kind(), StragglerModel::Kind::kShiftExp);
  EXPECT_EQ(m.spec(), "shiftexp:10:20");
  const int n = 40000;
  double sum = 0, sq = 0, lo = 1e300;
  for (int i = 0; i < n; ++i) {
    double ms = double(m.delay(9, i % 7, uint64_t(i / 7)).count()) / 1000.0;
    sum += ms;
    sq += ms * ms;
    lo = std::min(lo, ms);
  }
  const double mean = sum / n, sd = std::sqrt(sq / n - mean * mean);
  // Mean SHIFT + MEAN, standard deviation MEAN (that of the exponential part), never below
  // the shift.
  EXPECT_NEAR(mean, 30.0, 0.5);
  EXPECT_NEAR(sd, 20.0, 0.6);
  EXPECT_GE(lo, 10.0);
  EXPECT_LT(lo, 10.1);
  // Not the same draws as exp: (other salt), so the two models are independent.
  auto e = StragglerModel::parse("exp:20");
  int same = 0;
  for (uint64_t s = 0; s < 100; ++s)
    same += m.delay(1, 0, s) - microseconds(10000) == e.delay(1, 0, s);
  EXPECT_LT(same, 5);
  // MEAN 0 is the constant SHIFT.
  EXPECT_EQ(StragglerModel::parse("shiftexp:4:0").delay(3, 1, 2), microseconds(4000));
}

TEST(Straggler, TraceFile) {
  std::string path = ::testing::TempDir() + "/trace.txt";
  {
    std::ofstream f(path);
    f << "# step rank ms\n0 1 5\n3, 2, 7.5\n";
  }
  auto m = StragglerModel::parse("trace:" + path);
  EXPECT_EQ(m.delay(0, 1, 0), microseconds(5000));
  EXPECT_EQ(m.delay(0, 2, 3), microseconds(7500));
  EXPECT_EQ(m.delay(0, 2, 0), microseconds(0));
  {
    std::ofstream f(path);
    f << "0 1 5\n1 x 3\n";
  }
  try {
    StragglerModel::parse("trace:" + path);
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(":2:"), std::string::npos) << e.what();
  }
  EXPECT_THROW(StragglerModel::parse("trace:/nonexistent/file"), ConfigError);
}

// resample: a job of S = 3 steps x R = 4 ranks replayed by any number of workers. Every
// delay is that rank's time / the fastest of its job step x scale; a worker keeps one
// column and walks the job's steps in order from its offset, wrapping; each block of R
// workers uses every column once; the draw depends on the seed.
TEST(Straggler, ResampleReplaysColumnsOfARealJobFromSeededOffsets) {
  const double times[3][4] = {{100, 110, 150, 120}, {200, 260, 210, 250}, {90, 90, 135, 180}};
  const std::string path = ::testing::TempDir() + "/times.txt";
  {
    std::ofstream f(path);
    f << "# STEP RANK MS\n";
    for (int st = 0; st < 3; ++st)
      for (int r = 0; r < 4; ++r) f << st << " " << r << " " << times[st][r] << "\n";
  }
  auto m = StragglerModel::parse("resample:10:" + path);
  EXPECT_EQ(m.kind(), StragglerModel::Kind::kResample);
  // delay in ms of (column c, job step s), as the model must produce it.
  auto expect = [&](int c, int st) {
    double fastest = 1e300;
    for (double v : times[st]) fastest = std::min(fastest, v);
    return times[st][c] / fastest * 10;
  };
  for (uint64_t seed : {1, 2, 3}) {
    const int W = 10;
    std::vector<int> col(W), off(W);
    for (int w = 0; w < W; ++w) {
      // The (column, offset) that explains 7 steps of this worker's delays.
      int found = 0;
      for (int c = 0; c < 4; ++c)
        for (int o = 0; o < 3; ++o) {
          bool ok = true;
          for (uint64_t k = 0; k < 7 && ok; ++k)
            ok = std::abs(double(m.delay(seed, w, k).count()) / 1000 -
                          expect(c, int((k + uint64_t(o)) % 3))) < 1e-3;
          if (ok) {
            col[size_t(w)] = c;
            off[size_t(w)] = o;
            ++found;
          }
        }
      // Columns 0 and 1 tie in job step 2 only, so a column is identified by 7 steps.
      ASSERT_GE(found, 1) << "seed " << seed << " worker " << w;
    }
    for (int b = 0; b < 2; ++b) {  // blocks of 4 workers: a permutation of the columns
      std::vector<int> c(col.begin() + 4 * b, col.begin() + 4 * b + 4);
      std::sort(c.begin(), c.end());
      EXPECT_EQ(c, (std::vector<int>{0, 1, 2, 3})) << "seed " << seed << " block " << b;
    }
  }
  // Another seed draws other columns or offsets for some worker.
  bool differs = false;
  for (int w = 0; w < 8 && !differs; ++w)
    for (uint64_t k = 0; k < 3; ++k) differs = differs || m.delay(1, w, k) != m.delay(2, w, k);
  EXPECT_TRUE(differs);
  // The fastest rank of a job step takes the scale; the slowest delay is the job's largest
  // ratio times it.
  double least = 1e300, most = 0;
  for (int w = 0; w < 40; ++w)
    for (uint64_t k = 0; k < 3; ++k) {
      least = std::min(least, double(m.delay(5, w, k).count()) / 1000);
      most = std::max(most, double(m.delay(5, w, k).count()) / 1000);
    }
  EXPECT_NEAR(least, 10, 1e-3);
  EXPECT_NEAR(most, 180.0 / 90 * 10, 1e-3);
  for (const std::string& bad :
       std::vector<std::string>{"resample:10", "resample:x:" + path, "resample:-1:" + path,
                                "resample:10:/nonexistent"})
    EXPECT_THROW(StragglerModel::parse(bad), ConfigError) << bad;
  {
    std::ofstream f(path);
    f << "0 0 10\n0 1 12\n1 0 11\n";  // step 1 lacks rank 1
  }
  EXPECT_THROW(StragglerModel::parse("resample:10:" + path), ConfigError);
  {
    std::ofstream f(path);
    f << "0 0 10\n0 1 0\n";  // a time must be > 0
  }
  EXPECT_THROW(StragglerModel::parse("resample:10:" + path), ConfigError);
}

TEST(Straggler, BadSpecsAreErrors) {
  for (const char* s : {"fixed:2", "fixed:a:3", "exp", "exp:-1", "tail:2:5", "lognormal:1:-1",
                        "weird:1", "fixed:1:2:3", "shiftexp", "shiftexp:1", "shiftexp:1:2:3",
                        "shiftexp:-1:5", "shiftexp:1:-5", "shiftexp:x:5", "shiftexp:1:inf"})
    EXPECT_THROW(StragglerModel::parse(s), ConfigError) << s;
  try {
    StragglerModel::parse("shiftexp:1:-5");
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("shiftexp:1:-5"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("mean"), std::string::npos) << e.what();
  }
  try {
    StragglerModel::parse("weird:1");
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("shiftexp:SHIFT_MS:MEAN_MS"), std::string::npos);
  }
}

// The fault specs of QRING_FAULT and qring-bench --fault (collectives/fault_inject.h), parsed
// here in-process so that the sanitizer builds cover the parser (the programs that take them
// are tested on the Release build: test_coll_bench, test_train_faults).
TEST(FaultSpecs, EveryFormParsesAndPrintsBack) {
  EXPECT_FALSE(FaultSpec::parse(""));
  EXPECT_FALSE(FaultSpec::parse("none"));
  auto k = FaultSpec::parse("kill:1:30");
  ASSERT_TRUE(k);
  EXPECT_EQ(k->action, FaultSpec::Action::kKill);
  EXPECT_EQ(k->rank, 1);
  EXPECT_EQ(k->step, 30u);
  EXPECT_EQ(k->phase, "step");
  EXPECT_TRUE(k->kills());
  EXPECT_EQ(k->spec(), "kill:1:30:step");
  auto l = FaultSpec::parse("kill-locked:2:5:ring");
  ASSERT_TRUE(l);
  EXPECT_EQ(l->action, FaultSpec::Action::kKillLocked);
  EXPECT_EQ(l->spec(), "kill-locked:2:5:ring");
  auto po = FaultSpec::parse("kill-posting:1:9:ring");
  ASSERT_TRUE(po);
  EXPECT_EQ(po->action, FaultSpec::Action::kKillPosting);
  EXPECT_TRUE(po->kills());
  EXPECT_EQ(po->spec(), "kill-posting:1:9:ring");
  auto sl = FaultSpec::parse("stop-locked:2:40:1500:ring");
  ASSERT_TRUE(sl);
  EXPECT_EQ(sl->action, FaultSpec::Action::kStopLocked);
  EXPECT_FALSE(sl->kills());
  EXPECT_EQ(sl->stop_ms, 1500);
  EXPECT_EQ(sl->spec(), "stop-locked:2:40:1500:ring");
  auto s = FaultSpec::parse("stop:3:7:250:ready");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->action, FaultSpec::Action::kStop);
  EXPECT_FALSE(s->kills());
  EXPECT_EQ(s->stop_ms, 250);
  EXPECT_EQ(s->spec(), "stop:3:7:250:ready");
  EXPECT_TRUE(s->matches(3, 9, "ready"));
  EXPECT_FALSE(s->matches(3, 6, "ready"));
  EXPECT_FALSE(s->matches(2, 9, "ready"));
  auto list = FaultSpec::parse_list("kill:1:30,none,kill:3:60:donate");
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[1].rank, 3);
  EXPECT_EQ(list[1].phase, "donate");
  EXPECT_TRUE(FaultSpec::parse_list("").empty());
}

TEST(FaultSpecs, MalformedSpecsAreConfigErrorsNamingThem) {
  for (const char* s : {"kill:1", "explode:1:2", "kill:a:3", "kill:-1:3", "kill:1:2:lunch",
                        "kill:1:2:step:4", "stop:1:2", "stop:1:2:x", "stop:1:2:-5",
                        "kill:1:99999999999999999999", "kill::3", ":"}) {
    try {
      FaultSpec::parse_list(s);
      ADD_FAILURE() << s << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("fault '"), std::string::npos) << e.what();
    }
  }
  try {
    FaultSpec::parse("explode:1:2");
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("explode:1:2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("expected kill:RANK:STEP"), std::string::npos);
  }
}

TEST(Straggler, SleepUnlessStopsEarly) {
  auto t0 = std::chrono::steady_clock::now();
  int calls = 0;
  bool abandoned = sleep_unless(std::chrono::seconds(5), [&] { return ++calls > 3; });
  EXPECT_TRUE(abandoned);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_FALSE(sleep_unless(microseconds(2000)));
}

}  // namespace
}  // namespace qring::collectives
