#include "collectives/auto_quorum.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace qring::collectives {

namespace {

struct Obs {
  double x;
  bool event;  // arrived at x; else censored there (not arrived by x)
};

// Kaplan-Meier survival of one offset distribution, then an exponential tail with mean theta
// beyond the largest observation.
class Survival {
 public:
  Survival(std::vector<Obs> obs, double theta_fallback) : theta_(theta_fallback) {
    std::sort(obs.begin(), obs.end(), [](const Obs& a, const Obs& b) {
      return a.x != b.x ? a.x < b.x : (a.event && !b.event);  // events first at ties
    });
    double s = 1, sum = 0;
    size_t at_risk = obs.size(), events = 0;
    for (size_t i = 0; i < obs.size();) {
      size_t j = i, d = 0;
      while (j < obs.size() && obs[j].x == obs[i].x) d += obs[j++].event ? 1 : 0;
      if (d > 0) {
        s *= 1.0 - double(d) / double(at_risk);
        km_.emplace_back(obs[i].x, s);
        sum += double(d) * obs[i].x;
        events += d;
      }
      at_risk -= j - i;
      i = j;
    }
    last_ = obs.empty() ? 0 : obs.back().x;
    s_last_ = s;
    if (events > 0 && sum > 0) theta_ = sum / double(events);
    theta_ = std::max(theta_, 1e-6);
  }
  double at(double x) const {
    if (x >= last_) return s_last_ * std::exp(-(x - last_) / theta_);
    auto it = std::upper_bound(km_.begin(), km_.end(), x,
                               [](double v, const std::pair<double, double>& p) { return v < p.first; });
    return it == km_.begin() ? 1.0 : std::prev(it)->second;
  }
  double horizon() const { return last_; }
  double theta() const { return theta_; }

