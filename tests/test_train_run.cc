#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "net/error.h"
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
