#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "collectives/quorum/coordinator.h"
#include "collectives/straggler.h"
#include "net/base/error.h"
#include "train/config.h"
#include "train/dataset.h"
#include "train/sim.h"
#include "train/trainer.h"
#include "train/trainer_core.h"

namespace qring::train {
namespace {

namespace fs = std::filesystem;

const char* kToml = R"(
[run]
name = "sim-test"
seed = 3
[data]
dataset = "synthetic"
synthetic_train = 2048
synthetic_test = 256
[model]
type = "mlp"
hidden = [16]
[train]
batch_per_rank = 16
steps = 12
lr = 0.1
reference_batch = 64
warmup_steps = 2
eval_every = 6
eval_batch = 256
[straggler]
model = "shiftexp:2:10"
)";

// One compute thread, as qring-sim runs by default (OpenMP's lanes spin on a shared machine).
const bool kOneThread = [] {
  omp_set_num_threads(1);
  return true;
}();

TrainConfig config(const std::vector<std::string>& overrides = {}) {
  return TrainConfig::from_string(kToml, overrides);
}

const DatasetPair& data() {
  static DatasetPair d = load_datasets(config().data, 3);
  return d;
}

double harmonic(int n) {
  double h = 0;
  for (int i = 1; i <= n; ++i) h += 1.0 / i;
  return h;
}

// Issue 16 item 6a: for shiftexp the k-th of n arrivals is expected at
// SHIFT + MEAN (H(n) - H(n-k)); the simulator's arrivals, averaged over many steps, agree.
TEST(Sim, KthArrivalMatchesShiftedExponentialOrderStatistics) {
  const auto m = collectives::StragglerModel::parse("shiftexp:10:20");
  const int n = 100, steps = 3000;
  const std::vector<int> ks = {1, 10, 50, 90, 98, 100};
  std::vector<double> mean(ks.size(), 0.0);
  for (int s = 0; s < steps; ++s) {
    auto a = sim_arrivals(m, 5, n, uint64_t(s), 0.0);
    ASSERT_EQ(a.size(), size_t(n));
    for (size_t i = 1; i < a.size(); ++i) ASSERT_LE(a[i - 1].ms, a[i].ms);
    for (size_t j = 0; j < ks.size(); ++j) mean[j] += a[size_t(ks[j] - 1)].ms / steps;
  }
  for (size_t j = 0; j < ks.size(); ++j) {
    const double expect = 10.0 + 20.0 * (harmonic(n) - harmonic(n - ks[j]));
    EXPECT_NEAR(mean[j], expect, 0.02 * expect) << "k = " << ks[j];
  }
  // The base compute time shifts every arrival.
  auto a0 = sim_arrivals(m, 5, n, 7, 0.0), a1 = sim_arrivals(m, 5, n, 7, 4.5);
  for (size_t i = 0; i < a0.size(); ++i) {
    EXPECT_EQ(a0[i].rank, a1[i].rank);
    EXPECT_DOUBLE_EQ(a0[i].ms + 4.5, a1[i].ms);
  }
}

TEST(Sim, ArrivalTiesGoByRankAndAllReduceCost) {
  auto a = sim_arrivals(collectives::StragglerModel::parse("none"), 1, 5, 0, 3.0);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(a[size_t(i)].rank, i);
  EXPECT_EQ(sim_allreduce_ms(1, 1e6, 50, 1), 0.0);
  // rounds alpha + bytes beta 2 (k-1)/k, rounds as make_collective_op chooses the algorithm:
  EXPECT_EQ(sim_allreduce_rounds(4, 1000), 2);   // recursive doubling
  EXPECT_EQ(sim_allreduce_rounds(6, 1000), 4);   // ... off a power of two: 2 more
  EXPECT_EQ(sim_allreduce_rounds(8, 1e6), 6);    // halving-doubling, 2 log2 k
  EXPECT_EQ(sim_allreduce_rounds(7, 1e6), 12);   // the ring, 2 (k - 1)
  EXPECT_EQ(sim_allreduce_rounds(8, 2e6), 14);   // above 1 MiB: the ring
  // halving-doubling on 4: 4 * 50 us + 1e6 B * 1 ns * 2 * 3/4 = 1.7 ms; the ring on 3: 4 * 50 us
  // + 1e6 B * 1 ns * 2 * 2/3.
  EXPECT_NEAR(sim_allreduce_ms(4, 1e6, 50, 1), 1.7, 1e-12);
  EXPECT_NEAR(sim_allreduce_ms(3, 1e6, 50, 1), 0.2 + 4.0 / 3.0, 1e-12);
  // The READY/DECIDE round trip counts only with backups (full sync speculates).
  SimOptions o;
  o.alpha_us = 50;
  o.beta_ns_per_byte = 1;
  o.rtt_us = 200;
  o.backups = 0;
  EXPECT_NEAR(sim_sync_comm_ms(o, 4, 1e6, 0.5), 1.7 + 0.5, 1e-12);
  o.backups = 1;
  EXPECT_NEAR(sim_sync_comm_ms(o, 4, 1e6, 0.5), 0.2 + 1.7 + 0.5, 1e-12);
  // Measured step costs replace round trip + all-reduce for the contributor counts they hold,
  // full sync and backups apart; other counts keep the model.
  o.step_cost_full_ms = {{4, 3.0}};
  o.step_cost_backup_ms = {{3, 5.0}};
  EXPECT_NEAR(sim_sync_comm_ms(o, 3, 1e6, 0.5), 5.5, 1e-12);
  EXPECT_NEAR(sim_sync_comm_ms(o, 4, 1e6, 0.5), 0.2 + 1.7 + 0.5, 1e-12);
  o.backups = 0;
  EXPECT_NEAR(sim_sync_comm_ms(o, 4, 1e6, 0.5), 3.5, 1e-12);
  EXPECT_NEAR(sim_sync_comm_ms(o, 3, 1e6, 0.5), sim_allreduce_ms(3, 1e6, 50, 1) + 0.5, 1e-12);
}

// Measured arrival offsets (the ranks' start skew on real hosts): step t adds row t % rows to
// each rank's arrival, the order follows, and the step is decided on the shifted arrivals.
TEST(Sim, ArrivalOffsetsShiftEachRanksArrivalByTheStepsRow) {
  const auto none = collectives::StragglerModel::parse("none");
  const std::vector<std::vector<double>> rows = {{0, 5, 1}, {0, 0, 9}};
  auto a = sim_arrivals(none, 1, 3, 0, 2.0);
  sim_offset_arrivals(a, rows, 0);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[0].rank, 0);
  EXPECT_EQ(a[1].rank, 2);
  EXPECT_EQ(a[2].rank, 1);
  EXPECT_DOUBLE_EQ(a[2].ms, 7.0);
  a = sim_arrivals(none, 1, 3, 3, 2.0);  // step 3: row 1
  sim_offset_arrivals(a, rows, 3);
  EXPECT_EQ(a[2].rank, 2);
  EXPECT_DOUBLE_EQ(a[2].ms, 11.0);
  // A whole arrivals-only run: full sync's step is the last shifted arrival + the measured
  // cost beyond it + the update; a quorum without a table keeps the ranks together.
  SimOptions o;
  o.workers = 3;
  o.compute_ms = 2;
  o.apply_ms = 0.5;
  o.arrivals_only = true;
  o.step_cost_full_ms = {{3, 4.0}};
  o.arrival_offsets_ms = {{3, rows}};
  const TrainConfig cfg = config({"straggler.model=none", "train.steps=4"});
  SimResult r = simulate(cfg, data(), o);
  ASSERT_EQ(r.steps.size(), 4u);
  EXPECT_DOUBLE_EQ(r.steps[0].step_ms, 7.0 + 4.5);
  EXPECT_DOUBLE_EQ(r.steps[1].step_ms, 11.0 + 4.5);
  EXPECT_DOUBLE_EQ(r.steps[2].step_ms, 7.0 + 4.5);
  o.arrival_offsets_ms = {{2, rows}};
  r = simulate(cfg, data(), o);
  EXPECT_DOUBLE_EQ(r.steps[1].step_ms, 2.0 + 4.5);
  // A row that does not cover every worker, or holds a non-finite number, is an error.
  o.arrival_offsets_ms = {{3, {{0, 1}}}};
  EXPECT_THROW(simulate(cfg, data(), o), ConfigError);
  o.arrival_offsets_ms = {{3, {{0, 1, NAN}}}};
  EXPECT_THROW(simulate(cfg, data(), o), ConfigError);
}

