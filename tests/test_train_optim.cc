#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "net/error.h"
#include "train/config.h"
#include "train/optim.h"

namespace qring::train {
namespace {

TEST(Sgd, MatchesPyTorchFormula) {
  const std::vector<float> g1 = {1.0f, -2.0f, 0.5f}, g2 = {0.5f, 0.25f, -1.0f};
  std::vector<float> p = {1.0f, 2.0f, -3.0f};
  Sgd opt(3, {0.9, 0.1, false});
  opt.step(p.data(), g1.data(), 0.5);
  // step 1: d = g + 0.1 p; v = d; p -= 0.5 v
  std::vector<double> pe = {1.0, 2.0, -3.0}, ve(3);
  for (int i = 0; i < 3; ++i) {
    const double d = g1[i] + 0.1 * pe[i];
    ve[i] = d;
    pe[i] -= 0.5 * ve[i];
    EXPECT_NEAR(p[i], pe[i], 1e-6);
  }
  opt.step(p.data(), g2.data(), 0.25);
  for (int i = 0; i < 3; ++i) {
    const double d = g2[i] + 0.1 * pe[i];
    ve[i] = 0.9 * ve[i] + d;
    pe[i] -= 0.25 * ve[i];
    EXPECT_NEAR(p[i], pe[i], 1e-6);
    EXPECT_NEAR(opt.velocity()[i], ve[i], 1e-6);
  }
}

TEST(Sgd, Nesterov) {
  std::vector<float> p = {1.0f}, g = {2.0f};
  Sgd opt(1, {0.5, 0.0, true});
  opt.step(p.data(), g.data(), 0.1);
  // v = 2; p -= 0.1 * (2 + 0.5 * 2)
  EXPECT_NEAR(p[0], 1.0 - 0.1 * 3.0, 1e-7);
  opt.step(p.data(), g.data(), 0.1);
  // v = 0.5*2 + 2 = 3; p -= 0.1 * (2 + 1.5)
  EXPECT_NEAR(p[0], 0.7 - 0.35, 1e-6);
}

TEST(Sgd, PlainSgdWithoutMomentum) {
  std::vector<float> p = {4.0f}, g = {1.0f};
  Sgd opt(1, {0.0, 0.0, false});
  for (int i = 0; i < 3; ++i) opt.step(p.data(), g.data(), 0.5);
  EXPECT_FLOAT_EQ(p[0], 2.5f);
}

TEST(Schedule, WarmupThenConstant) {
  LrSchedule s{0.4, 4, ScheduleKind::kConstant, 100, 10, 0.1};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(1), 0.2);
  EXPECT_DOUBLE_EQ(s.at(3), 0.4);
  EXPECT_DOUBLE_EQ(s.at(4), 0.4);
  EXPECT_DOUBLE_EQ(s.at(1000), 0.4);
}

TEST(Schedule, StepDecay) {
  LrSchedule s{1.0, 0, ScheduleKind::kStep, 100, 10, 0.5};
  EXPECT_DOUBLE_EQ(s.at(0), 1.0);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 0.5);
  EXPECT_DOUBLE_EQ(s.at(25), 0.25);
}

TEST(Schedule, CosineAfterWarmup) {
  LrSchedule s{1.0, 10, ScheduleKind::kCosine, 110, 10, 0.1};
  EXPECT_DOUBLE_EQ(s.at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.5, 1e-12);
  EXPECT_NEAR(s.at(35), 0.5 * (1 + std::cos(std::numbers::pi * 0.25)), 1e-12);
  EXPECT_NEAR(s.at(110), 0.0, 1e-12);
  EXPECT_NEAR(s.at(500), 0.0, 1e-12);  // clamped past the end
}

TEST(LrScaling, Rules) {
  EXPECT_DOUBLE_EQ(scaled_lr(0.1, "none", 3, 64, 256), 0.1);
  EXPECT_DOUBLE_EQ(scaled_lr(0.1, "linear", 3, 64, 256), 0.1 * 192 / 256);
  EXPECT_DOUBLE_EQ(scaled_lr(0.1, "linear", 4, 64, 256), 0.1);
  EXPECT_DOUBLE_EQ(scaled_lr(0.1, "sqrt", 1, 64, 256), 0.05);
  EXPECT_THROW(scaled_lr(0.1, "cubic", 1, 64, 256), ConfigError);
  EXPECT_THROW(scaled_lr(0.1, "linear", 0, 64, 256), UsageError);
}

TEST(LrScaling, FromConfig) {
  TrainConfig c = TrainConfig::from_string(
      "[train]\nlr = 0.2\nbatch_per_rank = 32\nreference_batch = 128\nschedule = \"step\"\n"
      "warmup_steps = 5\nstep_decay_every = 50\nstep_decay_factor = 0.5\nmomentum = 0.8\n"
      "weight_decay = 0.01\n");
  LrSchedule s = make_schedule(c, 2, 1000);
  EXPECT_DOUBLE_EQ(s.peak_lr, 0.1);  // 0.2 * (2 * 32) / 128
  EXPECT_EQ(s.kind, ScheduleKind::kStep);
  EXPECT_DOUBLE_EQ(s.at(0), 0.02);
  EXPECT_DOUBLE_EQ(s.at(60), 0.05);
  SgdOptions o = sgd_options(c);
  EXPECT_DOUBLE_EQ(o.momentum, 0.8);
  EXPECT_DOUBLE_EQ(o.weight_decay, 0.01);
}

}  // namespace
}  // namespace qring::train
