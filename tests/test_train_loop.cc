// The training loop with ranks as threads over the in-process endpoint.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "coll_harness.h"
#include "collectives/quorum/quorum.h"
#include "net/base/error.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/trainer.h"

namespace qring::testing {
namespace {

namespace fs = std::filesystem;
using train::RunSummary;
using train::TrainConfig;

TrainConfig smoke(const std::string& name, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"run.out_dir=" + ::testing::TempDir() + "qring-train-tests",
                                 "run.name=" + name, "log.progress=false"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return TrainConfig::from_file(std::string(QRING_SOURCE_DIR) + "/configs/smoke.toml", ov);
}

// The suite's runs share one directory across test runs: a fresh run there starts over
// (--force) instead of refusing the checkpoints an earlier test run left.
train::TrainerOptions fresh_or_resume(train::TrainerOptions opts) {
  if (!opts.resume) opts.force = true;
  return opts;
}

std::vector<RunSummary> run_training(int world, const TrainConfig& cfg,
                                     train::TrainerOptions opts = {}) {
  opts = fresh_or_resume(opts);
  std::vector<RunSummary> out(static_cast<size_t>(world));
  CommOptions co;
  co.timeout = std::chrono::seconds(30);
  run_ranks(world, co,
            [&](Communicator& comm) { out[size_t(comm.rank())] = train::train(cfg, comm, opts); });
  return out;
}

// Rank r trains with cfgs[r]; returns each rank's error message ("" when it finished). The
// collectives' deadline is short: a rank left waiting fails the test in seconds, not 30 s.
std::vector<std::string> run_each(const std::vector<TrainConfig>& cfgs,
                                  train::TrainerOptions opts = {},
                                  std::vector<RunSummary>* sums = nullptr) {
  opts = fresh_or_resume(opts);
  const int world = int(cfgs.size());
  std::vector<std::string> err(cfgs.size());
  if (sums) sums->assign(cfgs.size(), RunSummary{});
  CommOptions co;
  co.timeout = std::chrono::seconds(8);
  run_ranks(world, co, [&](Communicator& comm) {
    const size_t r = size_t(comm.rank());
    try {
      RunSummary s = train::train(cfgs[r], comm, opts);
      if (sums) (*sums)[r] = s;
    } catch (const std::exception& e) {
      err[r] = std::string(dynamic_cast<const ConfigError*>(&e) ? "ConfigError: "
                           : dynamic_cast<const DataError*>(&e) ? "DataError: "
                                                                : "other: ") +
               e.what();
    }
  });
  return err;
}

TEST(TrainLoop, SmokeRunWithThreeRanksLearns) {
  auto cfg = smoke("smoke3");
  auto s = run_training(3, cfg);
  EXPECT_GT(s[0].test_accuracy, 0.9);
  EXPECT_LT(s[0].test_loss, 0.5);
  EXPECT_EQ(s[0].steps, 2 * (2048 / 3 / 32));
  auto dir = fs::path(cfg.run.out_dir) / cfg.run.name;
  EXPECT_TRUE(fs::exists(dir / "summary.json"));
  EXPECT_TRUE(fs::exists(dir / "config.toml"));
  std::ifstream m(dir / "metrics.jsonl");
  int steps = 0, evals = 0;
  std::string line;
  double first_loss = -1, last_loss = -1;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") {
      ++steps;
      if (first_loss < 0) first_loss = j["loss"];
      last_loss = j["loss"];
      EXPECT_EQ(j["contributors"], 3);
    } else {
      ++evals;
    }
  }
  EXPECT_EQ(steps, s[0].steps);
  EXPECT_EQ(evals, 2);
  EXPECT_LT(last_loss, 0.5 * first_loss);
}

