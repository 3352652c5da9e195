// Ranks that stop or die during training (issue "ranks that stop or die"): real processes
// under qring-launch, real faults (SIGKILL, SIGSTOP/SIGCONT) injected by the victim itself at
// a named phase of a step (QRING_FAULT, collectives/fault_inject.h). The survivors must
// finish training with bit-identical parameters, lose at most one step per failure, and no
// run may hang (every run is bounded by the harness's time limit).
//
// What only processes show: a member and the coordinator, killed and stopped, over shm and
// tcp (the transport's own reaction to a dead or frozen peer, the launcher, checkpoints,
// summary.json), ranks restarted by the launcher, a rank killed holding its shm locks. Every
// phase of every case, and the losses the protocol survives or not (two losses, a fractional
// quorum, quorum = world, min_world, a short pause), run in-process on virtual time with the
// same assertions: tests/test_coll_failover.cc.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "cli_harness.h"

namespace {

using qring::testing::CmdResult;
using qring::testing::sh;
namespace fs = std::filesystem;

const std::string kBuild = QRING_BUILD_DIR;
const std::string kSource = QRING_SOURCE_DIR;
// These jobs share the host with another test (ctest -j2) and the CI's other stages: their
// ranks are unbound, as docs/bootstrap.md says for a shared host. Bound (4 ranks on 2 CPUs:
// rank r on CPU r mod 2), the ranks pinned to a CPU that other work takes wait for it together
// (ranks 0 and 2 runnable and not running for 0.6 s at once, then evicted as silent), which is
// CPU starvation, not the fault under test.
const std::string kLaunch = kBuild + "/net/qring-launch --bind none";

// Short synthetic runs: 4 ms steps or so; the evict time is short so that a run takes
// seconds. Every wait is bounded (deadline_ms), and the harness kills a run after 120 s.
std::string run_cmd(const std::string& fault, int ranks, int tolerate, const std::string& out,
                    const std::string& name, const std::string& extra) {
  return "QRING_FAULT=" + fault + " " + kLaunch + " -n " + std::to_string(ranks) +
         " --tolerate-failures " + std::to_string(tolerate) + " -- " + kBuild +
         "/train/qring-train --config " + kSource + "/configs/smoke.toml run.out_dir=" + out +
         " run.name=" + name +
         " log.progress=false quorum.evict_ms=500 quorum.deadline_ms=8000 train.steps=300 "
         "train.checkpoint_every=10 " +
         extra;
}

// Every "params_checksum X" line of the output (rank 0's summary and the other ranks').
std::multiset<std::string> checksums(const std::string& output) {
  std::multiset<std::string> s;
  std::regex re("params_checksum ([0-9a-f]{16})");
  for (std::sregex_iterator it(output.begin(), output.end(), re), end; it != end; ++it)
    s.insert((*it)[1]);
  return s;
}

// `ranks` ranks printed a parameter checksum, all the same one.
void expect_replicas_agree(const CmdResult& r, size_t ranks) {
  auto sums = checksums(r.output);
  ASSERT_EQ(sums.size(), ranks) << r.output;
  EXPECT_EQ(sums.count(*sums.begin()), ranks) << "replicas disagree: " << r.output;
}

// A shm lock fault healed: the job ended well, rank 2 came back, the four ranks agree, and
// the log says `must_say`.
void expect_healed(const CmdResult& r, const std::string& must_say) {
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(must_say), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 2 rejoined at step"), std::string::npos) << r.output;
  expect_replicas_agree(r, 4);
}

class TrainFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("qring-faults-" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  nlohmann::json summary(const std::string& name) {
    return nlohmann::json::parse(std::ifstream(dir_ / name / "summary.json"));
  }
  // QRING_FAULT=`fault` in 4 ranks of smoke.toml that restart a lost rank once (quorum 3,
  // evict 500 ms, deadline 8 s), run `name`, with the overrides `extra`. Every rank sleeps
  // 1 ms a step (straggler tail:1:1), so that the job outlasts the restart and rejoin
  // whatever the machine's speed: unpaced, on a quiet host, the others' 2500 steps took 2.1 s
  // and ended before the restarted rank (its lock released by the launcher first) could
  // rejoin.
  std::string restarting_run(const std::string& fault, const std::string& name,
                             const std::string& extra) const {
    return "QRING_FAULT=" + fault + " " + kLaunch + " -n 4 --max-restarts 1 -- " +
           kBuild + "/train/qring-train --config " + kSource +
           "/configs/smoke.toml run.out_dir=" + dir_.string() + " run.name=" + name +
           " log.progress=false quorum.evict_ms=500 quorum.deadline_ms=8000 quorum.quorum=3 "
           "straggler.model=tail:1:1 " +
           extra;
  }
  fs::path dir_;
};

struct FaultCase {
  std::string action;  // kill | stop
  int rank;
  std::string phase;
  std::string provider;
};
void PrintTo(const FaultCase& c, std::ostream* os) {
  *os << c.action << " rank " << c.rank << " at " << c.phase << " over " << c.provider;
}

std::string case_name(const ::testing::TestParamInfo<FaultCase>& i) {
  return i.param.action + "_rank" + std::to_string(i.param.rank) + "_" + i.param.phase + "_" +
         i.param.provider;
}

class FaultMatrix : public TrainFaults, public ::testing::WithParamInterface<FaultCase> {};

// W = 4, quorum 3: one rank killed (or stopped longer than the evict time) at step 40, at
// one of four phases; rank 0 is the coordinator, whose loss makes rank 1 take over. The job
// finishes on the other three with identical parameters and its outputs complete; the
// stopped rank, continued, learns it was evicted and rejoins as a new incarnation (the store
// lives in qring-launch), so that the job ends with all four again.
TEST_P(FaultMatrix, SurvivorsFinishWithIdenticalParameters) {
  const FaultCase c = GetParam();
  // A stopped rank is continued while the others still train (3000 steps: the others run
  // ~1000 during its 1.5 s pause on this machine, and it needs a few hundred more to rejoin),
  // so that it finds out it was evicted and comes back. The pause is three times the evict
  // time: a loaded machine that starves the others' quorum threads for a while (each such
  // gap restarts their silence clocks) still leaves them time to notice it.
  const std::string fault = c.action == "kill"
                                ? "kill:" + std::to_string(c.rank) + ":40:" + c.phase
                                : "stop:" + std::to_string(c.rank) + ":40:1500:" + c.phase;
  const int steps = c.action == "kill" ? 300 : 3000;
  auto r = sh(run_cmd(fault, 4, 1, dir_, "m",
                      "quorum.quorum=3 train.steps=" + std::to_string(steps) +
                          " net.provider=" + c.provider));
  const bool killed = c.action == "kill";
  // Killed: one rank lost, the others finished. Stopped: it came back.
  ASSERT_EQ(r.status, killed ? 101 : 0) << r.output;
  const std::string victim = "rank " + std::to_string(c.rank);
  if (killed) {
    EXPECT_NE(r.output.find("qring-launch: " + victim), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
  } else {
    EXPECT_NE(r.output.find(victim + ": evicted from the job"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(victim + ": rejoining the job as a new incarnation"),
              std::string::npos)
        << r.output;
  }
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, killed ? 3 : 4));
  auto s = summary("m");
  EXPECT_EQ(s["steps"], steps) << s.dump();
  EXPECT_EQ(s["finished"], true);
  EXPECT_EQ(s["failures_survived"], 1) << s.dump();
  EXPECT_EQ(s["evicted_ranks"], nlohmann::json::array({c.rank})) << s.dump();
  EXPECT_LE(s["skipped_steps"].get<int>(), 1) << s.dump();
  EXPECT_GT(s["recovery_s"].get<double>(), 0.0) << s.dump();
  EXPECT_EQ(s["rejoins"], killed ? 0 : 1) << s.dump();
  // The view changes are in the metrics: who left, and who came back.
  std::ifstream m(dir_ / "m" / "metrics.jsonl");
  std::string line;
  int views = 0;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] != "view") continue;
    ++views;
    if (views == 1) {
      EXPECT_EQ(j["left"][0]["rank"], c.rank) << line;
      EXPECT_EQ(j["members"].size(), 3u) << line;
    } else {
      EXPECT_EQ(j["joined"][0]["rank"], c.rank) << line;
      EXPECT_EQ(j["members"].size(), 4u) << line;
    }
  }
  EXPECT_EQ(views, killed ? 1 : 2);
}

