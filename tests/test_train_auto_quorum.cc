// quorum.quorum = "auto" in qring-train and qring-sim: the configuration, Q(t) in the metrics
// and its histogram in the summary, the learning rate scaled by each step's contributors.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "coll_harness.h"
#include "net/base/error.h"
#include "train/config.h"
#include "train/sim.h"
#include "train/trainer.h"

namespace qring::testing {
namespace {

namespace fs = std::filesystem;
using train::TrainConfig;

TrainConfig smoke(const std::string& name, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"run.out_dir=" + ::testing::TempDir() + "qring-auto-tests",
                                 "run.name=" + name, "log.progress=false"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return TrainConfig::from_file(std::string(QRING_SOURCE_DIR) + "/configs/smoke.toml", ov);
}

TEST(AutoQuorumConfig, AutoAndItsBoundsParseAndAreChecked) {
  auto c = smoke("cfg", {"quorum.quorum=auto", "quorum.min=2", "quorum.max=3"});
  EXPECT_TRUE(c.quorum.quorum_auto);
  EXPECT_EQ(c.quorum_count(4), 2);  // the lower bound
  auto back = TrainConfig::from_string(c.to_toml());
  EXPECT_TRUE(back.quorum.quorum_auto);
  EXPECT_EQ(back.quorum.max, 3);
  EXPECT_THROW(smoke("cfg", {"quorum.quorum=auto", "quorum.min=3", "quorum.max=2"}), ConfigError);
  EXPECT_THROW(smoke("cfg", {"quorum.quorum=automatic"}), ConfigError);
  EXPECT_THROW(smoke("cfg", {"quorum.quorum=auto", "quorum.min=5"}).validate(4), ConfigError);
  // A count again clears "auto".
  EXPECT_FALSE(smoke("cfg", {"quorum.quorum=auto", "quorum.quorum=3"}).quorum.quorum_auto);
  // The rule's noise scale: samples >= 0 (0, the default, is the linear value), or
  // "estimate" (the run's own); both survive the round trip through TOML.
  EXPECT_FALSE(smoke("cfg").quorum.noise_scale_estimated());
  EXPECT_EQ(smoke("cfg").quorum.noise_scale, 0);
  auto ns = smoke("cfg", {"quorum.quorum=auto", "quorum.noise_scale=400"});
  EXPECT_FALSE(ns.quorum.noise_scale_estimated());
  EXPECT_EQ(TrainConfig::from_string(ns.to_toml()).quorum.noise_scale, 400);
  EXPECT_FALSE(TrainConfig::from_string(ns.to_toml()).quorum.noise_scale_estimated());
  auto est = smoke("cfg", {"quorum.quorum=auto", "quorum.noise_scale=400",
                           "quorum.noise_scale=\"estimate\""});
  EXPECT_TRUE(est.quorum.noise_scale_estimated());
  EXPECT_TRUE(TrainConfig::from_string(est.to_toml()).quorum.noise_scale_estimated());
  EXPECT_FALSE(smoke("cfg", {"quorum.noise_scale=0"}).quorum.noise_scale_estimated());
  EXPECT_TRUE(smoke("cfg", {"quorum.noise_scale=estimate"}).quorum.noise_scale_estimated());
  EXPECT_THROW(smoke("cfg", {"quorum.noise_scale=-1"}).validate(4), ConfigError);
  EXPECT_THROW(smoke("cfg", {"quorum.noise_scale=nan"}).validate(4), ConfigError);
  EXPECT_THROW(smoke("cfg", {"quorum.noise_scale=\"big\""}), ConfigError);
}

// Rank 2 sleeps 200 ms before every gradient: "auto" (bounds 3..4) leaves it out after the
// first steps. (The delay dwarfs what a loaded machine adds to the others' arrivals, and the
// lower bound 3 keeps a descheduled fast rank from making 2 the better choice.)
// Every step line carries the quorum, the summary its histogram, and the learning rate of a
// step is the schedule's (built for 4) times contributors / 4.
TEST(AutoQuorumTrain, StepsCarryTheirQuorumAndTheSlowRankIsLeftOut) {
  const int W = 4;
  auto cfg = smoke("auto4", {"quorum.quorum=auto", "quorum.min=3", "train.steps=40",
                             "straggler.model=fixed:2:200",
                             "train.schedule=constant", "train.warmup_steps=0"});
  CommOptions co;
  co.timeout = std::chrono::seconds(30);
  std::vector<train::RunSummary> out(W);
  train::TrainerOptions opts;
  opts.force = true;  // the suite's directory is shared across test runs: start over
  run_ranks(W, co,
            [&](Communicator& comm) { out[size_t(comm.rank())] = train::train(cfg, comm, opts); });
  const fs::path dir = fs::path(cfg.run.out_dir) / cfg.run.name;
  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  std::map<int, int64_t> hist;
  int steps = 0, late_three = 0;
  const double peak = 0.1 * W * 32 / 128;  // smoke.toml: lr 0.1, batch 32, reference 128
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] != "step") continue;
    const int q = j["quorum"], n = j["contributors"];
    EXPECT_GE(n, q);
    EXPECT_NEAR(j["lr"].get<double>(), peak * n / W, 1e-12);
    ++hist[q];
    if (steps >= 20 && q == 3) ++late_three;
    ++steps;
  }
  EXPECT_EQ(steps, 40);
  EXPECT_GE(late_three, 17);
  std::ifstream sf(dir / "summary.json");
  auto s = nlohmann::json::parse(sf);
  EXPECT_EQ(s["quorum"], "auto");
  int64_t total = 0;
  for (auto& [q, n] : s["quorum_histogram"].items()) {
    EXPECT_EQ(n.get<int64_t>(), hist[std::stoi(q)]) << q;
    total += n.get<int64_t>();
  }
  EXPECT_EQ(total, 40);
  for (int r = 1; r < W; ++r) EXPECT_EQ(out[size_t(r)].params_checksum, out[0].params_checksum);
}