TEST(TrainLoop, ReplicasStayIdenticalUnderStragglersAndBackupWorkers) {
  auto cfg = smoke("stragglers", {"quorum.quorum=2", "straggler.model=exp:2",
                                  "train.checksum_every=5", "train.epochs=1"});
  auto s = run_training(3, cfg);
  for (int r = 1; r < 3; ++r) EXPECT_EQ(s[size_t(r)].params_checksum, s[0].params_checksum);
  EXPECT_GE(s[0].mean_contributors, 2.0);
  EXPECT_GT(s[0].test_accuracy, 0.5);
}

TEST(TrainLoop, ResumeIsBitIdenticalToAStraightRun) {
  auto straight = run_training(2, smoke("straight", {"train.steps=40"}));
  auto cfg = smoke("resumed", {"train.steps=40", "train.checkpoint_every=20"});
  train::TrainerOptions first;
  first.stop_after = 20;  // as if killed right after the step-20 checkpoint
  run_training(2, cfg, first);
  train::TrainerOptions again;
  again.resume = true;
  auto resumed = run_training(2, cfg, again);
  EXPECT_EQ(resumed[0].steps, 40);
  EXPECT_EQ(resumed[0].params_checksum, straight[0].params_checksum);
  EXPECT_EQ(resumed[1].params_checksum, straight[1].params_checksum);
}

