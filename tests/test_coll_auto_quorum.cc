// The adaptive quorum's rule (collectives/quorum/auto_quorum.h): a pure function of the window of
// recent arrivals, tested with synthetic arrivals; and the run's own estimate of the
// gradient-noise scale that values its steps (collectives/quorum/noise_scale.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "coll_harness.h"
#include "collectives/quorum/auto_quorum.h"
#include "collectives/quorum/noise_scale.h"
#include "collectives/quorum/quorum.h"
#include "collectives/quorum/coordinator.h"

namespace qring::collectives {
namespace {

std::vector<int> ranks(int n) {
  std::vector<int> r(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) r[size_t(i)] = i;
  return r;
}

// A step where every member arrived (offsets relative to the first), decided at the last
// arrival, and the next step's first arrival `overhead` after the decision.
StepArrivals full_step(std::vector<double> offsets, double overhead) {
  const double mn = *std::min_element(offsets.begin(), offsets.end());
  for (double& v : offsets) v -= mn;
  StepArrivals s;
  s.offset_ms = offsets;
  s.decided_ms = *std::max_element(offsets.begin(), offsets.end());
  s.cycle_ms = s.decided_ms + overhead;
  return s;
}

// The same step decided at its q-th arrival: later members are censored there.
StepArrivals cut_step(std::vector<double> offsets, int q, double overhead) {
  StepArrivals s = full_step(offsets, overhead);
  std::vector<double> sorted = s.offset_ms;
  std::sort(sorted.begin(), sorted.end());
  s.decided_ms = sorted[size_t(q) - 1];
  for (double& v : s.offset_ms)
    if (v > s.decided_ms) v = StepArrivals::kNotArrived;
  s.cycle_ms = s.decided_ms + overhead;
  return s;
}

// 400 steps where every member arrived 5 ms + an exponential of `mean` after the step began.
std::deque<StepArrivals> shifted_exponential_window(int n, double mean, double overhead) {
  std::mt19937 rng(7);
  std::exponential_distribution<double> ex(1.0 / mean);
  std::deque<StepArrivals> w;
  for (int t = 0; t < 400; ++t) {
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& x : v) x = 5 + ex(rng);
    w.push_back(full_step(v, overhead));
  }
  return w;
}

double harmonic(int n) {
  double h = 0;
  for (int i = 1; i <= n; ++i) h += 1.0 / i;
  return h;
}

// Without observations: the middle of [min, max], rounded up (not everyone: the slowest of
// many arrivals is the one step's cost that the trust region would take a while to win back).
TEST(AutoQuorum, WithoutObservationsItWaitsForTheMiddleOfItsBounds) {
  EXPECT_EQ(choose_quorum({}, ranks(8), 1, 0).quorum, 5);
  EXPECT_EQ(choose_quorum({}, ranks(8), 2, 6).quorum, 4);
  EXPECT_EQ(choose_quorum({}, ranks(100), 10, 0).quorum, 55);
  EXPECT_EQ(choose_quorum({}, ranks(4), 4, 0).quorum, 4);
  EXPECT_EQ(choose_quorum({}, ranks(1), 1, 0).quorum, 1);
  // Arrivals but no cycle measured yet (the next step has not opened): no overhead estimate.
  StepArrivals s = full_step({0, 1, 2, 30}, 5);
  s.cycle_ms = -1;
  EXPECT_EQ(choose_quorum({s}, ranks(4), 1, 0).quorum, 3);
}

TEST(AutoQuorum, MembersArrivingTogetherAreAllWaitedFor) {
  std::deque<StepArrivals> w;
  for (int t = 0; t < 20; ++t) w.push_back(full_step({0, 0.1, 0.2, 0.1, 0.0, 0.2}, 10));
  auto c = choose_quorum(w, ranks(6), 1, 0);
  EXPECT_EQ(c.quorum, 6);
  EXPECT_NEAR(c.overhead_ms, 10, 1e-9);
  ASSERT_EQ(c.expected_ms.size(), 6u);
  for (double e : c.expected_ms) EXPECT_LT(e, 0.5);
}

// One member 100 ms behind the others every step: the rule leaves it out, whether the window
// observed its arrivals or (backups) cut it off at the decision every step but one.
TEST(AutoQuorum, APersistentStragglerIsLeftOut) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> u(0, 2);
  auto offsets = [&] {
    std::vector<double> v(8);
    for (auto& x : v) x = u(rng);
    v[5] = 100 + u(rng);
    return v;
  };
  std::deque<StepArrivals> seen, cut;
  for (int t = 0; t < 32; ++t) {
    seen.push_back(full_step(offsets(), 10));
    cut.push_back(t == 7 ? full_step(offsets(), 10) : cut_step(offsets(), 7, 10));
  }
  auto a = choose_quorum(seen, ranks(8), 1, 0);
  EXPECT_EQ(a.quorum, 7);
  EXPECT_GT(a.expected_ms[7], 95);
  EXPECT_LT(a.expected_ms[6], 3);
  EXPECT_EQ(choose_quorum(cut, ranks(8), 1, 0).quorum, 7);
  // Bounds: max wins over the estimate, and so does min.
  EXPECT_EQ(choose_quorum(seen, ranks(8), 1, 6).quorum, 6);
  EXPECT_EQ(choose_quorum(seen, ranks(8), 8, 8).quorum, 8);
}

