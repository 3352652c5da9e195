#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>

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