SimOptions sync_opts(int workers, int backups) {
  SimOptions o;
  o.workers = workers;
  o.backups = backups;
  o.compute_ms = 4;
  o.apply_ms = 0.3;
  o.alpha_us = 20;
  o.beta_ns_per_byte = 0.5;
  o.rtt_us = 60;
  return o;
}

// Issue 16 item 6b: N = W - b gradients averaged every step, the first N to arrive, and the
// step ends at the N-th arrival plus communication.
TEST(Sim, SyncAveragesTheFirstNArrivalsEveryStep) {
  const TrainConfig cfg = config();
  const auto m = collectives::StragglerModel::parse(cfg.straggler.model);
  for (int b : {0, 3}) {
    const int W = 8, N = W - b;
    SimOptions o = sync_opts(W, b);
    SimResult r = simulate(cfg, data(), o);
    ASSERT_EQ(r.steps.size(), 12u) << b;
    EXPECT_EQ(r.updates, 12);
    EXPECT_EQ(r.gradients_computed, 12 * N);
    const double P = double(TrainerCore(cfg, data(), 0, W, N).num_params());
    const double bytes = 4 * (P + 1);
    const double comm = (b > 0 ? 0.060 : 0.0) + sim_allreduce_rounds(N, bytes) * 0.020 +
                        bytes * 0.5e-6 * 2 * (N - 1) / N + 0.3;
    double vt = 0;
    for (const auto& s : r.steps) {
      EXPECT_EQ(s.contributors, N);
      auto a = sim_arrivals(m, 3, W, uint64_t(s.step), 4.0);
      ASSERT_EQ(s.ranks.size(), size_t(N));
      for (int i = 0; i < N; ++i) EXPECT_EQ(s.ranks[size_t(i)], a[size_t(i)].rank);
      EXPECT_DOUBLE_EQ(s.kth_arrival_ms, a[size_t(N - 1)].ms);
      EXPECT_NEAR(s.step_ms, a[size_t(N - 1)].ms + comm, 1e-9);
      vt += s.step_ms / 1000;
      EXPECT_NEAR(s.virtual_s, vt, 1e-9);
      EXPECT_TRUE(std::isfinite(s.loss));
    }
    // Evaluations at step 6 and at the end.
    ASSERT_EQ(r.evals.size(), 2u);
    EXPECT_EQ(r.evals[0].step, 6);
    EXPECT_EQ(r.evals[1].step, 12);
    EXPECT_NEAR(r.virtual_s, vt, 1e-9);
  }
}