// A member (rank 3) and the coordinator (rank 0), killed and stopped, over tcp and shm; each
// phase twice.
std::vector<FaultCase> matrix() {
  return {{"kill", 0, "ring", "tcp"},       {"kill", 3, "checkpoint", "tcp"},
          {"stop", 0, "step", "tcp"},       {"stop", 3, "ready", "tcp"},
          {"kill", 0, "checkpoint", "shm"}, {"kill", 3, "ready", "shm"},
          {"stop", 0, "ring", "shm"},       {"stop", 3, "step", "shm"}};
}

INSTANTIATE_TEST_SUITE_P(Faults, FaultMatrix, ::testing::ValuesIn(matrix()), case_name);

// Issue 42, case 2: the coordinator (rank 0) and rank 1 killed at one step, W = 4, quorum 2,
// under qring-launch --tolerate-failures 2, which reaps both and records their deaths in the
// store. Two of four is no majority, but the deaths are witnessed: ranks 2 and 3 go on (rank 2
// coordinates), finish with one checksum within evict + 1 s of recovery, and write the outputs;
// the launcher exits with 102 (two ranks lost, the others finished), naming both.
class CoordinatorAndOneMoreKilledTogether : public TrainFaults,
                                            public ::testing::WithParamInterface<std::string> {};
