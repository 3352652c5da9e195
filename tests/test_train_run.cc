#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "net/base/error.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/trainer_core.h"

namespace qring::train {
namespace {

namespace fs = std::filesystem;

TrainConfig smoke(const std::vector<std::string>& overrides = {}) {
  return TrainConfig::from_file(std::string(QRING_SOURCE_DIR) + "/configs/smoke.toml", overrides);
}

std::vector<float> params_of(TrainerCore& c) {
  return {c.params(), c.params() + c.num_params()};
}

bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(TrainRun, SmokeConfigLearnsSyntheticData) {
  TrainConfig cfg = smoke();
  DatasetPair data = load_datasets(cfg.data, cfg.run.seed);
  TrainerCore core(cfg, data, 0, 1, 1);
  EXPECT_EQ(core.steps_per_epoch(), 64);
  EXPECT_EQ(core.total_steps(), 128);
  const double initial = core.evaluate_test().loss_sum / data.test.size();
  double last = 0;
  while (core.step() < core.total_steps()) {
    last = core.compute_gradient();
    core.apply_gradient(core.gradient());
  }
  const EvalResult r = core.evaluate_test();
  const double final_loss = r.loss_sum / r.count;
  EXPECT_GT(initial, 1.0);
  EXPECT_LT(final_loss, 0.3) << "initial " << initial;
  EXPECT_LT(last, 0.3);
  EXPECT_GT(static_cast<double>(r.correct) / r.count, 0.9);
  EXPECT_EQ(core.position(), (DataPosition{2, 0}));
}

// train.budget = "gradients": the run ends once the updates have counted steps x world
// gradients, and the schedule advances by counted gradients / the schedule's quorum.
TEST(TrainRun, GradientBudgetCountsGradientsAndReadsTheScheduleByThem) {
  // World 4, schedule quorum 2: 128 full-sync steps are 512 gradients, 256 steps of 2.
  TrainConfig cfg = smoke({"train.budget=gradients", "train.warmup_steps=10", "train.steps=128"});
  DatasetPair data = load_datasets(cfg.data, cfg.run.seed);
  TrainerCore core(cfg, data, 0, 4, 2);
  TrainerCore steps(smoke({"train.warmup_steps=10", "train.steps=128"}), data, 0, 4, 2);
  EXPECT_EQ(core.budget_gradients(), 512);
  EXPECT_EQ(steps.budget_gradients(), 0);
  // Warm-up of 10 full-sync steps = 20 steps of 2 gradients.
  EXPECT_EQ(core.schedule().warmup_steps, 20);
  EXPECT_EQ(core.schedule().total_steps, 256);
  std::vector<float> zero(core.num_params() + 1, 0.0f);
  int64_t t = 0;
  for (; !core.budget_spent(t); ++t) {
    EXPECT_EQ(core.schedule_position(), core.counted_gradients() / 2);
    EXPECT_DOUBLE_EQ(core.lr(), core.schedule().at(core.counted_gradients() / 2));
    // Steps of 1, 2 and 3 contributors: the position moves by the gradients, not the steps.
    core.apply_gradient(zero.data(), 1.0, int(t % 3) + 1);
  }
  // 1+2+3 a cycle: 255 steps count 510, step 256 brings 511, step 257 reaches 512 (and goes
  // past it by the step's gradients: a step is never cut).
  EXPECT_EQ(t, 257);
  EXPECT_EQ(core.counted_gradients(), 513);
  EXPECT_FALSE(steps.budget_spent(127));
  EXPECT_TRUE(steps.budget_spent(128));
}

TEST(TrainRun, GradientBudgetCountSurvivesACheckpointAndIsRequiredByIt) {
  TrainConfig cfg = smoke({"train.budget=gradients"});
  DatasetPair data = load_datasets(cfg.data, cfg.run.seed);
  TrainerCore a(cfg, data, 0, 4, 3);
  for (int i = 0; i < 5; ++i) {
    a.compute_gradient();
    a.apply_gradient(a.gradient(), 1.0, 3 + (i & 1));
  }
  ASSERT_EQ(a.counted_gradients(), 17);
  const std::string dir = testing::TempDir() + "/qring_budget_ckpt";
  fs::create_directories(dir);
  const std::string path = dir + "/b.qck";
  save_checkpoint(path, a.checkpoint_state());
  TrainerCore b(cfg, data, 0, 4, 3);
  b.restore(load_checkpoint(path));
  EXPECT_EQ(b.counted_gradients(), 17);
  EXPECT_EQ(b.step(), 5);
  EXPECT_DOUBLE_EQ(b.lr(), a.lr());
  // A state without the count (a run budgeted in steps wrote it) cannot continue one in
  // gradients: its position in the schedule is unknown.
  CheckpointState st = a.checkpoint_state();
  st.meta = "{\"run\": \"x\"}";
  TrainerCore c(cfg, data, 0, 4, 3);
  EXPECT_THROW(c.restore(st), DataError);
  TrainerCore d(smoke(), data, 0, 4, 3);
  EXPECT_NO_THROW(d.restore(st));
  EXPECT_EQ(d.step(), 5);
  fs::remove_all(dir);
}

// quorum "auto" keeps the rate inside the momentum buffer (train/optim.h): its checkpoints
// say so, resume bit-identically in that mode and are refused, by name, by a fixed quorum
// (and a fixed quorum's by "auto"), whose buffer means another thing.
TEST(TrainRun, MomentumFormOfAutoQuorumSurvivesACheckpointAndIsCheckedByIt) {
  TrainConfig cfg = smoke({"quorum.quorum=auto", "train.steps=40"});
  ASSERT_TRUE(sgd_options(cfg).lr_in_velocity);
  DatasetPair data = load_datasets(cfg.data, cfg.run.seed);
  auto run = [&](TrainerCore& core, int64_t upto) {
    while (core.step() < upto) {
      core.compute_gradient();
      const int k = int(core.step() % 3) + 1;  // 1, 2, 3 contributors: the rate moves
      core.apply_gradient(core.gradient(), double(k) / 4, k);
    }
  };
  TrainerCore straight(cfg, data, 0, 4, 4);
  run(straight, 40);
  TrainerCore first(cfg, data, 0, 4, 4);
  run(first, 17);
  const CheckpointState st = first.checkpoint_state();
  EXPECT_EQ(nlohmann::json::parse(st.meta).value("lr_in_velocity", false), true);
  TrainerCore resumed(cfg, data, 0, 4, 4);
  resumed.restore(st);
  run(resumed, 40);
  EXPECT_TRUE(bit_identical(params_of(straight), params_of(resumed)));
  EXPECT_TRUE(bit_identical(straight.optimizer().velocity(), resumed.optimizer().velocity()));

  TrainerCore fixed(smoke({"quorum.quorum=3", "train.steps=40"}), data, 0, 4, 3);
  try {
    fixed.restore(st);
    ADD_FAILURE() << "a fixed quorum resumed a checkpoint of quorum auto";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("momentum buffer"), std::string::npos) << e.what();
  }
  TrainerCore other(cfg, data, 0, 4, 4);
  EXPECT_THROW(other.restore(fixed.checkpoint_state()), DataError);
}

TEST(TrainRun, CnnLossDecreases) {
  TrainConfig cfg = smoke({"model.type=cnn", "model.conv_channels=[4, 8]", "model.hidden=[16]",
                           "train.steps=40", "data.synthetic_train=1280"});
  DatasetPair data = load_datasets(cfg.data, cfg.run.seed);
  TrainerCore core(cfg, data, 0, 1, 1);
  const double initial = core.evaluate_test().loss_sum / data.test.size();
  while (core.step() < core.total_steps()) {
    core.compute_gradient();
    core.apply_gradient(core.gradient());
  }
  const double final_loss = core.evaluate_test().loss_sum / data.test.size();
  EXPECT_LT(final_loss, 0.5 * initial);
}

TEST(TrainRun, SameSeedIsBitIdenticalDifferentSeedIsNot) {
  auto run = [](int64_t seed) {
    TrainConfig cfg = smoke({"train.steps=30", "run.seed=" + std::to_string(seed)});
    DatasetPair data = load_datasets(cfg.data, cfg.run.seed);
    TrainerCore core(cfg, data, 0, 1, 1);
    while (core.step() < core.total_steps()) {
      core.compute_gradient();
      core.apply_gradient(core.gradient());
    }
    return params_of(core);
  };
  const auto a = run(5), b = run(5), c = run(6);
  EXPECT_TRUE(bit_identical(a, b));
  EXPECT_FALSE(bit_identical(a, c));
}

TEST(TrainRun, ResumeFromCheckpointIsBitIdentical) {
  TrainConfig cfg = smoke({"train.steps=100"});  // crosses the epoch boundary at 64
  DatasetPair data = load_datasets(cfg.data, cfg.run.seed);
  TrainerCore straight(cfg, data, 0, 1, 1);
  while (straight.step() < straight.total_steps()) {
    straight.compute_gradient();
    straight.apply_gradient(straight.gradient());
  }

  std::string tmpl = (fs::temp_directory_path() / "qring-run-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  {
    TrainerCore first(cfg, data, 0, 1, 1);
    for (int i = 0; i < 57; ++i) {
      first.compute_gradient();
      first.apply_gradient(first.gradient());
    }
    save_checkpoint(checkpoint_path(tmpl, first.step()), first.checkpoint_state());
    // What a donor sends a rejoining rank: the same bytes, encoded from the live buffers.
    EXPECT_EQ(encode_checkpoint(first.checkpoint_view()),
              encode_checkpoint(first.checkpoint_state()));
  }
  TrainerCore resumed(cfg, data, 0, 1, 1);
  resumed.restore(load_checkpoint(*latest_checkpoint(tmpl)));
  EXPECT_EQ(resumed.step(), 57);
  while (resumed.step() < resumed.total_steps()) {
    resumed.compute_gradient();
    resumed.apply_gradient(resumed.gradient());
  }
  EXPECT_TRUE(bit_identical(params_of(straight), params_of(resumed)));
  EXPECT_TRUE(bit_identical(straight.optimizer().velocity(), resumed.optimizer().velocity()));
  fs::remove_all(tmpl);

  // A checkpoint from another model or seed is refused.
  TrainerCore other(smoke({"model.hidden=[16]"}), data, 0, 1, 1);
  EXPECT_THROW(other.restore(straight.checkpoint_state()), DataError);
  TrainerCore reseeded(smoke({"run.seed=9"}), data, 0, 1, 1);
  EXPECT_THROW(reseeded.restore(straight.checkpoint_state()), DataError);
}

// Two ranks in one process, averaging gradients by hand as the all-reduce will: parameters
// stay bit-identical on both ranks, each rank sees its own half of the data, and it learns.
TEST(TrainRun, TwoRanksWithAveragedGradientsStayInSync) {
  TrainConfig cfg = smoke({"train.epochs=2"});
  DatasetPair data = load_datasets(cfg.data, cfg.run.seed);
  TrainerCore r0(cfg, data, 0, 2, 2), r1(cfg, data, 1, 2, 2);
  EXPECT_EQ(r0.steps_per_epoch(), 32);
  EXPECT_DOUBLE_EQ(r0.schedule().peak_lr, 0.1 * 64 / 128);  // linear rule, Q = 2
  std::vector<float> avg(r0.num_params());
  while (r0.step() < r0.total_steps()) {
    r0.compute_gradient();
    r1.compute_gradient();
    for (size_t i = 0; i < avg.size(); ++i) avg[i] = 0.5f * (r0.gradient()[i] + r1.gradient()[i]);
    r0.apply_gradient(avg.data());
    r1.apply_gradient(avg.data());
  }
  EXPECT_TRUE(bit_identical(params_of(r0), params_of(r1)));
  const EvalResult r = r0.evaluate_test();
  EXPECT_GT(static_cast<double>(r.correct) / r.count, 0.9);
}

}  // namespace
}  // namespace qring::train