// Memoryless arrivals: after the first, the others are exponential, so the k-th offset has
// the closed form mean (H(n-1) - H(n-k)); the estimate follows it from the second arrival on
// (the first is the step's reference: T(1) = 0), and the choice is the argmax of k / (closed
// form + C).
TEST(AutoQuorum, ShiftedExponentialArrivalsFollowTheClosedForm) {
  const int n = 16;
  const double mean = 10, overhead = 20;
  const auto w = shifted_exponential_window(n, mean, overhead);
  auto c = choose_quorum(w, ranks(n), 1, 0);
  EXPECT_EQ(c.expected_ms[0], 0);
  int best = 1;
  double best_rate = 1 / overhead;
  for (int k = 2; k <= n; ++k) {
    const double closed = mean * (harmonic(n - 1) - harmonic(n - k));
    EXPECT_NEAR(c.expected_ms[size_t(k) - 1], closed, 0.06 * closed) << "k = " << k;
    if (k / (closed + overhead) >= best_rate) {
      best_rate = k / (closed + overhead);
      best = k;
    }
  }
  EXPECT_NEAR(c.quorum, best, 1);
}

// The same closed form where the rule no longer averages over every reference: at 100 members
// (one mean reference, per-member survival) and at 1000 (offsets pooled over the members, a
// binomial count over the n - 1 others), on the coordinator's window of kWindow steps, half of
// them cut off at a quorum of 80 %. The choice's rate is the closed form's best to 1 % (the optimum
// is flat at this size, so the rate is compared, not the index).
TEST(AutoQuorum, AtHundredsAndThousandsOfMembersTheEstimateFollowsTheClosedForm) {
  const double mean = 10, overhead = 20;
  for (int n : {100, 1000}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::exponential_distribution<double> ex(1.0 / mean);
    std::deque<StepArrivals> w;
    for (size_t t = 0; t < AutoQuorumWindow::kWindow; ++t) {
      std::vector<double> v(static_cast<size_t>(n));
      for (auto& x : v) x = 5 + ex(rng);
      // Every other step decided at its 80 % arrival, as a quorum does: the rest censored.
      w.push_back(t % 2 ? full_step(v, overhead) : cut_step(v, 8 * n / 10, overhead));
    }
    const auto c = choose_quorum(w, ranks(n), 1, 0);
    ASSERT_EQ(c.expected_ms.size(), size_t(n));
    EXPECT_EQ(c.expected_ms[0], 0) << n << " members";
    // The integral runs over up to 256 quantiles of the offsets, each interval at its left end
    // (erring late): a grid step, the 1/256 quantile of the exponential, bounds the error of
    // the first arrivals, whose T(k) is below it at 1000 members.
    const double grid_step = -mean * std::log1p(-1.0 / 256);
    for (int k : {2, n / 10, n / 2, 9 * n / 10}) {
      const double closed = mean * (harmonic(n - 1) - harmonic(n - k));
      EXPECT_NEAR(c.expected_ms[size_t(k) - 1], closed, 0.08 * closed + grid_step)
          << n << " members, k = " << k;
    }
    double best_rate = 0;
    for (int k = 1; k <= n; ++k)
      best_rate = std::max(best_rate, k / (mean * (harmonic(n - 1) - harmonic(n - k)) + overhead));
    const int q = c.quorum;
    const double chosen = q / (mean * (harmonic(n - 1) - harmonic(n - q)) + overhead);
    EXPECT_GE(chosen, 0.99 * best_rate) << n << " members: chose " << q;
  }
}

