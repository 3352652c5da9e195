// train.mode = "async": asynchronous SGD with a parameter server on rank 0 (train/async_sgd.h),
// ranks as threads over the in-process endpoint, and as real processes under qring-launch.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "cli_harness.h"
#include "coll_harness.h"
#include "net/base/error.h"
#include "train/config.h"
#include "train/trainer.h"

namespace qring::testing {
namespace {

namespace fs = std::filesystem;
using train::RunSummary;
using train::TrainConfig;

TrainConfig smoke(const std::string& name, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"run.out_dir=" + ::testing::TempDir() + "qring-async-tests",
                                 "run.name=" + name, "log.progress=false", "train.mode=async"};
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

std::vector<nlohmann::json> lines(const fs::path& p) {
  std::vector<nlohmann::json> v;
  std::ifstream in(p);
  std::string l;
  while (std::getline(in, l)) v.push_back(nlohmann::json::parse(l));
  return v;
}

// Every worker's K gradients are applied exactly once, each worker's in push order; the model
// learns; staleness is recorded per update and summarized. Rank 1 sleeps 100 ms before each of
// its gradients while the others do not: its gradients reach a server that applied many of
// theirs meanwhile, so the stalest update is rank 1's. (A fast worker that the scheduler holds
// back on a loaded machine sees some staleness too: 17 next to rank 1's 27 once with a 60 ms
// sleep, so the test asks for the stalest, with a sleep long enough to keep a margin.)
TEST(TrainAsync, EveryGradientAppliedOnceAndTheSlowWorkerIsTheStalest) {
  const int W = 3, K = 30;
  auto cfg = smoke("async3", {"train.steps=30", "train.eval_every=15", "straggler.model=fixed:1:100",
                              "train.lr=0.3", "train.warmup_steps=10"});
  auto s = run_training(W, cfg);
  EXPECT_EQ(s[0].steps, K * W);
  EXPECT_GT(s[0].test_accuracy, 0.5);
  auto dir = fs::path(cfg.run.out_dir) / cfg.run.name;
  auto m = lines(dir / "metrics.jsonl");
  std::map<int, int64_t> next, stale_max;
  int64_t updates = 0, evals = 0, stale_total = 0;
  for (auto& j : m) {
    if (j["type"] == "eval") {
      ++evals;
      continue;
    }
    ASSERT_EQ(j["type"], "step");
    EXPECT_EQ(j["step"], updates);
    const int w = j["worker"];
    EXPECT_EQ(j["push"], next[w]++) << "worker " << w;
    const int64_t st = j["staleness"];
    EXPECT_GE(st, 0);
    EXPECT_LE(st, updates);
    stale_max[w] = std::max(stale_max[w], st);
    stale_total += st;
    EXPECT_TRUE(std::isfinite(j["loss"].get<double>()));
    ++updates;
  }
  EXPECT_EQ(updates, K * W);
  for (int w = 0; w < W; ++w) EXPECT_EQ(next[w], K) << w;
  // Evaluations every 15 x W updates and at the end.
  EXPECT_EQ(evals, 2);
  EXPECT_GE(stale_max[1], 10);
  EXPECT_GT(stale_max[1], std::max(stale_max[0], stale_max[2]))
      << "fast workers' worst: " << stale_max[0] << ", " << stale_max[2];
  std::ifstream sf(dir / "summary.json");
  auto j = nlohmann::json::parse(sf);
  EXPECT_EQ(j["mode"], "async");
  EXPECT_EQ(j["updates"], K * W);
  EXPECT_EQ(j["gradients_per_worker"], K);
  EXPECT_EQ(j["staleness_max"].get<int64_t>(), stale_max[1]);
  EXPECT_NEAR(j["staleness_mean"].get<double>(), double(stale_total) / double(K * W), 1e-9);
  int64_t n = 0;
  for (auto c : j["staleness_hist"]) n += c.get<int64_t>();
  EXPECT_EQ(n, K * W);
  EXPECT_GE(j["iteration_p90_ms"].get<double>(), j["iteration_p50_ms"].get<double>());
  EXPECT_TRUE(fs::exists(dir / "config.toml"));
}

TEST(TrainAsync, CheckpointsResumeAndFaultsAreRefused) {
  auto refused = [](const TrainConfig& cfg, train::TrainerOptions opts, const std::string& what) {
    try {
      run_training(2, cfg, opts);
      ADD_FAILURE() << "no error for " << what;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused(smoke("ck", {"train.checkpoint_every=5"}), {}, "train.checkpoint_every");
  train::TrainerOptions resume;
  resume.resume = true;
  refused(smoke("rs"), resume, "--resume");
  EXPECT_THROW(TrainConfig::from_file(std::string(QRING_SOURCE_DIR) + "/configs/smoke.toml",
                                      {"train.mode=hogwild"}),
               ConfigError);
}

// Real processes: qring-train in async mode under qring-launch, over shm and tcp.
TEST(TrainAsync, RealProcessesOverShmAndTcp) {
  const fs::path out = fs::temp_directory_path() / ("qring-async-cli-" + std::to_string(getpid()));
  for (const char* provider : {"shm", "tcp"}) {
    const std::string name = std::string("async-") + provider;
    auto r = sh(std::string(QRING_BUILD_DIR) + "/net/qring-launch -n 3 -- " + QRING_BUILD_DIR +
                    "/train/qring-train --config " + QRING_SOURCE_DIR +
                    "/configs/smoke.toml run.out_dir=" + out.string() + " run.name=" + name +
                    " log.progress=false train.mode=async train.steps=30 net.provider=" +
                    provider,
                90);
    ASSERT_EQ(r.status, 0) << r.output;
    std::ifstream sf(out / name / "summary.json");
    auto j = nlohmann::json::parse(sf);
    EXPECT_EQ(j["mode"], "async");
    EXPECT_EQ(j["updates"], 90);
    EXPECT_GT(j["test_accuracy"].get<double>(), 0.5) << provider;
    EXPECT_NE(r.output.find("test_accuracy"), std::string::npos);
  }
  fs::remove_all(out);
}

}  // namespace
}  // namespace qring::testing
