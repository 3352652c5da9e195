// qring-bench as scripts run it: real processes under qring-launch, JSON rows checked for the
// keys scripts depend on and for the values the run must produce.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "cli_harness.h"

namespace {

using qring::testing::CmdResult;
using qring::testing::sh;

namespace fs = std::filesystem;
const std::string kBuild = QRING_BUILD_DIR;

class BenchCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("qring_bench_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string bench(int ranks, const std::string& provider, const std::string& args) {
    return kBuild + "/net/qring-launch -n " + std::to_string(ranks) + " --provider " + provider +
           " -- " + kBuild + "/collectives/qring-bench " + args;
  }
  nlohmann::json rows(const std::string& file) {
    std::ifstream in(dir_ / file);
    EXPECT_TRUE(in.good()) << file;
    return nlohmann::json::parse(in);
  }
  fs::path dir_;
};

TEST_F(BenchCli, AllreduceRowsCarryTheKeysScriptsUse) {
  auto j = (dir_ / "a.json").string();
  CmdResult r = sh(bench(3, "tcp", "--op allreduce -b 4 -e 64K -f 16 -n 2 -w 1 --json " + j));
  ASSERT_EQ(r.status, 0) << r.output;
  auto rs = rows("a.json");
  // Sizes 4, 64, 1K, 16K (the next, 256K, is past -e), each out of place and in place.
  ASSERT_EQ(rs.size(), 8u) << rs.dump();
  std::set<std::pair<uint64_t, bool>> seen;
  for (const auto& row : rs) {
    for (const char* k : {"op", "dtype", "redop", "bytes", "count", "ranks", "provider",
                          "in_place", "time_us", "algbw_gbps", "busbw_gbps", "wrong"})
      EXPECT_TRUE(row.contains(k)) << k << " missing in " << row.dump();
    EXPECT_EQ(row["op"], "allreduce");
    EXPECT_EQ(row["ranks"], 3);
    EXPECT_EQ(std::string(row["provider"]).rfind("tcp", 0), 0u) << row["provider"];  // tcp;ofi_rxm
    EXPECT_EQ(row["wrong"], 0);
    EXPECT_GT(double(row["time_us"]), 0.0);
    // nccl-tests: busbw = algbw * 2 (n - 1) / n for all-reduce.
    EXPECT_NEAR(double(row["busbw_gbps"]), double(row["algbw_gbps"]) * 4.0 / 3.0,
                1e-9 + 1e-6 * double(row["busbw_gbps"]));
    seen.insert({uint64_t(row["bytes"]), bool(row["in_place"])});
  }
  EXPECT_EQ(seen.size(), 8u);
}

// Rank 1 is 300 ms late every step; quorum 2 of 3 with a 1 ms grace drops it every step,
// the --compare-full run (quorum 3) waits for it, and --compare-allreduce pairs every quorum
// step with a plain all-reduce.
TEST_F(BenchCli, QuorumRowsCompareFullAndPlainAllreduce) {
  auto j = (dir_ / "q.json").string();
  CmdResult r = sh(bench(3, "shm",
                   "--op quorum -b 64K -e 64K -n 3 -w 0 --quorum 2 --grace-ms 1 --straggler "
                   "fixed:1:300 --redop avg --compare-full --compare-allreduce --json " +
                       j));
  ASSERT_EQ(r.status, 0) << r.output;
  auto rs = rows("q.json");
  ASSERT_EQ(rs.size(), 3u) << rs.dump();
  const auto& q = rs[0];
  for (const char* k : {"op", "dtype", "redop", "bytes", "count", "ranks", "provider", "in_place",
                        "time_us", "algbw_gbps", "busbw_gbps", "wrong", "quorum", "grace_ms",
                        "straggler", "p50_us", "p99_us", "max_us", "contributors_mean",
                        "dropped", "p50_ratio_vs_full", "p50_ratio_vs_allreduce",
                        "mean_ratio_vs_allreduce"})
    EXPECT_TRUE(q.contains(k)) << k << " missing in " << q.dump();
  EXPECT_EQ(q["op"], "quorum");
  EXPECT_EQ(q["quorum"], 2);
  EXPECT_EQ(q["straggler"], "fixed:1:300");
  EXPECT_EQ(q["wrong"], 0);
  EXPECT_EQ(q["dropped"], 3);  // rank 1, in each of the 3 timed steps
  EXPECT_DOUBLE_EQ(double(q["contributors_mean"]), 2.0);
  EXPECT_LT(double(q["p50_us"]), 250'000.0);

  const auto& full = rs[1];
  EXPECT_EQ(full["quorum"], 3);
  EXPECT_EQ(full["compare_full"], true);
  EXPECT_EQ(full["dropped"], 0);
  EXPECT_EQ(full["wrong"], 0);
  EXPECT_GE(double(full["p50_us"]), 300'000.0);
  EXPECT_LT(double(q["p50_ratio_vs_full"]), 1.0);

  const auto& plain = rs[2];
  EXPECT_EQ(plain["op"], "allreduce");
  EXPECT_EQ(plain["compare_allreduce"], true);
  EXPECT_EQ(plain["wrong"], 0);
  EXPECT_GE(double(plain["p50_us"]), 300'000.0);  // the plain all-reduce waits for rank 1
  EXPECT_DOUBLE_EQ(double(q["allreduce_p50_us"]), double(plain["p50_us"]));
}

TEST_F(BenchCli, BadQuorumArgumentsFailWithAClearMessage) {
  CmdResult r = sh(bench(2, "tcp", "--op quorum -b 4K -e 4K -n 1 --quorum 3"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("quorum 3 out of range"), std::string::npos) << r.output;
  r = sh(bench(2, "tcp", "--op quorum -b 4K -e 4K -n 1 --straggler slow:1"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("slow:1"), std::string::npos) << r.output;
  r = sh(bench(2, "tcp", "--op quorum -b 4K -e 4K -n 1 --redop max"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--redop must be sum or avg"), std::string::npos) << r.output;
}

}  // namespace