// quorum.grace_ms as the coordinator applies it: after the n-th arrival, those within the
// grace count too (an arrival exactly at its end included); the decision is at n-th + grace,
// or at the last arrival when all came within it.
TEST(Sim, GraceCountsTheArrivalsWithinItAfterTheQuorum) {
  std::vector<SimArrival> a;
  for (double ms : {0.0, 1.0, 2.0, 5.0, 9.0}) a.push_back({ms, int(a.size())});
  auto d = sim_decide(a, 2, 0);
  EXPECT_EQ(d.count, 2);
  EXPECT_DOUBLE_EQ(d.at_ms, 1.0);
  d = sim_decide(a, 2, 1.5);
  EXPECT_EQ(d.count, 3);
  EXPECT_DOUBLE_EQ(d.at_ms, 2.5);
  d = sim_decide(a, 2, 4.0);
  EXPECT_EQ(d.count, 4);
  EXPECT_DOUBLE_EQ(d.at_ms, 5.0);
  d = sim_decide(a, 2, 50.0);
  EXPECT_EQ(d.count, 5);
  EXPECT_DOUBLE_EQ(d.at_ms, 9.0);
  d = sim_decide(a, 5, 3.0);  // all of them: nothing to wait for
  EXPECT_EQ(d.count, 5);
  EXPECT_DOUBLE_EQ(d.at_ms, 9.0);
}