TEST_P(CoordinatorAndOneMoreKilledTogether, TheTwoLeftFinishWithOneChecksum) {
  auto r = sh(run_cmd("kill:0:40:step,kill:1:40:step", 4, 2, dir_, "c2",
                      "quorum.quorum=2 net.provider=" + GetParam()));
  ASSERT_EQ(r.status, 102) << r.output;
  for (const char* victim : {"rank 0 (pid", "rank 1 (pid"})
    EXPECT_NE(r.output.find(std::string("qring-launch: ") + victim), std::string::npos)
        << r.output;
  EXPECT_NE(r.output.find("witnessed the death of rank 0"), std::string::npos) << r.output;
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, 2));
  auto s = summary("c2");
  EXPECT_EQ(s["steps"], 300) << s.dump();
  EXPECT_EQ(s["finished"], true);
  EXPECT_LE(s["skipped_steps"].get<int>(), 1) << s.dump();
  EXPECT_LE(s["recovery_s"].get<double>(), 0.5 + 1.0) << s.dump();
}
INSTANTIATE_TEST_SUITE_P(Providers, CoordinatorAndOneMoreKilledTogether,
                         ::testing::Values("shm", "tcp"));

// Issue 42, case 8: the coordinator killed after the last step (at the final evaluation,
// before it writes the outputs). The others wait for its goodbye at the end, take over when
// it is lost and the new coordinator writes summary.json; the launcher exits on its own with
// 101 (one rank lost, the others finished).
TEST_F(TrainFaults, CoordinatorKilledAfterTheLastStepTheOthersWriteTheOutputs) {
  auto r = sh(run_cmd("kill:0:300:eval", 4, 1, dir_, "c8", "quorum.quorum=2 net.provider=shm"));
  ASSERT_EQ(r.status, 101) << r.output;
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, 3));
  ASSERT_TRUE(fs::exists(dir_ / "c8" / "summary.json")) << r.output;
  auto s = summary("c8");
  EXPECT_EQ(s["steps"], 300) << s.dump();
  EXPECT_EQ(s["finished"], true);
  // The final evaluation is in it, whether the new coordinator took over while it waited for
  // the end or already during that evaluation (its slice went to the dead coordinator).
  EXPECT_GT(s["test_accuracy"].get<double>(), 0.2) << s.dump();
}

// A rank stopped for 1 s near the end: once continued it learns it was evicted and rejoins,
// and the job may end before it is admitted (the others run ~700 steps during the pause, of
// 900). Either way it exits 0 and never crashes: when the job was over first, its end was
// rethrown from an empty exception_ptr (SIGSEGV), the case this test caught.
TEST_F(TrainFaults, RankThatComesBackAtTheEndExitsCleanly) {
  auto r = sh(run_cmd("stop:2:40:1000:step", 4, 1, dir_, "late",
                      "quorum.quorum=3 train.steps=900 net.provider=shm"));
  EXPECT_EQ(r.output.find("terminated with signal"), std::string::npos) << r.output;
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 2: evicted from the job"), std::string::npos) << r.output;
  const bool over = r.output.find("rank 2: the job finished before this incarnation could "
                                  "rejoin it") != std::string::npos;
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, over ? 3 : 4));
}

