// qring-train as users run it: real processes under qring-launch, over shm and tcp.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>

#include "cli_harness.h"
#include "net/base/build_info.h"
#include "train/config.h"

namespace {

using qring::testing::sh;

namespace fs = std::filesystem;

const std::string kBuild = QRING_BUILD_DIR;
const std::string kSource = QRING_SOURCE_DIR;

std::string train_cmd(int ranks, const std::string& out, const std::string& name,
                      const std::string& extra) {
  return kBuild + "/net/qring-launch -n " + std::to_string(ranks) + " -- " + kBuild +
         "/train/qring-train --config " + kSource + "/configs/smoke.toml run.out_dir=" + out +
         " run.name=" + name + " log.progress=false " + extra;
}

std::set<std::string> checksums(const std::string& output) {
  std::set<std::string> s;
  std::regex re("params_checksum ([0-9a-f]{16})");
  for (std::sregex_iterator it(output.begin(), output.end(), re), end; it != end; ++it)
    s.insert((*it)[1]);
  return s;
}

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("qring-cli-" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// Same seed, quorum = world, no stragglers: bit-identical parameters on every rank, across
// repeated runs and across the shm and tcp providers.
TEST_F(TrainCli, SameSeedGivesIdenticalParametersAcrossRunsAndProviders) {
  const std::string steps = "train.steps=40 quorum.quorum=1.0";
  auto a = sh(train_cmd(3, dir_, "shm1", steps + " net.provider=shm"));
  auto b = sh(train_cmd(3, dir_, "shm2", steps + " net.provider=shm"));
  auto c = sh(train_cmd(3, dir_, "tcp1", steps + " net.provider=tcp"));
  ASSERT_EQ(a.status, 0) << a.output;
  ASSERT_EQ(b.status, 0) << b.output;
  ASSERT_EQ(c.status, 0) << c.output;
  auto ca = checksums(a.output), cb = checksums(b.output), cc = checksums(c.output);
  ASSERT_EQ(ca.size(), 1u) << "ranks disagree: " << a.output;
  EXPECT_EQ(ca, cb);
  EXPECT_EQ(ca, cc);
  EXPECT_NE(c.output.find("tcp;ofi_rxm"), std::string::npos) << c.output;
  auto summary = nlohmann::json::parse(std::ifstream(dir_ / "shm1" / "summary.json"));
  EXPECT_EQ(summary["steps"], 40);
  EXPECT_EQ(summary["provider"], "shm");
}

// A run SIGKILLed part-way resumes from its last checkpoint and ends where a straight run
// ends, bit for bit.
TEST_F(TrainCli, KilledRunResumesToTheSameParameters) {
  const std::string opts =
      "train.steps=120 quorum.quorum=1.0 train.checkpoint_every=10 net.provider=shm";
  auto straight = sh(train_cmd(2, dir_, "straight", opts));
  ASSERT_EQ(straight.status, 0) << straight.output;
  // Slow the victim down (a straggler delay) so that the kill lands mid-run.
  const std::string victim = train_cmd(2, dir_, "victim", opts + " straggler.model=fixed:1:15");
  const std::string first_ckpt = (dir_ / "victim" / "checkpoints" / "rank-1").string();
  // Kill everything (launcher and ranks) as soon as rank 1 has written a checkpoint.
  auto killed = sh(victim + " & pid=$!; for i in $(seq 600); do ls " + first_ckpt +
                   "/*.qck >/dev/null 2>&1 && break; sleep 0.05; done; kill -9 $pid; "
                   "pkill -9 -f \"run.name=victim\"; wait $pid; exit 0");
  ASSERT_TRUE(fs::exists(dir_ / "victim" / "checkpoints" / "rank-0")) << killed.output;
  size_t ckpts = 0;
  for (auto& e : fs::directory_iterator(dir_ / "victim" / "checkpoints" / "rank-0"))
    ckpts += e.path().extension() == ".qck";
  ASSERT_GT(ckpts, 0u) << "no checkpoint before the kill: " << killed.output;
  auto resumed = sh(train_cmd(2, dir_, "victim", opts) + " --resume");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from step"), std::string::npos) << resumed.output;
  EXPECT_EQ(checksums(resumed.output), checksums(straight.output)) << resumed.output;
}

// train.budget = "gradients" with backups: the run goes on until the updates have counted
// as many gradients as full sync's steps x world, in more steps of fewer gradients, and the
// ranks agree on where it ends.
TEST_F(TrainCli, GradientBudgetRunsUntilFullSyncsGradientsAreCounted) {
  auto r = sh(train_cmd(4, dir_, "budget",
                        "train.steps=30 quorum.quorum=2 train.budget=gradients "
                        "straggler.model=fixed:3:20 net.provider=shm"));
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_EQ(checksums(r.output).size(), 1u) << "ranks disagree: " << r.output;
  auto summary = nlohmann::json::parse(std::ifstream(dir_ / "budget" / "summary.json"));
  const int64_t steps = summary["steps"];
  EXPECT_GT(steps, 30) << r.output;
  int64_t counted = 0, last = 0, lines = 0;
  std::ifstream metrics(dir_ / "budget" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] != "step" || j.value("skipped", false)) continue;
    last = j["contributors"];
    counted += last;
    ++lines;
  }
  EXPECT_EQ(lines, steps);
  // The budget, 30 x 4 = 120 gradients, is reached by the last step and not before it.
  EXPECT_GE(counted, 120);
  EXPECT_LT(counted - last, 120);
  EXPECT_EQ(summary["budget"], "gradients");
  EXPECT_EQ(summary["counted_gradients"], counted);
}

