#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "net/base/error.h"
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

TEST(Sgd, RateInsideTheBufferMatchesItsFormula) {
  const std::vector<float> g1 = {1.0f, -2.0f, 0.5f}, g2 = {0.5f, 0.25f, -1.0f};
  for (bool nesterov : {false, true}) {
    std::vector<float> p = {1.0f, 2.0f, -3.0f};
    Sgd opt(3, {0.9, 0.1, nesterov, true});
    std::vector<double> pe = {1.0, 2.0, -3.0}, ve = {0, 0, 0};
    const double lr[2] = {0.5, 0.25};
    for (int s = 0; s < 2; ++s) {
      const auto& g = s == 0 ? g1 : g2;
      opt.step(p.data(), g.data(), lr[s]);
      for (int i = 0; i < 3; ++i) {
        // d = lr (g + 0.1 p); v = 0.9 v + d; p -= nesterov ? d + 0.9 v : v
        const double d = lr[s] * (g[i] + 0.1 * pe[i]);
        ve[i] = 0.9 * ve[i] + d;
        pe[i] -= nesterov ? d + 0.9 * ve[i] : ve[i];
        EXPECT_NEAR(p[i], pe[i], 1e-6) << "nesterov " << nesterov << " step " << s;
        EXPECT_NEAR(opt.velocity()[i], ve[i], 1e-6);
      }
    }
  }
}

TEST(Sgd, RateInsideTheBufferIsPyTorchsFormAtAConstantRate) {
  const std::vector<float> g1 = {1.0f, -2.0f, 0.5f}, g2 = {0.5f, 0.25f, -1.0f};
  std::vector<float> a = {1.0f, 2.0f, -3.0f}, b = a;
  Sgd plain(3, {0.9, 0.1, false, false}), inside(3, {0.9, 0.1, false, true});
  for (int s = 0; s < 6; ++s) {
    plain.step(a.data(), (s & 1 ? g2 : g1).data(), 0.05);
    inside.step(b.data(), (s & 1 ? g2 : g1).data(), 0.05);
  }
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(a[i], b[i], 1e-5);
}

// Under quorum "auto" the rate of a step scales with its k contributors (linear rule:
// lr = base k) and the step applies the mean of their k gradients. With the rate inside the
// buffer one gradient, counted in a step of 1, 2 or 3 and followed by steps of other sizes,
// moves the parameter by base / (1 - momentum) in all, whatever the sizes; PyTorch's form
// rescales it with the rates of the later steps.
TEST(Sgd, RateInsideTheBufferMovesEveryCountedGradientByTheSameAmount) {
  const double base = 0.01, mu = 0.9;
  auto moved = [&](bool inside, int k0) {
    std::vector<float> p = {0.0f};
    Sgd opt(1, {mu, 0.0, false, inside});
    // Step 0 counts k0 gradients, one of which is 1 (the others 0): the mean is 1 / k0.
    const float g0 = 1.0f / float(k0), zero = 0.0f;
    opt.step(p.data(), &g0, base * k0);
    // Then 400 steps of 2, 1, 2, 1 ... contributors with zero gradients.
    for (int s = 0; s < 400; ++s) opt.step(p.data(), &zero, base * (s % 2 == 0 ? 2 : 1));
    return -double(p[0]);
  };
  for (int k0 : {1, 2, 3}) {
    EXPECT_NEAR(moved(true, k0), base / (1 - mu), 1e-5) << "a gradient of a step of " << k0;
    // PyTorch's form: step 0's rate base k0, then the later rates (1.5 base on average),
    // all times the buffer's 1 / k0: 1.47x (k0 = 1), 0.79x (2), 0.56x (3) of that amount.
    EXPECT_GT(std::abs(moved(false, k0) / (base / (1 - mu)) - 1), 0.2) << k0;
  }
}

TEST(Sgd, StalenessRuleDividesTheRateByTheStaleness) {
  EXPECT_EQ(staleness_lr_scale(false, 7), 1.0);
  EXPECT_EQ(staleness_lr_scale(true, 0), 1.0);
  EXPECT_EQ(staleness_lr_scale(true, 1), 1.0);
  EXPECT_EQ(staleness_lr_scale(true, 4), 0.25);
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
  EXPECT_FALSE(o.lr_in_velocity);
  // quorum "auto" scales the rate step by step: the rate goes inside the buffer.
  EXPECT_TRUE(
      sgd_options(TrainConfig::from_string("[quorum]\nquorum = \"auto\"\n")).lr_in_velocity);
  EXPECT_FALSE(sgd_options(TrainConfig::from_string("[quorum]\nquorum = 3\n")).lr_in_velocity);
}

}  // namespace
}  // namespace qring::train