// A step's offsets are measured from its first arrival: one member is at 0 in every step, the
// reference, not an observation. Counted as one, it gives every member a point mass at 0, and
// with the members independent E[T(1)] comes out above 0 (1.5 ms here, against a 7 ms cycle)
// while E[T(2)] does not grow with it: with 4 members under lognormal delays (the real runs'
// 2.7, 1.0) that rule took 2 where 1 is faster. The estimate follows the order statistics of
// the steps themselves, and the choice is the argmax they give, for cycles that favour 1, 2 and
// 3 (value k / (1 + k / kappa), kappa = 100 / 32: the real runs' noise scale over their batch).
TEST(AutoQuorum, TheFirstArrivalIsTheReferenceNotAnObservation) {
  const int n = 4;
  const double kappa = 100.0 / 32;
  std::mt19937 rng(17);
  std::lognormal_distribution<double> ln(2.7, 1.0);
  std::vector<double> mean_kth(static_cast<size_t>(n), 0.0);
  const int steps = 4000;
  std::deque<StepArrivals> w;
  for (int t = 0; t < steps; ++t) {
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& x : v) x = ln(rng);
    w.push_back(full_step(v, 0));
    std::vector<double> sorted = w.back().offset_ms;
    std::sort(sorted.begin(), sorted.end());
    for (int k = 0; k < n; ++k) mean_kth[size_t(k)] += sorted[size_t(k)] / steps;
  }
  for (double overhead : {4.0, 7.0, 20.0, 60.0}) {
    for (auto& s : w) s.cycle_ms = s.decided_ms + overhead;
    const auto c = choose_quorum(w, ranks(n), 1, 0, kappa);
    EXPECT_EQ(c.expected_ms[0], 0);
    int best = 0;
    double best_rate = 0;
    for (int k = 1; k <= n; ++k) {
      if (k < n) {  // the last: the lognormal's tail beyond the observations is extrapolated
        EXPECT_NEAR(c.expected_ms[size_t(k) - 1], mean_kth[size_t(k) - 1],
                    0.03 * mean_kth[size_t(k) - 1] + 1e-9)
            << "k = " << k;
      }
      const double rate = k / (1 + k / kappa) / (mean_kth[size_t(k) - 1] + overhead);
      if (rate > best_rate) {
        best_rate = rate;
        best = k;
      }
    }
    EXPECT_EQ(c.quorum, best) << "cycle beyond the decision " << overhead << " ms";
  }
  // The 7 ms cycle of the real runs' Q = 1 (4000 gradients in 27.4 s): 1, not 2.
  for (auto& s : w) s.cycle_ms = s.decided_ms + 7;
  EXPECT_EQ(choose_quorum(w, ranks(n), 1, 0, kappa).quorum, 1);
}

// With a gradient-noise scale kappa (in contributions), a step of k is worth k / (1 + k /
// kappa): the rule maximizes that over E[T(k)] + C, and picks a smaller quorum than the
// linear value on the same window; kappa 0 is the linear value, and a huge kappa agrees with it.
TEST(AutoQuorum, ANoiseScaleValuesLargeStepsLessAndPicksASmallerQuorum) {
  const int n = 16;
  const auto w = shifted_exponential_window(n, 10, 20);
  const auto linear = choose_quorum(w, ranks(n), 1, 0);
  EXPECT_EQ(choose_quorum(w, ranks(n), 1, 0, 0).quorum, linear.quorum);
  EXPECT_EQ(choose_quorum(w, ranks(n), 1, 0, 1e12).quorum, linear.quorum);
  const double kappa = 4;
  const auto c = choose_quorum(w, ranks(n), 1, 0, kappa);
  ASSERT_EQ(c.expected_ms, linear.expected_ms);  // the same estimate of the arrivals
  int best = 0;
  for (int k = 1; k <= n; ++k) {
    const double t = c.expected_ms[size_t(k) - 1] + c.overhead_ms;
    EXPECT_NEAR(c.rate[size_t(k) - 1], k / (1 + k / kappa) / t, 1e-12) << "k = " << k;
    if (best == 0 || c.rate[size_t(k) - 1] >= c.rate[size_t(best) - 1]) best = k;
  }
  EXPECT_EQ(c.quorum, best);
  EXPECT_LT(c.quorum, linear.quorum);
  // The bounds still hold.
  EXPECT_EQ(choose_quorum(w, ranks(n), c.quorum + 2, 0, kappa).quorum, c.quorum + 2);
}