// Issue 17: ranks whose kernels would round differently (here rank 1's OpenBLAS forced to its
// SSE3 kernels) stop at start, naming rank 1 and the key 'kernels'.
TEST_F(TrainCli, RanksWithOtherKernelsStopAtStart) {
  // sh() runs the command in single quotes: the per-rank script is in double quotes, its
  // $QRING_RANK escaped for the outer shell.
  auto r = sh(kBuild + "/net/qring-launch -n 2 -- sh -c \"[ \\$QRING_RANK = 1 ] && export "
              "OPENBLAS_CORETYPE=Prescott; exec " + kBuild + "/train/qring-train --config " +
              kSource + "/configs/smoke.toml run.out_dir=" + dir_.string() +
              " run.name=kernels log.progress=false train.steps=5\"");
  EXPECT_NE(r.status, 0) << r.output;
  // Both ranks find the difference; the launcher stops the other as soon as the first exits,
  // so only the first one's message is sure to be there (a CI run under load once had rank
  // 1's alone), and it names rank 1 and the key either way.
  EXPECT_NE(r.output.find("rank 1 ('kernels') has other values than rank 0"), std::string::npos)
      << r.output;
  // The first rank to stop says what it computes with (the launcher stops the other).
  EXPECT_NE(r.output.find("computes with vector "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(", blas OpenBLAS "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("params_checksum"), std::string::npos) << r.output;  // no training
}

// SIGTERM to the launcher (as Slurm sends it before a time limit): it forwards it, every rank
// finishes the same step, checkpoints it and exits 76; the launcher exits 76 too. --resume
// then ends where a run that was never stopped ends, bit for bit.
TEST_F(TrainCli, SigtermStopsEveryRankAfterOneStepAndResumeEndsWhereAStraightRunEnds) {
  const std::string opts = "train.steps=300 quorum.quorum=1.0 net.provider=shm";
  auto straight = sh(train_cmd(3, dir_, "straight", opts));
  ASSERT_EQ(straight.status, 0) << straight.output;
  // A straggler delay makes the run long enough to be stopped part-way (the delays do not
  // change the parameters at quorum = world).
  const std::string metrics = (dir_ / "stopped" / "metrics.jsonl").string();
  auto stopped = sh(train_cmd(3, dir_, "stopped", opts + " straggler.model=fixed:1:30") +
                    " & pid=$!; for i in $(seq 600); do [ $(grep -c step " + metrics +
                    " 2>/dev/null || echo 0) -ge 20 ] && break; sleep 0.05; done; kill -TERM $pid;"
                    " wait $pid; echo launcher-exit=$?");
  EXPECT_NE(stopped.output.find("launcher-exit=76"), std::string::npos) << stopped.output;
  std::regex re("rank (\\d) stopped after step (\\d+) params_checksum");
  std::set<std::string> ranks, steps;
  for (std::sregex_iterator it(stopped.output.begin(), stopped.output.end(), re), end; it != end;
       ++it) {
    ranks.insert((*it)[1]);
    steps.insert((*it)[2]);
  }
  ASSERT_EQ(ranks.size(), 3u) << stopped.output;
  ASSERT_EQ(steps.size(), 1u) << "ranks stopped after different steps: " << stopped.output;
  const std::string step = *steps.begin();
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(fs::exists(dir_ / "stopped" / "checkpoints" / ("rank-" + std::to_string(r)) /
                           fmt::format("ckpt-{:012}.qck", std::stoll(step))))
        << "rank " << r << " has no checkpoint of step " << step;
  auto summary = nlohmann::json::parse(std::ifstream(dir_ / "stopped" / "summary.json"));
  EXPECT_EQ(summary["preempted"], true);
  EXPECT_EQ(summary["stop_signal"], "SIGTERM");
  EXPECT_EQ(summary["finished"], false);
  auto resumed = sh(train_cmd(3, dir_, "stopped", opts) + " --resume");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from step " + step), std::string::npos)
      << resumed.output;
  EXPECT_EQ(checksums(resumed.output), checksums(straight.output)) << resumed.output;
}

// A fresh run into a run directory that holds an earlier run's checkpoints refuses (exit 2),
// naming --resume and --force, and deletes nothing; --force starts over.
TEST_F(TrainCli, FreshRunRefusesToDeleteAnEarlierRunsCheckpoints) {
  const std::string opts = "train.steps=20 net.provider=shm";
  auto first = sh(train_cmd(2, dir_, "again", opts));
  ASSERT_EQ(first.status, 0) << first.output;
  const fs::path ckpt = dir_ / "again" / "checkpoints" / "rank-0" / "ckpt-000000000020.qck";
  ASSERT_TRUE(fs::exists(ckpt));
  auto again = sh(train_cmd(2, dir_, "again", opts));
  EXPECT_EQ(again.status, 2) << again.output;
  EXPECT_NE(again.output.find("checkpoints of an earlier run"), std::string::npos)
      << again.output;
  EXPECT_NE(again.output.find("--resume"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("--force"), std::string::npos) << again.output;
  EXPECT_TRUE(fs::exists(ckpt));
  auto forced = sh(train_cmd(2, dir_, "again", opts) + " --force");
  EXPECT_EQ(forced.status, 0) << forced.output;
  EXPECT_EQ(checksums(forced.output), checksums(first.output)) << forced.output;
}

// --print-config: the resolved configuration (defaults, file, overrides) as TOML that parses
// back to the same configuration; nothing runs.
TEST_F(TrainCli, PrintConfigPrintsTheResolvedConfigurationAsToml) {
  auto r = sh(kBuild + "/train/qring-train --config " + kSource +
              "/configs/smoke.toml train.lr=0.25 quorum.quorum=3 --print-config run.out_dir=" +
              dir_.string() + "/none 2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  auto cfg = qring::train::TrainConfig::from_string(r.output);
  EXPECT_EQ(cfg.train.lr, 0.25);
  EXPECT_EQ(cfg.quorum_count(4), 3);
  EXPECT_EQ(cfg.run.name, "smoke");
  EXPECT_EQ(cfg.to_toml(), r.output);
  EXPECT_FALSE(fs::exists(dir_ / "none"));
}

// The backup workers' saving (train/full_sync.h) is measured, not modelled: waiting for every
// rank saves nothing (within 2 % of the wall time); with rank 3 delayed 60 ms every step and
// dropped, waiting for it would have cost about those 60 ms per step. The estimate is the step
// loop's time plus the saving, the wall time has the final evaluation and checkpoint too: 600
// steps keep those well under the 20 % allowed (with 150, 0.16 s of 0.65 s under ctest -j2).
TEST_F(TrainCli, BackupSavingIsZeroAtFullSyncAndTheDroppedDelayWithBackups) {
  auto full = sh(train_cmd(4, dir_, "full", "train.steps=600 quorum.quorum=1.0 net.provider=shm"));
  ASSERT_EQ(full.status, 0) << full.output;
  auto f = nlohmann::json::parse(std::ifstream(dir_ / "full" / "summary.json"));
  const double wall = f["wall_s"];
  EXPECT_LE(std::abs(double(f["backup_saved_s"])), 0.02 * wall) << f.dump(1);
  EXPECT_NEAR(double(f["full_sync_estimate_s"]), wall, 0.2 * wall) << f.dump(1);
  auto backup = sh(train_cmd(4, dir_, "backup",
                             "train.steps=40 quorum.quorum=3 straggler.model=fixed:3:60 "
                             "net.provider=shm"));
  ASSERT_EQ(backup.status, 0) << backup.output;
  auto b = nlohmann::json::parse(std::ifstream(dir_ / "backup" / "summary.json"));
  const double saved = b["backup_saved_s"];
  EXPECT_GE(saved, 0.6 * 40 * 0.060) << b.dump(1);
  EXPECT_LE(saved, 40 * 0.060) << b.dump(1);
  EXPECT_NEAR(double(b["full_sync_estimate_s"]), double(b["wall_s"]) + saved,
              0.2 * double(b["wall_s"]) + 0.1)
      << b.dump(1);
}

// Provenance: rank 0's first log line and summary.json say which binary ran (version, commit,
// build type, ISA), on which hosts, over which provider.
TEST_F(TrainCli, SummaryAndFirstLogLineCarryTheProvenance) {
  auto r = sh(train_cmd(2, dir_, "prov", "train.steps=5 net.provider=shm"));
  ASSERT_EQ(r.status, 0) << r.output;
  // Rank 0's first line (the launcher's own lines and other ranks' may come before it).
  const size_t at = r.output.find("[rank 0] ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string first = r.output.substr(at, r.output.find('\n', at) - at);
  EXPECT_NE(first.find("qring-train " + std::string(qring::build::version()) + " (commit " +
                       qring::build::short_commit()),
            std::string::npos)
      << r.output;
  EXPECT_NE(first.find("2 ranks on "), std::string::npos) << first;
  EXPECT_NE(first.find("provider shm"), std::string::npos) << first;
  auto s = nlohmann::json::parse(std::ifstream(dir_ / "prov" / "summary.json"));
  EXPECT_EQ(s["build"]["commit"], qring::build::commit());
  EXPECT_EQ(s["build"]["isa"], qring::build::isa());
  EXPECT_EQ(s["build"]["build_type"], qring::build::build_type());
  ASSERT_EQ(s["hosts"].size(), 2u) << s.dump(1);
  EXPECT_EQ(s["world"], 2);
  EXPECT_EQ(s["provider"], "shm");
}

TEST_F(TrainCli, BadConfigurationExitsTwoNamingTheKey) {
  auto r = sh(kBuild + "/train/qring-train --config " + kSource +
              "/configs/smoke.toml train.lr=-1 run.out_dir=" + dir_.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("train.lr"), std::string::npos) << r.output;
  auto u =
      sh(kBuild + "/train/qring-train --config " + kSource + "/configs/smoke.toml no.such_key=1");
  EXPECT_EQ(u.status, 2) << u.output;
  EXPECT_NE(u.output.find("no.such_key"), std::string::npos) << u.output;
  auto m = sh(kBuild + "/train/qring-train --config /nonexistent.toml");
  EXPECT_EQ(m.status, 2) << m.output;
  auto d = sh(kBuild + "/train/qring-train --config " + kSource +
              "/configs/smoke.toml data.dataset=fashion-mnist data.path=/nonexistent run.out_dir=" +
              dir_.string());
  EXPECT_EQ(d.status, 2) << d.output;
  EXPECT_NE(d.output.find("/nonexistent"), std::string::npos) << d.output;
}

}  // namespace
