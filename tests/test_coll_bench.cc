// qring-bench as scripts run it: real processes under qring-launch, JSON rows checked for the
// keys scripts depend on and for the values the run must produce.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>

#include "cli_harness.h"
#include "net/base/build_info.h"

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
  std::string bench(int ranks, const std::string& provider, const std::string& args,
                    int tolerate = 0) {
    return kBuild + "/net/qring-launch -n " + std::to_string(ranks) + " --provider " + provider +
           (tolerate ? " --tolerate-failures " + std::to_string(tolerate) : std::string()) +
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

// nccl-tests' habits: a provenance line and a line per rank (pid, host) before the table, the
// algorithm as the last column, the footer with the #wrong total and the mean bus bandwidth,
// the time averaged over ranks unless -a says otherwise; JSON rows with the algorithm, the
// build and the hosts. Under qring-launch --prefix others rank 0's lines come unprefixed.
TEST_F(BenchCli, TableFollowsNcclTestsConventions) {
  auto j = (dir_ / "n.json").string();
  CmdResult r = sh(kBuild + "/net/qring-launch -n 2 --provider shm --prefix others -- " + kBuild +
                   "/collectives/qring-bench --op allreduce -b 1K -e 4M -f 64 -n 2 -w 1 --json " +
                   j + " 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("[rank 0]"), std::string::npos) << r.output;
  const std::string provenance =
      "# qring-bench " + std::string(qring::build::version()) + " (commit ";
  EXPECT_TRUE(r.output.rfind(provenance, 0) == 0 ||
              r.output.find("\n" + provenance) != std::string::npos)
      << r.output;
  for (int rank : {0, 1})
    EXPECT_NE(r.output.find("#  Rank  " + std::to_string(rank) + " Pid "), std::string::npos)
        << r.output;
  EXPECT_NE(r.output.find("time the mean over ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("#wrong  algo"), std::string::npos) << r.output;
  // 1 KiB: recursive doubling; 64 KiB: halving-doubling (2 ranks); 4 MiB: the ring.
  for (const auto& [size, algo] : {std::pair<std::string, std::string>{"1024", "rd"},
                                   {"65536", "hd"},
                                   {"4194304", "ring"}})
    EXPECT_TRUE(std::regex_search(r.output, std::regex("\n +" + size + " [^\n]* " + algo + "\n")))
        << size << " should run " << algo << ": " << r.output;
  EXPECT_NE(r.output.find("# Out of bounds values : 0 OK\n# Avg bus bandwidth    : "),
            std::string::npos)
      << r.output;
  auto rs = rows("n.json");
  ASSERT_EQ(rs.size(), 6u) << rs.dump();
  double bw = 0;
  for (const auto& row : rs) {
    EXPECT_TRUE(row["algorithm"] == "rd" || row["algorithm"] == "hd" || row["algorithm"] == "ring")
        << row.dump();
    EXPECT_EQ(row["time_across_ranks"], "mean");
    EXPECT_EQ(row["build"]["commit"], qring::build::commit());
    EXPECT_EQ(row["hosts"].size(), 2u);
    bw += double(row["busbw_gbps"]);
  }
  const size_t avg = r.output.find("# Avg bus bandwidth    : ");
  EXPECT_NEAR(std::stod(r.output.substr(avg + 25)), bw / 6, 1e-3 * bw) << r.output;
  // -a 3: the slowest rank's time, as before nccl-tests' default.
  CmdResult m = sh(bench(2, "shm", "-b 1K -e 1K -n 2 -w 1 -a 3"));
  ASSERT_EQ(m.status, 0) << m.output;
  EXPECT_NE(m.output.find("time the maximum over ranks"), std::string::npos) << m.output;
}

// A --json path that cannot be written fails at once (exit 2, before any row), not after the
// sweep; --help lists the exit statuses.
TEST_F(BenchCli, UnwritableOutputFailsBeforeTheSweep) {
  CmdResult r = sh(bench(2, "shm", "-b 1K -e 1K -n 2 --json /nonexistent/dir/x.json"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--json: cannot write '/nonexistent/dir/x.json'"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("algbw"), std::string::npos) << r.output;
  CmdResult d = sh(kBuild + "/collectives/qring-decide-bench --members 4 --json /nonexistent/x");
  EXPECT_EQ(d.status, 2) << d.output;
  EXPECT_EQ(d.output.find("decision_us"), std::string::npos) << d.output;
  CmdResult h = sh(kBuild + "/collectives/qring-bench --help");
  EXPECT_EQ(h.status, 0);
  EXPECT_NE(h.output.find("Exit status: 0 every result correct; 1 wrong results; 2 bad"),
            std::string::npos)
      << h.output;
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
  // Every timed step's latency, in order: the slowest is max_us.
  ASSERT_EQ(q["step_us"].size(), 3u) << q.dump();
  double slowest = 0;
  for (const auto& us : q["step_us"]) slowest = std::max(slowest, double(us));
  EXPECT_DOUBLE_EQ(slowest, double(q["max_us"]));

  const auto& full = rs[1];
  EXPECT_EQ(full["quorum"], 3);
  EXPECT_EQ(full["compare_full"], true);
  EXPECT_EQ(full["dropped"], 0);
  EXPECT_EQ(full["wrong"], 0);
  EXPECT_GE(double(full["p50_us"]), 300'000.0);
  ASSERT_EQ(full["step_us"].size(), 3u) << full.dump();
  EXPECT_GE(double(full["step_us"][0]), 300'000.0);
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

// --wait block: the ranks wait on their shm doorbells (qring.init(wait="block")), the header
// says so, and the checked steps' results are exact; any other value is refused by name.
TEST_F(BenchCli, WaitBlockRunsOnTheDoorbellsAndOtherValuesAreRefused) {
  auto j = (dir_ / "w.json").string();
  CmdResult r = sh(bench(3, "shm",
                         "--op quorum -b 64K -e 64K -n 3 -w 1 --quorum 2 --grace-ms 1 --wait "
                         "block --json " + j));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("wait block"), std::string::npos) << r.output;
  auto rs = rows("w.json");
  ASSERT_EQ(rs.size(), 1u) << rs.dump();
  EXPECT_EQ(rs[0]["wrong"], 0);
  r = sh(bench(2, "tcp", "--op quorum -b 4K -e 4K -n 1 --wait spin"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--wait 'spin': expected poll or block"), std::string::npos) << r.output;
}

// --fault: 4 ranks, quorum 3, a rank lost at timed step 20 of 60 (64 KiB steps take well
// under a millisecond, so the loop goes on past -n until the rank has left the view and 40
// steps ran after the recovery). Bounds are generous: only the order of magnitude of the
// recovery is asserted (the evict time is 500 ms).
constexpr const char* kFaultRun =
    "--op quorum --quorum 3 -b 64K -e 64K -n 60 -w 5 --evict-ms 500 --json ";

void expect_fault_row(const nlohmann::json& rs, int lost, const std::string& spec) {
  ASSERT_EQ(rs.size(), 1u) << rs.dump();
  const auto& q = rs[0];
  for (const char* k : {"fault", "evict_ms", "recovery_s", "detection_ms", "p50_before_us",
                        "p99_before_us", "p50_after_us", "p99_after_us", "between_max_us",
                        "steps_before", "steps_between", "steps_after", "lost_ranks",
                        "skipped_steps", "members", "coordinator", "views"})
    EXPECT_TRUE(q.contains(k)) << k << " missing in " << q.dump();
  EXPECT_EQ(q["op"], "quorum");
  EXPECT_EQ(q["fault"], spec);
  EXPECT_EQ(q["evict_ms"], 500);
  EXPECT_EQ(q["lost_ranks"], nlohmann::json::array({lost})) << q.dump();
  nlohmann::json members = nlohmann::json::array();
  for (int r = 0; r < 4; ++r)
    if (r != lost) members.push_back(r);
  EXPECT_EQ(q["members"], members) << q.dump();
  EXPECT_EQ(q["coordinator"], lost == 0 ? 1 : 0) << q.dump();
  EXPECT_EQ(q["wrong"], 0);
  ASSERT_TRUE(q["recovery_s"].is_number()) << q.dump();
  EXPECT_GT(double(q["recovery_s"]), 0.0) << q.dump();
  EXPECT_LT(double(q["recovery_s"]), 0.5 + 2.0) << q.dump();
  // Timed steps 0..19 come before the fault; the last of them may have been held up by it
  // (the victim still took part), which makes them steps in between.
  EXPECT_LE(q["steps_before"].get<int>(), 20) << q.dump();
  EXPECT_GE(q["steps_before"].get<int>(), 10) << q.dump();
  EXPECT_GE(q["steps_after"].get<int>(), 40) << q.dump();
  EXPECT_GE(q["steps_between"].get<int>(), 1) << q.dump();  // the step that saw the recovery
  EXPECT_GE(q["iters"].get<int>(), 60) << q.dump();
  EXPECT_EQ(q["iters"].get<int>(), q["steps_before"].get<int>() +
                                       q["steps_between"].get<int>() +
                                       q["steps_after"].get<int>())
      << q.dump();
  ASSERT_TRUE(q["p50_before_us"].is_number() && q["p50_after_us"].is_number()) << q.dump();
  EXPECT_GT(double(q["p50_before_us"]), 0.0);
  EXPECT_GT(double(q["p50_after_us"]), 0.0);
  EXPECT_GE(double(q["p99_after_us"]), double(q["p50_after_us"]));
  EXPECT_LE(q["skipped_steps"].get<int>(), 1) << q.dump();
  ASSERT_EQ(q["views"].size(), 1u) << q.dump();
  EXPECT_EQ(q["views"][0]["left"][0]["rank"], lost) << q.dump();
}

// A rank killed (SIGKILL) mid-loop: the survivors go on, the coordinator reports the recovery,
// and qring-launch --tolerate-failures 1 exits 101 (one rank lost).
TEST_F(BenchCli, QuorumFaultKillReportsTheRecovery) {
  auto j = (dir_ / "k.json").string();
  CmdResult r = sh(bench(4, "tcp", kFaultRun + j + " --fault kill:2:20", 1));
  ASSERT_EQ(r.status, 101) << r.output;
  EXPECT_NE(r.output.find("rank 2 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("# fault kill:2:20:step (evict 500 ms): lost rank(s) 2"),
            std::string::npos)
      << r.output;
  expect_fault_row(rows("k.json"), 2, "kill:2:20:step");
}

// The coordinator (rank 0) killed: rank 1 takes over, prints and writes the JSON.
TEST_F(BenchCli, QuorumFaultKillOfTheCoordinatorIsReportedByTheNewOne) {
  auto j = (dir_ / "k0.json").string();
  CmdResult r = sh(bench(4, "shm", kFaultRun + j + " --fault kill:0:20", 1));
  ASSERT_EQ(r.status, 101) << r.output;
  EXPECT_NE(r.output.find("[rank 1] # fault kill:0:20:step"), std::string::npos) << r.output;
  expect_fault_row(rows("k0.json"), 0, "kill:0:20:step");
}

// A rank stopped (SIGSTOP) for 3 s, longer than the evict time: the others evict it and go
// on until it runs again; it learns it was evicted and exits 75.
TEST_F(BenchCli, QuorumFaultStoppedRankIsEvictedAndExits75) {
  auto j = (dir_ / "s.json").string();
  CmdResult r = sh(bench(4, "tcp", kFaultRun + j + " --fault stop:1:20:3000", 1));
  ASSERT_EQ(r.status, 101) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was evicted (exit status 75)"), std::string::npos) << r.output;
  expect_fault_row(rows("s.json"), 1, "stop:1:20:3000:step");
  auto q = rows("s.json")[0];
  // Silent for the evict time, give or take the heartbeat; recovered before it ran again.
  EXPECT_GE(double(q["detection_ms"]), 400.0) << q.dump();
  EXPECT_LT(double(q["recovery_s"]), 3.0) << q.dump();
}

TEST_F(BenchCli, BadFaultArgumentsFailWithAClearMessage) {
  CmdResult r = sh(bench(2, "tcp", "--op allreduce -b 4K -e 4K -n 1 --fault kill:1:0"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--fault is only valid with --op quorum"), std::string::npos)
      << r.output;
  r = sh(bench(2, "tcp", "--op quorum -b 4K -e 4K -n 4 --fault kill:1:2"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("leaves no room to lose a rank"), std::string::npos) << r.output;
  r = sh(bench(2, "tcp", "--op quorum --quorum 1 -b 4K -e 4K -n 4 --fault kill:1:4"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("not among the -n 4 timed steps"), std::string::npos) << r.output;
  r = sh(bench(2, "tcp", "--op quorum --quorum 1 -b 4K -e 4K -n 4 --fault kill:2:1"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("rank 2 out of range for 2 ranks"), std::string::npos) << r.output;
  r = sh(bench(2, "tcp", "--op quorum --quorum 1 -b 4K -e 4K -n 4 --fault kill:1:1:eval"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("phase 'eval' does not occur"), std::string::npos) << r.output;
  r = sh(bench(2, "tcp", "--op quorum --quorum 1 -b 4K -e 4K -n 4 --fault kill:1"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("expected kill:RANK:STEP"), std::string::npos) << r.output;
  r = sh(bench(2, "tcp",
               "--op quorum --quorum 1 -b 4K -e 4K -n 4 --fault kill:1:1 --compare-allreduce"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("cannot be combined"), std::string::npos) << r.output;
}

// qring-decide-bench (docs/benchmarks.md): one row per number of members, with the time of a
// decision and the quorum it chose; a bad member count is a usage error.
TEST_F(BenchCli, DecideBenchTimesTheAdaptiveQuorumsDecisionPerMemberCount) {
  auto j = (dir_ / "d.json").string();
  CmdResult r = sh(kBuild + "/collectives/qring-decide-bench --members 4,200 --min-time-ms 1 " +
                   "--batches 1 --json " + j);
  ASSERT_EQ(r.status, 0) << r.output;
  auto rs = rows("d.json");
  ASSERT_EQ(rs.size(), 2u) << rs.dump();
  const int members[] = {4, 200};
  for (size_t i = 0; i < 2; ++i) {
    const auto& row = rs[i];
    EXPECT_EQ(row["members"], members[i]) << row.dump();
    EXPECT_GT(row["decision_us"].get<double>(), 0) << row.dump();
    EXPECT_GE(row["decisions"].get<int64_t>(), 1) << row.dump();
    EXPECT_GE(row["quorum"].get<int>(), 1) << row.dump();
    EXPECT_LE(row["quorum"].get<int>(), members[i]) << row.dump();
  }
  CmdResult bad = sh(kBuild + "/collectives/qring-decide-bench --members 4,0");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("qring-decide-bench: --members expects an integer"), std::string::npos)
      << bad.output;
}

// Issue 44: per-rank settings that change the result -- a --quorum or --deadline-ms given to
// one node only -- stop every rank at the start (exit 2), naming the setting, both values and
// the rank (a different deadline went unnoticed; a different quorum failed at step 3).
TEST_F(BenchCli, RanksWithDifferentQuorumOrDeadlineStopAtTheStart) {
  const std::string script = (dir_ / "per_rank.sh").string();
  std::ofstream(script) << "#!/bin/sh\n"
                        << "if [ \"$QRING_RANK\" = 1 ]; then Q=3; D=1000; else Q=2; D=30000; fi\n"
                        << "exec " << kBuild << "/collectives/qring-bench --op quorum -b 4K -e 4K "
                        << "-n 3 -w 1 --quorum $Q --deadline-ms $D\n";
  fs::permissions(script, fs::perms::owner_all);
  CmdResult r = sh(kBuild + "/net/qring-launch -n 3 --provider shm -- " + script);
  EXPECT_EQ(r.status, 2) << r.output;
  // (The launcher stops the other ranks at the first failure; which one that is varies.)
  EXPECT_NE(r.output.find("the ranks' settings differ: --quorum is '3' on "
                          "rank 1 and '2' on rank 0; --deadline-ms is '1000' on rank 1 and "
                          "'30000' on rank 0"),
            std::string::npos)
      << r.output;
}

}  // namespace