// 8-16 simulated workers of a small model, 60 steps, quorum "auto", under `straggler`.
TrainConfig sim_config(const std::string& straggler) {
  return TrainConfig::from_string(R"(
[data]
dataset = "synthetic"
synthetic_train = 2048
synthetic_test = 256
[model]
hidden = [16]
[train]
batch_per_rank = 16
steps = 60
eval_every = 30
[quorum]
quorum = "auto"
)",
                                  {"straggler.model=" + straggler});
}

// qring-sim's auto mode calls the same rule on its virtual clock: with one worker 100 ms
// behind, N settles at W - 1; the histogram counts every step.
TEST(AutoQuorumSim, TheSimulatorUsesTheSameRule) {
  omp_set_num_threads(1);
  auto cfg = sim_config("fixed:5:100");
  train::SimOptions o;
  o.workers = 8;
  o.adaptive = true;
  o.auto_kappa = 0;  // the linear value
  o.compute_ms = 2;
  o.apply_ms = 0.1;
  auto r = train::simulate(cfg, train::load_datasets(cfg.data, 42), o);
  int64_t total = 0;
  for (auto& [q, n] : r.quorum_hist) total += n;
  EXPECT_EQ(total, 60);
  EXPECT_EQ(r.steps.front().contributors, 5);  // nothing observed yet: the middle of [1, 8]
  int seven = 0;
  for (size_t t = 30; t < r.steps.size(); ++t) {
    seven += r.steps[t].contributors == 7;
    if (r.steps[t].contributors == 7) {
      EXPECT_EQ(std::count(r.steps[t].ranks.begin(), r.steps[t].ranks.end(), 5), 0);
    }
  }
  EXPECT_GE(seven, 28);
  train::SimOptions bad = o;
  bad.backups = 1;
  EXPECT_THROW(train::simulate(cfg, train::load_datasets(cfg.data, 42), bad), ConfigError);
}

// Without quorum.noise_scale the simulator values each step with the run's own estimate of
// the gradient-noise scale (as the coordinator does from the norms READY carries): every step
// of N >= 2 records it, the first step (no estimate yet) is chosen as under the linear value,
// and where the estimate is a few contributions the quorums are smaller than the linear
// value's. A huge fixed noise scale is the linear value.
TEST(AutoQuorumSim, WithoutANoiseScaleTheRunsEstimateValuesItsSteps) {
  omp_set_num_threads(1);
  auto cfg = sim_config("shiftexp:1:2");
  const auto data = train::load_datasets(cfg.data, 42);
  train::SimOptions o;
  o.workers = 16;
  o.adaptive = true;
  o.compute_ms = 2;
  o.apply_ms = 0.1;
  auto est = train::simulate(cfg, data, o);
  o.auto_kappa = 0;
  auto linear = train::simulate(cfg, data, o);
  o.auto_kappa = 1e12;
  auto huge = train::simulate(cfg, data, o);
  ASSERT_EQ(est.steps.size(), 60u);
  ASSERT_EQ(linear.steps.size(), 60u);
  EXPECT_EQ(est.steps[0].quorum, linear.steps[0].quorum);
  double q_est = 0, q_lin = 0;
  for (size_t t = 0; t < 60; ++t) {
    EXPECT_TRUE(est.steps[t].noise_scale) << "step " << t;
    EXPECT_EQ(huge.steps[t].quorum, linear.steps[t].quorum) << "step " << t;
    if (t >= 10) {
      q_est += est.steps[t].quorum;
      q_lin += linear.steps[t].quorum;
    }
  }
  ASSERT_TRUE(est.noise_scale_mean);
  const double kappa = *est.noise_scale_mean / 16;  // in contributions
  EXPECT_LT(kappa, 8) << "this model's noise scale is a few contributions";
  EXPECT_LT(q_est, 0.8 * q_lin) << "estimated " << q_est / 50 << ", linear " << q_lin / 50;
}

}  // namespace
}  // namespace qring::testing