// Rejoin (qring-launch --max-restarts): a rank killed mid-training, rank 0 (the coordinator)
// too, is started again, rejoins with a live member's state, and the job ends with all four
// ranks bit-identical; the metrics show the departure, the return and the healing.
struct RejoinCase {
  int rank;
  std::string provider;
};
void PrintTo(const RejoinCase& c, std::ostream* os) {
  *os << "kill rank " << c.rank << " over " << c.provider;
}
class RejoinMatrix : public TrainFaults, public ::testing::WithParamInterface<RejoinCase> {};

TEST_P(RejoinMatrix, KilledRankComesBackAndTheReplicasAgree) {
  const RejoinCase c = GetParam();
  const std::string cmd = restarting_run("kill:" + std::to_string(c.rank) + ":40:step", "rj",
                                         "train.steps=2500 net.provider=" + c.provider);
  auto r = sh(cmd);
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string victim = "rank " + std::to_string(c.rank);
  EXPECT_NE(r.output.find("qring-launch: " + victim + " (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restarting it (restart 1 of 1)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(victim + " rejoined at step"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(victim + ": first contribution counted again at step"),
            std::string::npos)
      << r.output;
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, 4));
  auto s = summary("rj");
  EXPECT_EQ(s["finished"], true);
  EXPECT_EQ(s["steps"], 2500);
  EXPECT_EQ(s["rejoins"], 1) << s.dump();
  EXPECT_GT(s["heal_s"].get<double>(), 0.0) << s.dump();
  std::ifstream m(dir_ / "rj" / "metrics.jsonl");
  std::string line;
  std::vector<nlohmann::json> timeline;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == "view" || j["type"] == "rejoin") timeline.push_back(j);
  }
  ASSERT_EQ(timeline.size(), 3u) << s.dump();
  EXPECT_EQ(timeline[0]["left"][0]["rank"], c.rank);
  EXPECT_EQ(timeline[1]["joined"][0]["rank"], c.rank);
  EXPECT_EQ(timeline[1]["joined"][0]["incarnation"], 1);
  EXPECT_EQ(timeline[1]["members"].size(), 4u);
  EXPECT_EQ(timeline[2]["type"], "rejoin");
  EXPECT_GE(timeline[2]["counted_step"], timeline[1]["step"]);
}

INSTANTIATE_TEST_SUITE_P(Rejoin, RejoinMatrix,
                         ::testing::Values(RejoinCase{2, "shm"}, RejoinCase{0, "tcp"}),
                         [](const ::testing::TestParamInfo<RejoinCase>& i) {
                           return "kill_rank" + std::to_string(i.param.rank) + "_" +
                                  i.param.provider;
                         });

// A rank killed inside libfabric's shm receive path holds its region lock, and every rank
// that sends to it would spin inside fi_tsend for good (the coordinator first: the others
// took over from it, then from each other, and the job failed after its deadline).
// kill-locked kills rank 2 holding the locks of all its regions; the launcher, reaping it,
// releases them, and the job heals as after any kill.
class KillLocked : public TrainFaults, public ::testing::WithParamInterface<std::string> {};