// A stop request (SIGTERM/SIGUSR1 in qring-train) on one rank only: the
// flag travels with that rank's gradient, and every rank stops after the first step that
// counted it -- the same step everywhere -- with a checkpoint there; resuming ends where a
// straight run ends.
TEST(TrainLoop, AStopOnOneRankStopsEveryRankAfterTheSameStep) {
  auto straight = run_training(3, smoke("stop-straight", {"train.steps=200"}));
  auto cfg = smoke("stopped", {"train.steps=200"});
  const fs::path dir = fs::path(cfg.run.out_dir) / cfg.run.name;
  fs::remove_all(dir);
  // Rank 1 is asked to stop once 10 steps are in the metrics.
  std::atomic<int> stop_rank1{0};
  std::atomic<bool> done{false};
  std::thread asker([&] {
    while (!done && !stop_rank1) {
      std::ifstream m(dir / "metrics.jsonl");
      int steps = 0;
      for (std::string l; std::getline(m, l);) steps += l.find("\"type\":\"step\"") != l.npos;
      if (steps >= 10) stop_rank1 = SIGTERM;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  std::vector<RunSummary> sums(3);
  CommOptions co;
  co.timeout = std::chrono::seconds(30);
  run_ranks(3, co, [&](Communicator& comm) {
    train::TrainerOptions o;
    if (comm.rank() == 1) o.stop = &stop_rank1;
    sums[size_t(comm.rank())] = train::train(cfg, comm, o);
  });
  done = true;
  asker.join();
  const int64_t step = sums[0].steps;
  EXPECT_GE(step, 10);
  EXPECT_LT(step, 200);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(sums[size_t(r)].preempted) << "rank " << r;
    EXPECT_EQ(sums[size_t(r)].stop_signal, r == 1 ? SIGTERM : 0) << "rank " << r;
    EXPECT_EQ(sums[size_t(r)].steps, step) << "rank " << r;
    EXPECT_EQ(sums[size_t(r)].params_checksum, sums[0].params_checksum) << "rank " << r;
    EXPECT_TRUE(fs::exists(dir / "checkpoints" / ("rank-" + std::to_string(r)) /
                           fmt::format("ckpt-{:012}.qck", step)))
        << "rank " << r;
  }
  train::TrainerOptions again;
  again.resume = true;
  auto resumed = run_training(3, cfg, again);
  EXPECT_FALSE(resumed[0].preempted);
  EXPECT_EQ(resumed[0].steps, 200);
  EXPECT_EQ(resumed[0].params_checksum, straight[0].params_checksum);
}

// The same with a CNN, whose convolutions run in the direct kernels on AVX-512 builds
// (train/conv_direct.h), with "same" padding (a padded copy of the input) and "valid".
TEST(TrainLoop, ResumeIsBitIdenticalToAStraightRunForACnn) {
  for (const char* padding : {"same", "valid"}) {
    const std::vector<std::string> model = {"model.type=cnn", "model.conv_channels=[4, 20]",
                                            "model.hidden=[16]", "train.steps=30",
                                            std::string("model.conv_padding=") + padding};
    auto with = [&](std::string name, std::vector<std::string> extra) {
      auto kv = model;
      kv.insert(kv.end(), extra.begin(), extra.end());
      return smoke(name + "-" + padding, kv);
    };
    auto straight = run_training(2, with("cnn-straight", {}));
    auto cfg = with("cnn-resumed", {"train.checkpoint_every=15"});
    train::TrainerOptions first;
    first.stop_after = 15;
    run_training(2, cfg, first);
    train::TrainerOptions again;
    again.resume = true;
    auto resumed = run_training(2, cfg, again);
    EXPECT_EQ(resumed[0].steps, 30) << padding;
    EXPECT_EQ(resumed[0].params_checksum, straight[0].params_checksum) << padding;
    EXPECT_EQ(resumed[1].params_checksum, straight[0].params_checksum) << padding;
  }
}

TEST(TrainLoop, SameSeedSameParametersAcrossRuns) {
  auto a = run_training(2, smoke("det-a", {"train.steps=15"}));
  auto b = run_training(2, smoke("det-b", {"train.steps=15"}));
  EXPECT_EQ(a[0].params_checksum, b[0].params_checksum);
}

// Issue 15, item 9: an override given to one rank only stops every rank at start, naming
// the rank and the key (the old trainer ran on with two learning rates).
TEST(TrainLoop, ARankWithAnotherConfigStopsEveryRank) {
  const auto base = smoke("mismatch", {"train.steps=5"});
  const auto odd = smoke("mismatch", {"train.steps=5", "train.lr=0.2"});
  const auto err = run_each({base, odd, base});
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(err[size_t(r)], ::testing::StartsWith("ConfigError: ")) << "rank " << r;
    EXPECT_THAT(err[size_t(r)], ::testing::HasSubstr("rank 1 ('train.lr') has other values"))
        << "rank " << r;
  }
  // Where files are and how a rank logs may differ between nodes.
  const auto local = smoke("mismatch", {"train.steps=5", "log.level=warn"});
  EXPECT_EQ(run_each({base, local}), (std::vector<std::string>{"", ""}));
}

// Issue 15, item 12: a torn or corrupt newest checkpoint on some rank makes every rank fall
// back to the newest step that all of them can load, and the result is that of a straight
// run. (The old trainer took the minimum of the newest file names: the rank with the broken
// file stopped with a DataError and the others waited for it.)
TEST(TrainLoop, ResumeFallsBackToTheNewestCheckpointEveryRankCanLoad) {
  auto straight = run_training(2, smoke("fallback-straight", {"train.steps=40"}));
  const auto cfg = smoke("fallback", {"train.steps=40", "train.checkpoint_every=10"});
  train::TrainerOptions first;
  first.stop_after = 30;  // checkpoints at 10, 20 and 30 on both ranks
  run_training(2, cfg, first);
  const fs::path ckpts = fs::path(cfg.run.out_dir) / cfg.run.name / "checkpoints";
  auto path = [&](int rank, uint64_t step) {
    return train::checkpoint_path((ckpts / ("rank-" + std::to_string(rank))).string(), step);
  };
  // Rank 0's step 30 is torn; rank 1's step 20 has a flipped byte (its CRC fails).
  fs::resize_file(path(0, 30), fs::file_size(path(0, 30)) / 2);
  {
    std::fstream f(path(1, 20), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  train::TrainerOptions again;
  again.resume = true;
  std::vector<RunSummary> resumed;
  EXPECT_EQ(run_each({cfg, cfg}, again, &resumed), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(resumed[0].steps, 40);
  EXPECT_EQ(resumed[0].params_checksum, straight[0].params_checksum);
  EXPECT_EQ(resumed[1].params_checksum, straight[1].params_checksum);
  // Resumed from step 10: metrics.jsonl holds every step once.
  std::ifstream m(fs::path(cfg.run.out_dir) / cfg.run.name / "metrics.jsonl");
  std::set<int64_t> steps;
  int lines = 0;
  for (std::string line; std::getline(m, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") {
      steps.insert(j["step"].get<int64_t>());
      ++lines;
    }
  }
  EXPECT_EQ(lines, 40);
  EXPECT_EQ(steps.size(), 40u);
}

// A checkpoint that loads but belongs to another rank stops every rank with a DataError
// naming the rank that has it, instead of leaving the others waiting.
TEST(TrainLoop, ResumeWithAnotherRanksCheckpointStopsEveryRank) {
  const auto cfg = smoke("foreign", {"train.steps=20", "train.checkpoint_every=10"});
  train::TrainerOptions first;
  first.stop_after = 10;
  run_training(2, cfg, first);
  const fs::path ckpts = fs::path(cfg.run.out_dir) / cfg.run.name / "checkpoints";
  fs::copy_file(train::checkpoint_path((ckpts / "rank-0").string(), 10),
                train::checkpoint_path((ckpts / "rank-1").string(), 10),
                fs::copy_options::overwrite_existing);
  train::TrainerOptions again;
  again.resume = true;
  const auto err = run_each({cfg, cfg}, again);
  EXPECT_THAT(err[0], ::testing::HasSubstr("DataError: --resume: rank 1 has a checkpoint of "
                                           "another job or configuration"));
  EXPECT_THAT(err[1], ::testing::HasSubstr("written by rank 0 of 2; this is rank 1 of 2"));
  EXPECT_THAT(err[1], ::testing::StartsWith("DataError: --resume: rank 1: "));
}

// Issue 15, item 14: the coordinator's arrival log keeps its newest 16384 steps, not one
// entry per step of the whole run (the old log held all of them).
TEST(TrainLoop, ArrivalLogIsBounded) {
  constexpr uint64_t kSteps = 16384 + 600;
  collectives::QuorumOptions qo;
  qo.quorum = 2;
  qo.deadline = std::chrono::milliseconds(5000);
  run_ranks(2, {}, [&](Communicator& comm) {
    collectives::QuorumAllreduce q(comm, 1, qo);
    float g = 1;
    for (uint64_t t = 0; t < kSteps; ++t) {
      q.contribute(t, &g, 1);
      q.wait(t, &g);
    }
    if (comm.rank() != 0) return;
    const auto log = q.reports().arrival_log();
    EXPECT_EQ(log.size(), 16384u);
    ASSERT_FALSE(log.empty());
    EXPECT_EQ(log.begin()->first, kSteps - 16384);
    EXPECT_EQ(log.rbegin()->first, kSteps - 1);
  });
}

// ...and the trainer streams it into arrivals.jsonl: every step once, in order, also when
// the run is longer than the log and resumed part-way.
TEST(TrainLoop, ArrivalsFileHasEveryStepOnce) {
  const int64_t steps = 16384 + 8192 + 1500;
  auto cfg = smoke("arrivals", {"train.steps=" + std::to_string(steps), "model.hidden=[2]",
                                "train.batch_per_rank=1", "data.synthetic_train=64",
                                "data.synthetic_test=8", "train.eval_every=100000",
                                "train.checkpoint_every=9000", "train.checksum_every=0"});
  train::TrainerOptions first;
  first.stop_after = 9000;
  run_training(2, cfg, first);
  train::TrainerOptions again;
  again.resume = true;
  run_training(2, cfg, again);
  std::ifstream in(fs::path(cfg.run.out_dir) / cfg.run.name / "arrivals.jsonl");
  int64_t expect = 0;
  for (std::string line; std::getline(in, line); ++expect) {
    auto j = nlohmann::json::parse(line);
    ASSERT_EQ(j["step"].get<int64_t>(), expect);
    ASSERT_EQ(j["ready_ms"].size(), 2u);
  }
  EXPECT_EQ(expect, steps);
}

}  // namespace
}  // namespace qring::testing