// Contributions cut off at the decision are censored, not dropped: the estimate of the last
// arrival lies beyond every offset observed, where a rule that ignored them would see the
// cut-off arrivals as no later than the decision.
TEST(AutoQuorum, CutOffContributionsAreCensoredNotDropped) {
  const int n = 20;
  std::mt19937 rng(3);
  std::lognormal_distribution<double> ln(2.0, 1.0);
  std::deque<StepArrivals> w;
  double max_seen = 0;
  for (int t = 0; t < 32; ++t) {
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& x : v) x = ln(rng);
    w.push_back(cut_step(v, 10, 5));
    for (double x : w.back().offset_ms) max_seen = std::max(max_seen, x);
  }
  auto c = choose_quorum(w, ranks(n), 1, 0);
  EXPECT_GT(c.expected_ms[size_t(n) - 1], max_seen);
  for (int k = 2; k <= n; ++k) EXPECT_GE(c.expected_ms[size_t(k) - 1], c.expected_ms[size_t(k) - 2]);
}

// The trust region: beyond what the window observed, E[T(k)] is the extrapolated tail. Steps
// cut at the 8th of 40 arrivals, members alike and close together: the tail extrapolated
// from the 8 observed says the 32 cut off arrive at once, and the rule would wait for all 40;
// it goes at most a quarter beyond the median step's 8 observed (10). One step that
// observed all 40 (the exploration) does not move the median, so the next choice does not
// climb further; a window that observed all 40 in most steps allows them all.
TEST(AutoQuorum, AChoiceGoesAtMostAQuarterBeyondTheArrivalsObserved) {
  const int n = 40;
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0, 1);
  auto offsets = [&] {
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& x : v) x = u(rng);
    return v;
  };
  std::deque<StepArrivals> w;
  for (int t = 0; t < 32; ++t) w.push_back(cut_step(offsets(), 8, 20));
  auto c = choose_quorum(w, ranks(n), 1, 0);
  EXPECT_EQ(c.quorum, 10);
  // Without the region the rate would be best at a larger quorum (the extrapolated tail).
  const auto best = std::max_element(c.rate.begin(), c.rate.end()) - c.rate.begin() + 1;
  EXPECT_GT(best, 10);
  // One exploring step that observed all 40 leaves the median (and the choice) where it was.
  w.pop_front();
  w.push_back(full_step(offsets(), 20));
  EXPECT_EQ(choose_quorum(w, ranks(n), 1, 0).quorum, 10);
  // Small quorums still grow by one; the bounds win over the region.
  std::deque<StepArrivals> small;
  for (int t = 0; t < 32; ++t) small.push_back(cut_step(offsets(), 2, 20));
  EXPECT_EQ(choose_quorum(small, ranks(n), 1, 0).quorum, 3);
  EXPECT_EQ(choose_quorum(small, ranks(n), 20, 0).quorum, 20);
  // Most steps observed everyone: no limit below the world.
  std::deque<StepArrivals> seen;
  for (int t = 0; t < 32; ++t)
    seen.push_back(t % 3 ? full_step(offsets(), 20) : cut_step(offsets(), 8, 20));
  EXPECT_EQ(choose_quorum(seen, ranks(n), 1, 0).quorum, n);
}

