// The training loop with ranks as threads over the in-process endpoint.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>

#include "coll_harness.h"
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

std::vector<RunSummary> run_training(int world, const TrainConfig& cfg,
                                     train::TrainerOptions opts = {}) {
  std::vector<RunSummary> out(static_cast<size_t>(world));
  CommOptions co;
  co.timeout = std::chrono::seconds(30);
  run_ranks(world, co,
            [&](Communicator& comm) { out[size_t(comm.rank())] = train::train(cfg, comm, opts); });
  return out;
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

TEST(TrainLoop, SameSeedSameParametersAcrossRuns) {
  auto a = run_training(2, smoke("det-a", {"train.steps=15"}));
  auto b = run_training(2, smoke("det-b", {"train.steps=15"}));
  EXPECT_EQ(a[0].params_checksum, b[0].params_checksum);
}

}  // namespace
}  // namespace qring::testing