TEST_P(KillLocked, LauncherReleasesTheLockOfARankThatDiedHoldingIt) {
  const std::string cmd =
      restarting_run("kill-locked:2:40:" + GetParam(), "kl", "train.steps=2500 net.provider=shm");
  auto r = sh(cmd);
  expect_healed(r, "died holding the lock of its shared-memory region");
  EXPECT_EQ(r.output.find("; taking over"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Faults, KillLocked, ::testing::Values("step", "ring"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return "at_" + i.param;
                         });

// A rank killed while it posted a send to a live peer holds that peer's own region lock: the
// peer's engine thread waits for its own lock inside the provider, and every rank that sends
// to it too (issue 42, case 5 over shm: the rejoined rank and the new coordinator fell silent
// together). kill-posting kills rank 2 holding one live peer's lock; the launcher, reaping
// it, finds the lock held by no live process and releases it, and the job heals: the stuck
// rank, evicted for its silence meanwhile or not, ends with the others' parameters.
TEST_F(TrainFaults, LauncherReleasesALivePeersLockARankKilledWhilePostingHeld) {
  const std::string cmd =
      restarting_run("kill-posting:2:40:ring", "kp", "train.steps=2500 net.provider=shm");
  expect_healed(sh(cmd), "stayed locked after rank 2");
}

// A rank stopped while it holds its own region lock (inside the shm provider's receive path):
// a sender would spin inside fi_tsend for the whole pause, the coordinator first (it falls
// silent and is taken over; issue 42, case 7 over shm lost a job so). The senders look at
// the lock before they post (PeerRegionLock): rank 2, stopped 1.5 s (3 evict periods) at
// phase ring, is evicted alone, nobody takes over from rank 0, and rank 2 rejoins (the pacing
// of restarting_run keeps the job running past the pause).
// The look cannot close one window (net/transport/shm_region.h): a sender that looked just
// before rank 2 took its lock spins inside its post for the whole pause. If that sender is
// the coordinator, nobody evicts and the job waits 1.5 s for rank 2, which then finishes with
// the others (one checksum, nothing lost). Rank 2 takes its lock while ranks post to it, so a
// loaded host loses that race now and then (one CI run so far; none of 45 runs looped beside
// busy loops or another shm fault test); the test then runs the job a second time, and fails
// if that run is held back too, as every run is without the look.
TEST_F(TrainFaults, ARankStoppedHoldingItsShmLockHoldsNoSenderBack) {
  auto run = [&](const std::string& name) {
    return sh(restarting_run("stop-locked:2:40:1500:ring", name,
                             "train.steps=2500 net.provider=shm"));
  };
  auto r = run("sl");
  if (r.status == 0 && r.output.find("evicted from the job") == std::string::npos) {
    ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, 4));
    if (HasFailure()) return;
    std::cerr << "a sender lost the race with rank 2's lock (the job waited for it, nothing "
                 "lost): running the job again\n";
    r = run("sl2");
  }
  expect_healed(r, "evicted from the job");
  EXPECT_EQ(r.output.find("; taking over"), std::string::npos) << r.output;
}

// The same death where no qring-launch reaps the rank: it runs under a shell that waits for
// it (as a rank does under srun, or one started by hand), so the launcher reaps the shell and
// knows nothing of the rank's regions, and nobody restarts it. The survivors, spinning inside
// the shm provider to send to it, are freed by their endpoints' watch (net/transport/shm_region.h),
// evict the rank and finish. Before the watch this run hung until the harness's limit. (The
// survivors' log says which of them released the lock, unless the endpoint of a rank in a test
// running beside this one got there first: the watch looks at every dead process's region.)
TEST_F(TrainFaults, SurvivorsFinishWhenARankNobodyReapsDiesHoldingItsShmLock) {
  const fs::path wrap = dir_ / "unreaped.sh";
  std::ofstream(wrap) << "#!/bin/sh\n\"$@\" &\necho $! > " << (dir_ / "pid.").string()
                      << "$QRING_RANK\nwait $!\n";
  fs::permissions(wrap, fs::perms::owner_all);
  const std::string cmd = "QRING_FAULT=kill-locked:2:40:ring " + kLaunch +
                          " -n 4 --tolerate-failures 1 -- " + wrap.string() + " " +
                          kBuild + "/train/qring-train --config " + kSource +
                          "/configs/smoke.toml run.out_dir=" + dir_.string() +
                          " run.name=unreaped log.progress=false quorum.evict_ms=500 "
                          "quorum.deadline_ms=8000 quorum.quorum=3 train.steps=300 "
                          "net.provider=shm";
  auto r = sh(cmd);
  // The dead rank's region files: nobody removes them (a rank never removes another
  // process's regions), so the test does.
  std::string victim;
  std::ifstream(dir_ / "pid.2") >> victim;
  if (!victim.empty())
    for (const auto& e : fs::directory_iterator("/dev/shm"))
      if (e.path().filename().string().rfind(victim + ":", 0) == 0) fs::remove(e.path());
  ASSERT_EQ(r.status, 101) << r.output;  // one rank lost, the others finished
  EXPECT_NE(r.output.find("rank(s) 2 left"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("died holding the lock"), std::string::npos) << r.output;
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, 3));
}