// One member turns 5x slower: once the window holds the new regime, it is left out.
TEST(AutoQuorum, ARegimeChangeIsFollowed) {
  const int n = 8;
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0, 4);
  AutoQuorumWindow win;
  std::vector<int> chosen;
  for (uint64_t t = 0; t < 96; ++t) {
    auto c = choose_quorum(win.samples(), ranks(n), 1, 0);
    chosen.push_back(c.quorum);
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& x : v) x = 10 + u(rng);
    if (t >= 48) v[2] *= 5;  // rank 2: 5x slower from step 48 on
    StepArrivals s = cut_step(v, c.quorum, 10);
    win.decided(t, s);
    // The next step opens `cycle` after this one's first arrival.
    win.opened(t + 1, s.cycle_ms);
  }
  EXPECT_EQ(chosen[40], n);       // members alike: wait for all
  EXPECT_EQ(chosen[95], n - 1);   // the slow one is left out
  int left_out = 0;
  for (size_t t = 64; t < 96; ++t) left_out += chosen[t] == n - 1;
  EXPECT_GE(left_out, 28);  // a few steps try it again (its survival beyond the cut decays)
}

TEST(AutoQuorum, WindowKeepsTheLastStepsLateArrivalsAndCycles) {
  AutoQuorumWindow w;
  for (uint64_t t = 0; t < 40; ++t) {
    StepArrivals s;
    s.offset_ms = {0, 1, StepArrivals::kNotArrived, StepArrivals::kNotMember};
    s.decided_ms = 1;
    w.decided(t, s);
  }
  auto all = w.samples();
  ASSERT_EQ(all.size(), AutoQuorumWindow::kWindow);
  w.late(39, 2, 7.5);
  w.late(39, 3, 9);   // not a member: stays out
  w.late(2, 2, 5);    // no longer in the window: ignored
  w.opened(40, 12);
  auto last = w.samples().back();
  EXPECT_EQ(last.offset_ms[2], 7.5);
  EXPECT_EQ(last.offset_ms[3], StepArrivals::kNotMember);
  EXPECT_EQ(last.cycle_ms, 12);
  EXPECT_EQ(w.samples().front().cycle_ms, -1);
}