// sim_decide is the coordinator's decision: the same arrivals fed to a qproto::Coordinator as
// READYs on its clock (a 0.25 ms grid, ticks at every point of it) give the same contributors
// at the same instant, for quorums with and without a grace.
TEST(Sim, DecidesAsTheCoordinatorDoes) {
  using namespace collectives::qproto;
  const auto m = collectives::StragglerModel::parse("lognormal:1.5:1.0");
  const auto grid = std::chrono::microseconds(250);
  int checked = 0;
  for (int W : {4, 9}) {
    for (int n : {1, W / 2, W - 1, W}) {
      for (int grace : {0, 1, 3, 20}) {
        for (uint64_t step = 0; step < 6; ++step) {
          auto arr = sim_arrivals(m, 11, W, step, 0.0);
          for (auto& a : arr) a.ms = std::round(a.ms * 4) / 4;  // onto the grid
          std::stable_sort(arr.begin(), arr.end(), [](const SimArrival& x, const SimArrival& y) {
            return x.ms != y.ms ? x.ms < y.ms : x.rank < y.rank;
          });
          const SimDecision d = sim_decide(arr, n, double(grace));

          Config cfg;
          cfg.world = W;
          cfg.quorum = n;
          cfg.count = 8;
          cfg.grace = Ms(grace);
          const Time t0 = Time{} + std::chrono::hours(1);
          Coordinator c(cfg, t0);
          std::optional<Decision> got;
          double got_ms = -1;
          size_t next = 0;
          for (Time now = t0; !got && now < t0 + std::chrono::seconds(2); now += grid) {
            std::vector<Down> out;
            for (; next < arr.size() && t0 + std::chrono::microseconds(std::llround(
                                                 arr[next].ms * 1000)) <= now;
                 ++next) {
              Event e;
              e.kind = Event::Kind::kReady;
              e.from = arr[next].rank;
              e.step = 0;
              e.count = 8;
              auto a = c.handle(e, now);
              out.insert(out.end(), a.begin(), a.end());
            }
            auto a = c.handle(Event{}, now);
            out.insert(out.end(), a.begin(), a.end());
            for (auto& act : out)
              if (act.kind == Down::Kind::kDecide && !got) {
                got = act.decide;
                got_ms = std::chrono::duration<double, std::milli>(now - t0).count();
              }
          }
          ASSERT_TRUE(got) << "W " << W << " n " << n << " grace " << grace;
          EXPECT_EQ(int(got->contributors.size()), d.count)
              << "W " << W << " n " << n << " grace " << grace << " step " << step;
          EXPECT_DOUBLE_EQ(got_ms, d.at_ms)
              << "W " << W << " n " << n << " grace " << grace << " step " << step;
          std::vector<int> ranks;
          for (int i = 0; i < d.count; ++i) ranks.push_back(arr[size_t(i)].rank);
          std::sort(ranks.begin(), ranks.end());
          EXPECT_EQ(got->contributors, ranks);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 4 * 4 * 6);
}

// A run with a grace: every step averages sim_decide's arrivals (more than the quorum on some
// steps), ends at the decision plus communication among them, and records the quorum in force.
TEST(Sim, SyncWithGraceAveragesTheArrivalsWithinTheGrace) {
  const TrainConfig cfg = config();
  const auto m = collectives::StragglerModel::parse(cfg.straggler.model);
  const int W = 8, b = 4, N = W - b;
  SimOptions o = sync_opts(W, b);
  o.grace_ms = 3;
  SimResult r = simulate(cfg, data(), o);
  ASSERT_EQ(r.steps.size(), 12u);
  const double P = double(TrainerCore(cfg, data(), 0, W, N).num_params());
  const double bytes = 4 * (P + 1);
  int more = 0;
  for (const auto& s : r.steps) {
    auto a = sim_arrivals(m, 3, W, uint64_t(s.step), 4.0);
    const SimDecision d = sim_decide(a, N, 3);
    EXPECT_EQ(s.quorum, N);
    EXPECT_EQ(s.contributors, d.count);
    ASSERT_EQ(s.ranks.size(), size_t(d.count));
    for (int i = 0; i < d.count; ++i) EXPECT_EQ(s.ranks[size_t(i)], a[size_t(i)].rank);
    const double comm = 0.060 + sim_allreduce_rounds(d.count, bytes) * 0.020 +
                        bytes * 0.5e-6 * 2 * (d.count - 1) / d.count + 0.3;
    EXPECT_NEAR(s.step_ms, d.at_ms + comm, 1e-9);
    more += d.count > N;
  }
  EXPECT_GT(more, 0);  // the grace mattered on some step (shiftexp:2:10, a grace of 3 ms)
  EXPECT_EQ(r.quorum_hist.at(N), 12);
  EXPECT_EQ(r.updates, 12);
  // The same run without the grace trains on fewer gradients: other parameters.
  EXPECT_NE(simulate(cfg, data(), sync_opts(W, b)).params_checksum, r.params_checksum);
}

// The update is exactly SGD with the mean of the first N gradients summed in arrival order:
// recomputed here from the same pieces (TrainerCore, Sharder, sim_arrivals), bit for bit.
TEST(Sim, SyncUpdateIsTheMeanOfTheFirstNGradientsInArrivalOrder) {
  const TrainConfig cfg = config({"train.steps=3"});
  const int W = 6, b = 2, N = W - b;
  SimResult r = simulate(cfg, data(), sync_opts(W, b));

  TrainerCore ref(cfg, data(), 0, W, N);
  std::vector<Sharder> sh;
  for (int w = 0; w < W; ++w) sh.emplace_back(data().train.size(), w, W, 16, 3);
  const auto m = collectives::StragglerModel::parse(cfg.straggler.model);
  const size_t P = ref.num_params();
  AlignedVector<float> x(size_t(16 * data().train.dim));
  std::vector<int32_t> y(16);
  for (int t = 0; t < 3; ++t) {
    auto a = sim_arrivals(m, 3, W, uint64_t(t), 4.0);
    std::vector<float> sum(P, 0.0f);
    for (int i = 0; i < W; ++i) {
      const auto& idx = sh[size_t(a[size_t(i)].rank)].next_batch();
      if (i >= N) continue;
      gather_batch(data().train, idx, x.data(), y.data());
      ref.model().forward_backward(x.data(), y.data(), 16);
      for (size_t p = 0; p < P; ++p) sum[p] += ref.gradient()[p];
    }
    for (auto& v : sum) v *= 1.0f / float(N);
    ref.apply_gradient(sum.data());
  }
  EXPECT_EQ(r.params_checksum, checksum(ref.params(), P));
  // The backups matter: all W gradients give other parameters.
  SimResult full = simulate(cfg, data(), sync_opts(W, 0));
  EXPECT_NE(full.params_checksum, r.params_checksum);
}

// train.budget = "gradients": as many counted gradients as full sync's steps x W, so N of W
// run steps x W / N steps; with N = W it is the run of a budget of steps, bit for bit.
TEST(Sim, GradientBudgetRunsUntilFullSyncsGradientsAreCounted) {
  const int W = 6;
  SimResult full = simulate(config(), data(), sync_opts(W, 0));
  SimResult full_g = simulate(config({"train.budget=gradients"}), data(), sync_opts(W, 0));
  EXPECT_EQ(full_g.params_checksum, full.params_checksum);
  EXPECT_EQ(full_g.steps.size(), 12u);
  SimResult half = simulate(config({"train.budget=gradients"}), data(), sync_opts(W, 3));
  ASSERT_EQ(half.steps.size(), 24u);  // 12 x 6 gradients, 3 a step
  EXPECT_EQ(half.steps.back().step, 23);
  // The schedule (warm-up 2 full-sync steps = 4 steps of 3) is read at the counted gradients.
  TrainerCore ref(config({"train.budget=gradients"}), data(), 0, W, 3);
  for (size_t i = 0; i < half.steps.size(); ++i) {
    EXPECT_DOUBLE_EQ(half.steps[i].lr, ref.schedule().at(int64_t(i))) << i;
  }
  SimResult half_s = simulate(config(), data(), sync_opts(W, 3));
  EXPECT_EQ(half_s.steps.size(), 12u);
  EXPECT_NE(half_s.params_checksum, half.params_checksum);
}

TEST(Sim, IdenticalSeedsGiveIdenticalRuns) {
  for (SimMode mode : {SimMode::kSync, SimMode::kAsync}) {
    SimOptions o = sync_opts(6, mode == SimMode::kSync ? 2 : 0);
    o.mode = mode;
    SimResult a = simulate(config(), data(), o), b = simulate(config(), data(), o);
    EXPECT_EQ(a.params_checksum, b.params_checksum);
    ASSERT_EQ(a.steps.size(), b.steps.size());
    for (size_t i = 0; i < a.steps.size(); ++i) {
      EXPECT_EQ(a.steps[i].loss, b.steps[i].loss);
      EXPECT_EQ(a.steps[i].virtual_s, b.steps[i].virtual_s);
    }
    EXPECT_EQ(a.test_accuracy, b.test_accuracy);
    SimResult c = simulate(config({"run.seed=4"}), data(), o);
    EXPECT_NE(a.params_checksum, c.params_checksum);
  }
}

// Issue 16 item 6c: with a parameter server and workers of the same speed, a gradient is
// stale by about W - 1 updates (exactly W - 1 after the first round).
TEST(Sim, AsyncStalenessIsAboutTheNumberOfWorkers) {
  const int W = 8;
  SimOptions o = sync_opts(W, 0);
  o.mode = SimMode::kAsync;
  SimResult r = simulate(config({"straggler.model=none", "train.steps=20"}), data(), o);
  EXPECT_EQ(r.updates, 20 * W);
  EXPECT_EQ(r.gradients_computed, 20 * W);
  int64_t n = 0;
  for (auto c : r.staleness_hist) n += c;
  EXPECT_EQ(n, 20 * W);
  EXPECT_EQ(r.staleness_max, W - 1);
  EXPECT_GT(r.staleness_mean, 0.9 * (W - 1));
  EXPECT_LE(r.staleness_mean, W - 1);
  ASSERT_EQ(r.steps.size(), 20u);
  EXPECT_NEAR(r.steps[0].staleness_mean, (W - 1) / 2.0, 1e-12);  // first round: 0..W-1
  EXPECT_EQ(r.steps.back().staleness_mean, W - 1);
  // Random delays reorder the updates but one gradient in flight per worker keeps the mean
  // near W - 1 (Little's law).
  SimResult s = simulate(config({"train.steps=20"}), data(), o);
  EXPECT_GT(s.staleness_mean, 0.8 * (W - 1));
  EXPECT_LT(s.staleness_mean, 1.1 * (W - 1));
  EXPECT_GT(s.staleness_max, W - 1);
}

// train.async_staleness = "divide": an update s updates stale takes the schedule's rate / s
// (s >= 1). Without stragglers every update after the first round is W - 1 stale, so each
// round's first update runs at the rate of the plain run / (W - 1), and the runs differ.
TEST(Sim, AsyncDivideRuleScalesEachUpdatesRateByItsStaleness) {
  const int W = 4;
  SimOptions o = sync_opts(W, 0);
  o.mode = SimMode::kAsync;
  SimResult plain = simulate(config({"straggler.model=none", "train.steps=10"}), data(), o);
  SimResult divide = simulate(
      config({"straggler.model=none", "train.steps=10", "train.async_staleness=divide"}), data(), o);
  ASSERT_EQ(plain.steps.size(), divide.steps.size());
  EXPECT_EQ(divide.steps[0].lr, plain.steps[0].lr);  // staleness 0: unchanged
  for (size_t i = 1; i < plain.steps.size(); ++i) {
    EXPECT_EQ(divide.steps[i].staleness_max, W - 1);
    EXPECT_NEAR(divide.steps[i].lr, plain.steps[i].lr / (W - 1), 1e-15) << "round " << i;
  }
  EXPECT_NE(divide.params_checksum, plain.params_checksum);
  EXPECT_THROW(config({"train.async_staleness=halve"}).validate(), ConfigError);
}

TEST(Sim, WritesMetricsAndSummary) {
  const fs::path dir = fs::path(::testing::TempDir()) / "qring-sim-out";
  fs::remove_all(dir);
  SimOptions o = sync_opts(4, 1);
  o.out_dir = dir.string();
  SimResult r = simulate(config({"train.target_accuracy=0.05"}), data(), o);
  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  int steps = 0, evals = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") {
      EXPECT_EQ(j["step"], steps);
      EXPECT_EQ(j["contributors"], 3);
      EXPECT_GT(j["virtual_s"].get<double>(), 0);
      EXPECT_EQ(j["noise_scale"].get<double>(), *r.steps[size_t(steps)].noise_scale);
      ++steps;
    } else {
      EXPECT_EQ(j["type"], "eval");
      EXPECT_TRUE(j.contains("test_accuracy"));
      ++evals;
    }
  }
  EXPECT_EQ(steps, 12);
  EXPECT_EQ(evals, 2);
  std::ifstream sf(dir / "summary.json");
  auto s = nlohmann::json::parse(sf);
  EXPECT_EQ(s["mode"], "sync");
  EXPECT_EQ(s["quorum"], 3);
  EXPECT_EQ(s["straggler"], "shiftexp:2:10");
  EXPECT_EQ(s["budget"], "steps");
  // Every step averaged 3 gradients: each has an estimate, and the means are of them (the
  // target was reached at the first evaluation, after step 6).
  double all = 0, before = 0;
  for (size_t i = 0; i < r.steps.size(); ++i) {
    all += *r.steps[i].noise_scale;
    if (i < 6) before += *r.steps[i].noise_scale;
  }
  EXPECT_NEAR(s["noise_scale_mean"].get<double>(), all / 12, 1e-9 * std::abs(all));
  EXPECT_NEAR(s["noise_scale_to_target"].get<double>(), before / 6, 1e-9 * std::abs(before));
  ASSERT_TRUE(r.time_to_target_s.has_value());  // any model beats 5 % on 10 classes
  EXPECT_DOUBLE_EQ(s["time_to_target_s"].get<double>(), *r.time_to_target_s);
  EXPECT_DOUBLE_EQ(*r.time_to_target_s, r.evals[0].virtual_s);
  EXPECT_GT(s["step_p90_ms"].get<double>(), 0);
  EXPECT_GE(s["step_p90_ms"].get<double>(), s["step_p50_ms"].get<double>());
  EXPECT_TRUE(fs::exists(dir / "config.toml"));
  // arrivals.jsonl: every worker's arrival after the step's first, as qring-train writes it.
  std::ifstream af(dir / "arrivals.jsonl");
  const auto m = collectives::StragglerModel::parse("shiftexp:2:10");
  int lines = 0;
  while (std::getline(af, line)) {
    auto j = nlohmann::json::parse(line);
    ASSERT_EQ(j["step"], lines);
    auto off = j["ready_ms"].get<std::vector<double>>();
    ASSERT_EQ(off.size(), 4u);
    auto a = sim_arrivals(m, 3, 4, uint64_t(lines), 4.0);
    for (const auto& x : a) EXPECT_NEAR(off[size_t(x.rank)], x.ms - a[0].ms, 1e-9);
    ++lines;
  }
  EXPECT_EQ(lines, 12);
}

TEST(Sim, BadOptionsAreErrors) {
  const TrainConfig cfg = config();
  auto bad = [&](SimOptions o) { EXPECT_THROW(simulate(cfg, data(), o), ConfigError); };
  bad(sync_opts(0, 0));
  bad(sync_opts(4, 4));
  bad(sync_opts(4, -1));
  SimOptions a = sync_opts(4, 1);
  a.mode = SimMode::kAsync;
  bad(a);
  SimOptions n = sync_opts(4, 1);
  n.alpha_us = -1;
  bad(n);
  n = sync_opts(4, 1);
  n.beta_ns_per_byte = NAN;
  bad(n);
  n = sync_opts(4, 1);
  n.grace_ms = -1;
  bad(n);
  n = sync_opts(4, 0);
  n.mode = SimMode::kAsync;
  n.grace_ms = 2;
  bad(n);
  EXPECT_THROW(simulate(config({"straggler.model=shiftexp:1"}), data(), sync_opts(4, 0)),
               ConfigError);
}

}  // namespace
}  // namespace qring::train