// --resume after a run that lost a rank (issue 42, case 9): rank 2, killed at step 40, has only
// early checkpoints (the newest three are kept: 10, 20, 30); the three survivors have 280,
// 290 and 300, written in a view without rank 2. The resumed job starts at step 300, not at
// step 0, and rank 2 takes the state of step 300 from a live member: the four finish the
// longer run with one checksum.
TEST_F(TrainFaults, ResumeAfterALostRankStartsFromTheSurvivorsNewestCheckpoint) {
  auto first = sh(run_cmd("kill:2:40:step", 4, 1, dir_.string(), "lost", "quorum.quorum=3"));
  ASSERT_EQ(first.status, 101) << first.output;
  const fs::path ckpt = dir_ / "lost" / "checkpoints";
  EXPECT_FALSE(fs::exists(ckpt / "rank-2" / "ckpt-000000000300.qck"));
  ASSERT_TRUE(fs::exists(ckpt / "rank-0" / "ckpt-000000000300.qck"));
  auto again = sh(kLaunch + " -n 4 -- " + kBuild +
                  "/train/qring-train --resume --config " + kSource +
                  "/configs/smoke.toml run.out_dir=" + dir_.string() +
                  " run.name=lost log.progress=false quorum.evict_ms=500 quorum.deadline_ms=8000 "
                  "quorum.quorum=3 train.steps=400 train.checkpoint_every=10");
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("resumed from step 300"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("rank 2 has no checkpoint of step 300 (it was lost before it); "
                              "it takes the state from rank 0"),
            std::string::npos)
      << again.output;
  EXPECT_EQ(again.output.find("starting fresh"), std::string::npos) << again.output;
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(again, 4));
  EXPECT_EQ(summary("lost")["steps"], 400) << summary("lost").dump();
}

// train.budget = "gradients": the joiner takes the count of gradients with the state, so it
// ends at the same step as the members (all four replicas agree), after more steps than the
// 2000 of full sync (quorum 3 of 4, and the lost rank's steps counted 3).
TEST_F(TrainFaults, RejoinedRankEndsAGradientBudgetWhereTheOthersDo) {
  const std::string cmd = restarting_run(
      "kill:2:40:step", "rjb", "train.steps=2000 train.budget=gradients net.provider=shm");
  auto r = sh(cmd);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 2 rejoined at step"), std::string::npos) << r.output;
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, 4));
  auto s = summary("rjb");
  EXPECT_EQ(s["finished"], true);
  EXPECT_EQ(s["rejoins"], 1) << s.dump();
  EXPECT_GT(s["steps"].get<int64_t>(), 2000) << s.dump();
}

// A rank that comes back with other settings (here its kernels: OpenBLAS forced to another
// core type) is not taken back: it stops with an error naming the setting, and the others,
// which never admitted it, finish without it.
TEST_F(TrainFaults, RankThatComesBackWithOtherKernelsIsRefused) {
  const fs::path wrap = dir_ / "other-kernels-on-restart.sh";
  std::ofstream(wrap) << "#!/bin/sh\n"
                         "[ \"$QRING_RESTART\" = 1 ] && export OPENBLAS_CORETYPE=Prescott\n"
                         "exec \"$@\"\n";
  fs::permissions(wrap, fs::perms::owner_all);
  const std::string cmd =
      "QRING_FAULT=kill:2:40:step " + kLaunch + " -n 4 --max-restarts 1 "
      "--tolerate-failures 1 -- " + wrap.string() + " " +
      kBuild + "/train/qring-train --config " + kSource + "/configs/smoke.toml run.out_dir=" +
      dir_.string() +
      " run.name=refused log.progress=false quorum.evict_ms=500 quorum.deadline_ms=8000 "
      "quorum.quorum=3 train.steps=2500 net.provider=tcp";
  auto r = sh(cmd);
  ASSERT_EQ(r.status, 101) << r.output;  // rank 2 lost after its one restart
  EXPECT_NE(r.output.find("restarting it (restart 1 of 1)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 2: cannot rejoin the job: settings differ: kernels is '"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 2 (incarnation 1) cannot rejoin"), std::string::npos)
      << r.output;  // what the members say
  ASSERT_NO_FATAL_FAILURE(expect_replicas_agree(r, 3));
  EXPECT_EQ(summary("refused")["rejoins"], 0);
}

TEST_F(TrainFaults, MalformedFaultSpecIsAConfigError) {
  auto r = sh("QRING_FAULT=explode:1:2 " + kBuild + "/train/qring-train --config " + kSource +
              "/configs/smoke.toml run.out_dir=" + dir_.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("explode:1:2"), std::string::npos) << r.output;
}

}  // namespace