 private:
  std::vector<std::pair<double, double>> km_;  // (x, survival just after x)
  double last_ = 0, s_last_ = 1, theta_;
};

// dist[j] = P(exactly j of independent events with probabilities p happened), j = 0..n.
void poisson_binomial(const std::vector<double>& p, std::vector<double>& dist) {
  const size_t n = p.size();
  dist.assign(n + 1, 0.0);
  dist[0] = 1;
  for (size_t r = 0; r < n; ++r) {
    for (size_t j = r + 1; j > 0; --j) dist[j] = dist[j] * (1 - p[r]) + dist[j - 1] * p[r];
    dist[0] *= 1 - p[r];
  }
}

// The count of the other events, one event of probability q divided out of dist (n + 1
// entries): out[j], j = 0..n-1. dist = out * (1 - q + q z); the recurrence runs from the end
// whose divisor is the larger, which keeps it stable.
void without_member(const std::vector<double>& dist, double q, std::vector<double>& out) {
  const size_t n = dist.size() - 1;
  out.assign(n, 0.0);
  if (n == 0) return;
  if (q <= 0.5) {
    const double inv = 1 / (1 - q);
    double prev = 0;
    for (size_t j = 0; j < n; ++j) prev = out[j] = std::max(0.0, (dist[j] - q * prev) * inv);
  } else {
    const double inv = 1 / q;
    double next = 0;
    for (size_t j = n; j > 0; --j)
      next = out[j - 1] = std::max(0.0, (dist[j] - (1 - q) * next) * inv);
  }
}

// below[k] = P(Bin(n, f) < k), k = 0..n (pmf by the recurrence in logs: n up to 65535).
void binomial_below(size_t n, double f, std::vector<double>& below) {
  below.assign(n + 1, 0.0);
  if (n == 0) return;
  if (f <= 0) {
    std::fill(below.begin() + 1, below.end(), 1.0);
    return;
  }
  if (f >= 1) return;
  const double lf = std::log(f), ls = std::log1p(-f);
  double lp = double(n) * ls, cdf = 0;
  for (size_t i = 0; i < n; ++i) {
    cdf += std::exp(lp);
    below[i + 1] = std::min(1.0, cdf);
    lp += std::log(double(n - i)) - std::log(double(i + 1)) + lf - ls;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

AutoQuorumChoice choose_quorum(const std::deque<StepArrivals>& window,
                               const std::vector<int>& members, int min, int max, double kappa) {
  AutoQuorumChoice c;
  const int n = std::max(1, int(members.size()));
  const int hi = max > 0 ? std::clamp(max, 1, n) : n;
  const int lo = std::min(std::clamp(min, 1, n), hi);
  // Nothing observed yet: the middle of [lo, hi]. It observes half the arrivals or more, and
  // the trust region lets later steps grow by a quarter at a time; waiting for every arrival
  // instead costs the slowest of n at once (N+b = 100 under lognormal delays: 0.19 s, 3.5 % of
  // the time to target).
  c.quorum = lo + (hi - lo + 1) / 2;

  // A step's offsets are measured from its first arrival, so one member is at 0 by
  // definition: the reference, not an observation. Each member's distribution is estimated
  // from the steps where another member was the reference, and T(k) is the (k-1)-th arrival
  // among the members other than the step's reference, weighted by how often each member was
  // the reference. (Counting the reference as an observation at 0 gives every member a point
  // mass at 0 and, the members taken as independent, puts E[T(1)] above 0: 1.5 ms of a 7 ms
  // cycle with 4 members under lognormal delays, enough to prefer 2 where 1 is faster.)
  std::vector<std::vector<Obs>> per(members.size());
  std::vector<Obs> pooled;
  std::vector<double> overheads, first(members.size(), 0.0);
  double event_sum = 0;
  size_t events = 0;             // observations after the reference
  bool any_arrival = false;      // the reference included
  std::vector<double> observed;  // per step of the window, the arrivals it observed
  for (const auto& s : window) {
    bool any = false, referenced = false;
    int arrived = 0;
    for (size_t i = 0; i < members.size(); ++i) {
      const size_t r = size_t(members[i]);
      if (r >= s.offset_ms.size() || s.offset_ms[r] == StepArrivals::kNotMember) continue;
      const double v = s.offset_ms[r];
      any = true;
      if (v >= 0) ++arrived;
      if (v == 0 && !referenced) {  // the first of the members at 0
        referenced = true;
        first[i] += 1;
        continue;
      }
      Obs o = v >= 0 ? Obs{v, true} : Obs{std::max(0.0, s.decided_ms), false};
      per[i].push_back(o);
      pooled.push_back(o);
      if (o.event) {
        event_sum += o.x;
        ++events;
      }
    }
    any_arrival = any_arrival || arrived > 0;
    if (any) observed.push_back(arrived);
    if (any && s.cycle_ms >= 0) overheads.push_back(std::max(0.0, s.cycle_ms - s.decided_ms));
  }
  if (n == 1 || !any_arrival || overheads.empty()) return c;
  // Every arrival observed at the first's instant (members that arrive together), or none
  // observed after it: the tails decay at once, and the choice is the largest the trust region
  // allows (which observes more).
  const double theta = std::max(events > 0 ? event_sum / double(events) : 0.0, 1e-6);

  // P(T(k) > x) = P(fewer than k - 1 of the reference's others arrived by x), integrated over
  // a grid: up to 256 quantiles of the observed offsets, then the exponential tails up to 20
  // theta beyond the last observation (each interval evaluated at its left end: survival is
  // non-increasing, so the estimate errs late, towards waiting less).
  const bool per_rank = n <= kPerRankMembers;
  std::vector<Survival> surv;
  double horizon = 0, theta_max = theta;
  if (per_rank) {
    for (auto& o : per) {
      surv.emplace_back(o, theta);
      horizon = std::max(horizon, surv.back().horizon());
      theta_max = std::max(theta_max, surv.back().theta());
    }
  } else {
    surv.emplace_back(pooled, theta);
    horizon = surv.back().horizon();
    theta_max = surv.back().theta();
  }
  std::vector<double> xs;
  for (const auto& o : pooled)
    if (o.event) xs.push_back(o.x);
  std::sort(xs.begin(), xs.end());
  std::vector<double> grid = {0.0};
  constexpr size_t kQuantiles = 256;
  for (size_t i = 1; i <= std::min(kQuantiles, xs.size()); ++i) {
    const double g = xs[i * xs.size() / std::min(kQuantiles, xs.size()) - 1];
    if (g > grid.back()) grid.push_back(g);
  }
  if (horizon > grid.back()) grid.push_back(horizon);
  constexpr int kTail = 120;  // steps of theta_max / 6 up to 20 theta_max
  const double base = grid.back();
  for (int i = 1; i <= kTail; ++i) grid.push_back(base + double(i) * theta_max / 6);

  // E[T(k)] = sum over the reference f of P(f first) times the integral of P(fewer than k - 1
  // of the others arrived by x); T(1) = 0. Per rank, the others' count is the members' count
  // with f's factor divided out: for each member that was a reference up to kExactReferences
  // members (O(n) each), above that once, with the references' mean probability (the members
  // other than one of many are nearly the same whichever it is). A decision stays O(grid n^2).
  double first_total = 0;
  for (double f : first) first_total += f;
  std::vector<double> weight(size_t(n), 1.0 / double(n));
  if (first_total > 0)
    for (int i = 0; i < n; ++i) weight[size_t(i)] = first[size_t(i)] / first_total;
  const bool exact = n <= kExactReferences;
  std::vector<double> e(size_t(n) + 1, 0.0), dist, below, others;
  std::vector<double> p(static_cast<size_t>(n));
  auto add_others = [&](double w, double width) {  // e[k] += w width P(others < k - 1)
    double below_k = 0;
    for (int k = 2; k <= n; ++k) {
      below_k = std::min(1.0, below_k + others[size_t(k) - 2]);
      e[size_t(k)] += w * width * below_k;
    }
  };
  for (size_t g = 0; g + 1 < grid.size(); ++g) {
    const double width = grid[g + 1] - grid[g];
    if (per_rank) {
      for (int i = 0; i < n; ++i) p[size_t(i)] = 1.0 - surv[size_t(i)].at(grid[g]);
      poisson_binomial(p, dist);
      if (exact) {
        for (int f = 0; f < n; ++f) {
          if (weight[size_t(f)] == 0) continue;
          without_member(dist, p[size_t(f)], others);
          add_others(weight[size_t(f)], width);
        }
      } else {
        double q = 0;
        for (int f = 0; f < n; ++f) q += weight[size_t(f)] * p[size_t(f)];
        without_member(dist, q, others);
        add_others(1.0, width);
      }
    } else {
      binomial_below(size_t(n) - 1, 1.0 - surv[0].at(grid[g]), below);
      for (int k = 2; k <= n; ++k) e[size_t(k)] += width * below[size_t(k) - 1];
    }
  }

  // The trust region: beyond the arrivals the window's steps observed, E[T(k)] rests on the
  // extrapolated tail, which forgets the slow arrivals once the steps that saw them leave the
  // window; the choice goes at most kExplore (at least one) beyond the median step's arrivals,
  // and so observes them. The median, not the most: one exploring step does not open the way
  // for the next to climb further.
  const int support = int(median(observed));
  const int cap =
      std::max(lo, std::min(hi, support + std::max(1, int(std::ceil(double(support) * kExplore)))));
  c.overhead_ms = median(overheads);
  c.expected_ms.assign(e.begin() + 1, e.end());
  c.rate.assign(size_t(n), 0.0);
  double best = -1;
  for (int k = 1; k <= n; ++k) {
    const double t = c.expected_ms[size_t(k) - 1] + c.overhead_ms;
    const double value = kappa > 0 ? double(k) / (1.0 + double(k) / kappa) : double(k);
    c.rate[size_t(k) - 1] = t > 0 ? value / t : std::numeric_limits<double>::infinity();
    // Ties go to the larger quorum (more gradients for the same rate).
    if (k >= lo && k <= cap && c.rate[size_t(k) - 1] >= best) {
      best = c.rate[size_t(k) - 1];
      c.quorum = k;
    }
  }
  return c;
}

void AutoQuorumWindow::decided(uint64_t step, StepArrivals s) {
  const double cycle = steps_.count(step) ? steps_[step].cycle_ms : -1;
  steps_[step] = std::move(s);
  steps_[step].cycle_ms = cycle;
  while (steps_.size() > kWindow) steps_.erase(steps_.begin());
}

void AutoQuorumWindow::late(uint64_t step, int rank, double offset_ms) {
  auto it = steps_.find(step);
  if (it == steps_.end() || rank < 0 || size_t(rank) >= it->second.offset_ms.size()) return;
  double& v = it->second.offset_ms[size_t(rank)];
  if (v == StepArrivals::kNotArrived) v = offset_ms;
}

void AutoQuorumWindow::opened(uint64_t step, double since_prev_first_ms) {
  if (step == 0) return;
  auto it = steps_.find(step - 1);
  if (it != steps_.end()) it->second.cycle_ms = since_prev_first_ms;
}

std::deque<StepArrivals> AutoQuorumWindow::samples() const {
  std::deque<StepArrivals> out;
  for (const auto& [t, s] : steps_) out.push_back(s);
  return out;
}

}  // namespace qring::collectives