// The coordinator (pure state machine) with quorum "auto": the first step (no observations)
// waits for the middle of [1, 4], 3; rank 3, never seen, is tried once (its estimate says
// "soon"), and later steps leave out the rank that is always 100 ms behind (once its one
// observation leaves the window, one step tries it again); every DECIDE names the quorum it
// was decided with.
TEST(AutoQuorum, CoordinatorChoosesEachStepsQuorumAndDecideCarriesIt) {
  using namespace qproto;
  Config cfg;
  cfg.world = 4;
  cfg.quorum = 1;  // the lower bound
  cfg.adaptive = true;
  cfg.count = 8;
  cfg.evict = std::chrono::milliseconds(60000);
  cfg.deadline = std::chrono::milliseconds(60000);
  Time now = Time{} + std::chrono::hours(1);
  Coordinator c(cfg, now);
  auto ready = [&](int r, uint64_t t) {
    Event e;
    e.kind = Event::Kind::kReady;
    e.from = r;
    e.step = t;
    e.count = 8;
    return c.handle(e, now);
  };
  auto tick = [&] { return c.handle(Event{}, now); };
  std::vector<int> quorums;
  std::vector<std::vector<int>> contributors;
  auto collect = [&](const std::vector<Down>& acts) {
    for (const auto& a : acts)
      if (a.kind == Down::Kind::kDecide) {
        quorums.push_back(a.decide.quorum);
        contributors.push_back(a.decide.contributors);
      }
  };
  for (uint64_t t = 0; t < 40; ++t) {
    size_t before = quorums.size();
    for (int r : {0, 1, 2}) {
      collect(ready(r, t));
      now += std::chrono::milliseconds(1);
    }
    collect(tick());
    if (quorums.size() == before) {  // waiting for rank 3: it comes 100 ms later
      now += std::chrono::milliseconds(100);
      collect(ready(3, t));
      collect(tick());
    }  // else rank 3, left out, abandons its step (qring-train's drop policy): no READY
    ASSERT_EQ(quorums.size(), before + 1) << "step " << t;
    now += std::chrono::milliseconds(10);  // the rest of the cycle
  }
  EXPECT_EQ(quorums.front(), 3);
  EXPECT_EQ(contributors.front(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(std::count(quorums.begin(), quorums.begin() + 5, 4), 1);
  EXPECT_EQ(quorums.back(), 3);
  EXPECT_EQ(contributors.back(), (std::vector<int>{0, 1, 2}));
  int three = 0;
  for (size_t t = 20; t < quorums.size(); ++t) three += quorums[t] == 3;
  EXPECT_GE(three, 18);
}

// quorum "auto" with the noise scale estimated in the run: the contributors' squared norms
// travel with READY, the previous step's result's with the next READY. Contributions of
// per-contribution variance V around a gradient of norm 1 (|g_i|^2 = 1 + V, |mean|^2 = 1 + V /
// n) give the estimate V whatever n is; a coordinator given them values steps with it (V = 2:
// a smaller quorum than the linear value's), and one given no norms keeps its configured
// value; both choose alike until the first estimate.
TEST(AutoQuorum, CoordinatorEstimatesTheNoiseScaleFromTheNormsReadyCarries) {
  using namespace qproto;
  const int W = 8;
  const double V = 2;
  Config cfg;
  cfg.world = W;
  cfg.quorum = 1;
  cfg.adaptive = true;
  cfg.count = 8;
  cfg.evict = std::chrono::milliseconds(60000);
  cfg.deadline = std::chrono::milliseconds(60000);
  auto run = [&](bool estimate, bool send_norms, std::optional<double>* est) {
    Config c = cfg;
    c.auto_estimate = estimate;
    Time now = Time{} + std::chrono::hours(1);
    Coordinator co(c, now);
    std::vector<int> quorums;
    int prev_n = 0;
    for (uint64_t t = 0; t < 30; ++t) {
      std::optional<Decision> d;
      for (int r = 0; r < W && !d; ++r) {  // rank r arrives r ms after the first
        Event e;
        e.kind = Event::Kind::kReady;
        e.from = r;
        e.step = t;
        e.count = 8;
        if (send_norms) {
          e.grad_sq = 1 + V;
          if (t > 0) e.prev_mean_sq = 1 + V / prev_n;
        }
        for (const auto& a : co.handle(e, now))
          if (a.kind == Down::Kind::kDecide) d = a.decide;
        if (!d) now += std::chrono::milliseconds(1);
      }
      EXPECT_TRUE(d) << "step " << t;
      if (!d) return quorums;
      quorums.push_back(d->quorum);
      prev_n = int(d->contributors.size());
      now += std::chrono::milliseconds(10);  // the reduction, the update, the next gradient
    }
    *est = co.noise_scale();
    return quorums;
  };
  std::optional<double> est, none, silent;
  const auto estimated = run(true, true, &est);
  const auto linear = run(false, true, &none);
  const auto no_norms = run(true, false, &silent);
  ASSERT_TRUE(est);
  EXPECT_NEAR(*est, V, 1e-9);
  EXPECT_FALSE(none);    // not estimating: the norms are ignored
  EXPECT_FALSE(silent);  // estimating without norms: nothing to go on
  EXPECT_EQ(no_norms, linear);
  ASSERT_EQ(estimated.size(), 30u);
  // Step 0 is chosen before any estimate; step 1's first READY brings step 0's result norm,
  // and its quorum already uses it.
  EXPECT_EQ(estimated[0], linear[0]);
  for (size_t t = 10; t < 30; ++t) {
    EXPECT_LT(estimated[t], linear[t]) << "step " << t;
    // The value of k with the noise scale V: k / (1 + k / V) saturates at V; the rule picks
    // a quorum of a few where the linear value waits for (nearly) every rank.
    EXPECT_LE(estimated[t], 5) << "step " << t;
  }
  EXPECT_GE(linear.back(), 7);
}

// The quorum all-reduce with quorum "auto" over the in-process endpoint: every rank gets the
// same contributor set and the same Q(t) every step, |S(t)| >= Q(t), and the bit-exact sum of
// exactly S(t)'s contributions; rank 2 is slow every step and ends up left out.
TEST(AutoQuorum, QuorumAllreduceKeepsItsContractUnderAuto) {
  using testing::run_ranks;
  const int W = 4, steps = 40;
  const size_t count = 64;
  std::mutex mu;
  std::vector<std::vector<std::pair<std::vector<uint8_t>, int>>> seen(static_cast<size_t>(W));
  std::atomic<int> wrong{0};
  CommOptions co;
  co.timeout = std::chrono::seconds(20);
  run_ranks(W, co, [&](Communicator& comm) {
    QuorumOptions qo;
    qo.quorum = 1;
    qo.adaptive = true;
    qo.deadline = std::chrono::milliseconds(10000);
    QuorumAllreduce q(comm, count, qo);
    std::vector<float> buf(count);
    for (int t = 0; t < steps; ++t) {
      for (size_t j = 0; j < count; ++j) buf[j] = float((j + 1) * (comm.rank() + 1) + t);
      // Rank 2 is 30 ms late every step (abandoning as soon as it is left out).
      if (comm.rank() == 2) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(30);
        while (std::chrono::steady_clock::now() < until && !q.excluded(uint64_t(t)))
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!q.excluded(uint64_t(t))) q.contribute(uint64_t(t), buf.data(), count);
      QuorumResult r = q.wait(uint64_t(t), buf.data());
      EXPECT_GE(r.count, r.quorum);
      EXPECT_GE(r.quorum, 1);
      for (size_t j = 0; j < count; ++j) {
        double want = 0;
        for (int p = 0; p < W; ++p)
          if (r.contains(p)) want += double((j + 1) * (p + 1) + t);
        if (double(buf[j]) != want / r.count && double(buf[j]) != float(want / r.count)) ++wrong;
      }
      std::lock_guard<std::mutex> lock(mu);
      seen[size_t(comm.rank())].emplace_back(r.contributors, r.quorum);
    }
  });
  EXPECT_EQ(wrong.load(), 0);
  for (int r = 1; r < W; ++r) EXPECT_EQ(seen[size_t(r)], seen[0]) << "rank " << r;
  EXPECT_EQ(seen[0].front().second, 3);  // the first step: the middle of [1, W]
  int without2 = 0;
  for (int t = steps / 2; t < steps; ++t)
    without2 += (seen[0][size_t(t)].first[0] >> 2 & 1) == 0;
  EXPECT_GE(without2, steps / 2 - 3);
}

// The two-batch estimate of the gradient-noise scale: gradients g_i = G + noise of variance
// sigma^2 / b per coordinate (a batch of b samples, each of variance sigma^2), P coordinates:
// B_simple = tr(S) / |G|^2 = P sigma^2 / |G|^2 samples, P sigma^2 / (b |G|^2) contributions,
// whatever N and b are.
TEST(NoiseScale, EstimateRecoversTraceOverGradientNorm) {
  const size_t P = 2000;
  const double sigma2 = 0.25, g_norm2 = 1.0;
  const double expect = double(P) * sigma2 / g_norm2;  // 500 samples
  std::mt19937 rng(11);
  for (auto [n, b] : {std::pair{8, 16}, std::pair{32, 4}}) {
    NoiseScaleEstimate est(0.05);
    EXPECT_FALSE(est.value().has_value());
    std::normal_distribution<double> noise(0, std::sqrt(sigma2 / b));
    std::vector<double> G(P, std::sqrt(g_norm2 / double(P))), mean(P);
    for (int step = 0; step < 400; ++step) {
      std::fill(mean.begin(), mean.end(), 0.0);
      double sq = 0;
      for (int i = 0; i < n; ++i) {
        for (size_t p = 0; p < P; ++p) {
          const double g = G[p] + noise(rng);
          sq += g * g;
          mean[p] += g / n;
        }
      }
      double msq = 0;
      for (double m : mean) msq += m * m;
      est.add(n, sq / n, msq);
    }
    ASSERT_TRUE(est.value().has_value());
    EXPECT_NEAR(*est.value() * b, expect, 0.1 * expect) << "N " << n << " b " << b;
  }
  // A step of one gradient says nothing about the noise.
  NoiseScaleEstimate one;
  one.add(1, 2.0, 2.0);
  EXPECT_FALSE(one.value().has_value());
  one.add(4, std::nan(""), 1.0);  // nor does a norm that is not a number
  one.add(4, 1.0, -1.0);
  EXPECT_FALSE(one.value().has_value());
}

}  // namespace
}  // namespace qring::collectives
