// scripts/reproduce.py replay-trace: a real job's per-worker step times (../shared/traces)
// turned into a straggler trace that qring-sim and qring-train replay (trace:FILE).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cli_harness.h"
#include "collectives/straggler.h"
#include "temp_dir.h"

namespace qring::testing {
namespace {

namespace fs = std::filesystem;

// The job: 3 steps x 4 ranks, compute times in ms.
const double kTimes[3][4] = {{100, 110, 150, 120}, {200, 260, 210, 250}, {90, 90, 135, 180}};

std::string write_times(const fs::path& dir, const std::string& extra = "") {
  const fs::path f = dir / "times.txt";
  std::ofstream out(f);
  out << "# STEP RANK MS\n";
  for (int s = 0; s < 3; ++s)
    for (int r = 0; r < 4; ++r) out << s << " " << r << " " << kTimes[s][r] << "\n";
  out << extra;
  return f.string();
}

CmdResult replay(const std::string& args) {
  return sh(std::string("/usr/bin/python3 ") + QRING_SOURCE_DIR +
            "/scripts/reproduce.py replay-trace " + args);
}

// delays[t][w] from a trace file.
std::map<int, std::map<int, double>> read_trace(const fs::path& f) {
  std::map<int, std::map<int, double>> d;
  std::ifstream in(f);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    int t, w;
    double ms;
    is >> t >> w >> ms;
    d[t][w] = ms;
  }
  return d;
}

// Every worker's delay is (its rank's time / the fastest sampled rank's - 1) x base, the
// sample fixed within a pass over the job's steps, and the step replayed is t mod 3.
TEST(ReplayTrace, DelaysAreTheExcessOverTheFastestSampledWorker) {
  TempDir dir("qring-replay");
  const std::string times = write_times(dir.path());
  for (int W : {4, 2}) {
    const fs::path out = dir.file("t" + std::to_string(W) + ".txt");
    auto r = replay(out.string() + " " + times + " " + std::to_string(W) + " 7 10 5");
    ASSERT_EQ(r.status, 0) << r.output;
    auto d = read_trace(out);
    ASSERT_EQ(d.size(), 7u);
    for (int pass = 0; pass < 3; ++pass) {
      // The sample of this pass: the ranks (distinct) that explain every step of it.
      std::vector<int> ranks = {0, 1, 2, 3};
      bool found = false;
      do {
        bool ok = true;
        for (int t = 3 * pass; t < std::min(7, 3 * pass + 3) && ok; ++t) {
          ASSERT_EQ(d[t].size(), size_t(W));
          double fastest = 1e300;
          for (int w = 0; w < W; ++w) fastest = std::min(fastest, kTimes[t % 3][ranks[size_t(w)]]);
          for (int w = 0; w < W; ++w)
            ok = ok &&
                 std::abs(d[t][w] - (kTimes[t % 3][ranks[size_t(w)]] / fastest - 1) * 10) < 1e-3;
        }
        found = found || ok;
      } while (!found && std::next_permutation(ranks.begin(), ranks.end()));
      EXPECT_TRUE(found) << "W " << W << " pass " << pass;
    }
    // qring's straggler model reads it: worker w at step t is delayed by the file's ms.
    auto m = collectives::StragglerModel::parse("trace:" + out.string());
    for (int t = 0; t < 7; ++t)
      for (int w = 0; w < W; ++w)
        EXPECT_NEAR(double(m.delay(5, w, uint64_t(t)).count()) / 1000.0, d[t][w], 1e-3);
  }
}

TEST(ReplayTrace, SameSeedSameTraceOtherSeedOtherSample) {
  TempDir dir("qring-replay");
  const std::string times = write_times(dir.path());
  auto text = [&](const std::string& name, int seed) {
    const fs::path out = dir.file(name);
    auto r = replay(out.string() + " " + times + " 2 30 10 " + std::to_string(seed));
    EXPECT_EQ(r.status, 0) << r.output;
    std::ifstream in(out);
    std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return body.substr(body.find('\n') + 1);  // without the header, which names the seed
  };
  EXPECT_EQ(text("a", 1), text("b", 1));
  std::set<std::string> bodies;
  for (int seed = 1; seed <= 6; ++seed) bodies.insert(text("s" + std::to_string(seed), seed));
  EXPECT_GT(bodies.size(), 1u);
}

TEST(ReplayTrace, BadInputIsAClearErrorAndNoCrash) {
  TempDir dir("qring-replay");
  const std::string out = dir.file("out.txt");
  auto expect_error = [&](const std::string& args, const std::string& says) {
    auto r = replay(args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("Traceback"), std::string::npos) << r.output;
  };
  const std::string good = write_times(dir.path());
  expect_error(out + " " + good + " 5 10 10", "5 workers: the job has 4 ranks");
  expect_error(out + " " + good + " 0 10 10", "0 workers");
  expect_error(out + " " + good + " 2 10 -1", "BASE_MS");
  expect_error(out + " " + good + " two 10 10", "must be integers");
  expect_error(out + " " + dir.file("missing.txt") + " 2 10 10", "cannot read");
  const fs::path sub = dir.file("sub");
  fs::create_directories(sub);
  expect_error(out + " " + write_times(sub, "3 0 oops\n") + " 2 10 10", "times.txt:14");
  expect_error(out + " " + write_times(sub, "3 0 -5\n") + " 2 10 10", "MS > 0");
  expect_error(out + " " + write_times(sub, "3 0 100\n") + " 2 10 10", "step 3 has ranks");
}

}  // namespace
}  // namespace qring::testing
