#include "collectives/quorum/auto_quorum.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace qring::collectives {

namespace {

struct Obs {
  double x;
  bool event;  // arrived at x; else censored there (not arrived by x)
};

// The Kaplan-Meier order: by offset, events before censorings at a tie.
bool before(const Obs& a, const Obs& b) {
  return a.x != b.x ? a.x < b.x : (a.event && !b.event);
}

// Kaplan-Meier survival of one offset distribution (its observations sorted by `before`), read
// at the points of a grid, then an exponential tail with mean theta beyond the largest
// observation. The curve is kept at the grid's points only: they are all a decision reads, and
// at 1000 pooled members the whole curve would be 32 000 points built and dropped per decision.
class Survival {
 public:
  Survival(const std::vector<Obs>& obs, double theta_fallback, const std::vector<double>& grid)
      : theta_(theta_fallback) {
    at_grid_.reserve(grid.size());
    double s = 1, sum = 0;
    size_t at_risk = obs.size(), events = 0, g = 0;
    for (size_t i = 0; i < obs.size();) {
      // The grid's points before this offset: the survival after the offsets up to them.
      for (; g < grid.size() && grid[g] < obs[i].x; ++g) at_grid_.push_back(s);
      size_t j = i, d = 0;
      while (j < obs.size() && obs[j].x == obs[i].x) d += obs[j++].event ? 1 : 0;
      if (d > 0) {
        s *= 1.0 - double(d) / double(at_risk);
        sum += double(d) * obs[i].x;
        events += d;
      }
      at_risk -= j - i;
      i = j;
    }
    for (; g < grid.size(); ++g) at_grid_.push_back(s);
    last_ = obs.empty() ? 0 : obs.back().x;
    s_last_ = s;
    if (events > 0 && sum > 0) theta_ = sum / double(events);
    theta_ = std::max(theta_, 1e-6);
  }
  // The survival at x, the g-th point of the grid (or, past the grid given, beyond the last
  // observation).
  double at(size_t g, double x) const {
    if (x >= last_) return s_last_ * std::exp(-(x - last_) / theta_);
    return g < at_grid_.size() ? at_grid_[g] : s_last_;
  }
  double horizon() const { return last_; }
  double theta() const { return theta_; }

 private:
  std::vector<double> at_grid_;  // survival at the grid's points, after the offsets up to each
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

// P(Bin(n, f) < k) where it is neither 0 nor 1: 0 for k <= lo, cdf[k - lo - 1] for lo < k <=
// lo + cdf.size(), 1 beyond. The pmf from its mode outwards by the ratio of successive terms, up
// to terms below 1e-17: O(sqrt(n f (1 - f))) per call, where a pass over all n + 1 terms with
// three logarithms each was half of a decision's time at 1000 pooled members.
struct BinomialBelow {
  size_t lo = 0;
  std::vector<double> cdf;
};

void binomial_below(size_t n, double f, BinomialBelow& out) {
  out.cdf.clear();
  if (n == 0 || f <= 0) {  // no event: below is 1 from k = 1
    out.lo = 0;
    return;
  }
  if (f >= 1) {  // every event: below is 0 up to k = n
    out.lo = n;
    return;
  }
  constexpr double kNegligible = 1e-17;
  const double odds = f / (1 - f);
  const size_t mode = std::min(n, size_t(double(n + 1) * f));
  const double at_mode = std::exp(std::lgamma(double(n) + 1) - std::lgamma(double(mode) + 1) -
                                  std::lgamma(double(n - mode) + 1) + double(mode) * std::log(f) +
                                  double(n - mode) * std::log1p(-f));
  // The pmf into out.cdf: downwards from the mode (pmf[i - 1] = pmf[i] i / ((n - i + 1) odds)),
  // stored reversed, then upwards; then summed in place.
  std::vector<double>& pmf = out.cdf;
  double t = at_mode;
  size_t first = mode;
  for (size_t i = mode; i > 0;) {
    t *= double(i) / (double(n - i + 1) * odds);
    if (t < kNegligible) break;
    --i;
    pmf.push_back(t);
    first = i;
  }
  std::reverse(pmf.begin(), pmf.end());
  pmf.push_back(t = at_mode);
  for (size_t i = mode; i < n;) {
    t *= double(n - i) * odds / double(i + 1);
    if (t < kNegligible) break;
    ++i;
    pmf.push_back(t);
  }
  // below(k) = the sum of pmf[first .. k - 1]: 0 up to k = first, 1 from first + size on.
  out.lo = first;
  double cdf = 0;
  for (double& v : pmf) v = std::min(1.0, cdf += v);
  pmf.pop_back();  // below(first + size) is the whole sum: 1
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Phase 1: what the window observed of the members' arrivals.
struct Observations {
  bool per_rank = false;
  std::vector<std::vector<Obs>> per;  // per member (per_rank)
  std::vector<Obs> pooled;            // every member's, pooled
  std::vector<double> overheads;      // per step: the cycle beyond the decision
  std::vector<double> first;          // per member: the steps it was the reference of
  double event_sum = 0;
  size_t events = 0;             // observations after the reference
  bool any_arrival = false;      // the reference included
  std::vector<double> observed;  // per step of the window, the arrivals it observed
};

// A step's offsets are measured from its first arrival, so one member is at 0 by definition:
// the reference, not an observation. Each member's distribution is estimated from the steps
// where another member was the reference, and T(k) is the (k-1)-th arrival among the members
// other than the step's reference, weighted by how often each member was the reference.
// (Counting the reference as an observation at 0 gives every member a point mass at 0 and, the
// members taken as independent, puts E[T(1)] above 0: 1.5 ms of a 7 ms cycle with 4 members
// under lognormal delays, enough to prefer 2 where 1 is faster.) Up to kPerRankMembers
// members, each member's own distribution; above, one pooled over them.
Observations observe(const std::deque<StepArrivals>& window, const std::vector<int>& members) {
  Observations ob;
  ob.per_rank = int(members.size()) <= kPerRankMembers;
  ob.per.resize(ob.per_rank ? members.size() : 0);
  ob.pooled.reserve(window.size() * members.size());
  for (auto& o : ob.per) o.reserve(window.size());
  ob.first.assign(members.size(), 0.0);
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
        ob.first[i] += 1;
        continue;
      }
      Obs o = v >= 0 ? Obs{v, true} : Obs{std::max(0.0, s.decided_ms), false};
      if (ob.per_rank) ob.per[i].push_back(o);
      ob.pooled.push_back(o);
      if (o.event) {
        ob.event_sum += o.x;
        ++ob.events;
      }
    }
    ob.any_arrival = ob.any_arrival || arrived > 0;
    if (any) ob.observed.push_back(arrived);
    if (any && s.cycle_ms >= 0) ob.overheads.push_back(std::max(0.0, s.cycle_ms - s.decided_ms));
  }
  return ob;
}

// Phase 2: the arrival distributions on a grid. Up to 256 quantiles of the observed offsets,
// then the exponential tails up to 20 theta beyond the last observation (each interval is
// evaluated at its left end: survival is non-increasing, so the estimate errs late, towards
// waiting less). The pooled offsets are sorted once (at 1000 members, 32 000 of them: the
// larger part of a decision's cost); the quantiles are the events' in that order: the i-th of
// nq the event i * events / nq.
struct Distributions {
  std::vector<double> grid;
  std::vector<Survival> surv;  // per member, or one pooled
};

Distributions distributions(Observations& ob, double theta) {
  Distributions d;
  std::sort(ob.pooled.begin(), ob.pooled.end(), before);
  d.grid = {0.0};
  constexpr size_t kQuantiles = 256;
  const size_t nq = std::min(kQuantiles, ob.events);
  size_t seen = 0, next = 1;
  for (const auto& o : ob.pooled) {
    if (!o.event) continue;
    ++seen;
    for (; next <= nq && next * ob.events / nq == seen; ++next)
      if (o.x > d.grid.back()) d.grid.push_back(o.x);
  }
  double horizon = 0, theta_max = theta;
  if (ob.per_rank) {
    for (auto& o : ob.per) {
      std::sort(o.begin(), o.end(), before);
      d.surv.emplace_back(o, theta, d.grid);
      horizon = std::max(horizon, d.surv.back().horizon());
      theta_max = std::max(theta_max, d.surv.back().theta());
    }
  } else {
    d.surv.emplace_back(ob.pooled, theta, d.grid);
    horizon = d.surv.back().horizon();
    theta_max = d.surv.back().theta();
  }
  if (horizon > d.grid.back()) d.grid.push_back(horizon);
  constexpr int kTail = 120;  // steps of theta_max / 6 up to 20 theta_max
  const double base = d.grid.back();
  for (int i = 1; i <= kTail; ++i) d.grid.push_back(base + double(i) * theta_max / 6);
  return d;
}

// Phase 3: E[T(k)], k = 0..n (e[0], e[1] = 0). E[T(k)] = sum over the reference f of P(f
// first) times the integral of P(fewer than k - 1 of the others arrived by x). Per rank, the
// others' count is the members' count with f's factor divided out: for each member that was a
// reference up to kExactReferences members (O(n) each), above that once, with the references'
// mean probability (the members other than one of many are nearly the same whichever it is):
// O(grid n^2) a decision. Pooled, a binomial count of the n - 1 others: O(grid sqrt(n)) after
// the sort of the offsets.
std::vector<double> expected_arrivals(const Observations& ob, const Distributions& d, int n) {
  double first_total = 0;
  for (double f : ob.first) first_total += f;
  std::vector<double> weight(size_t(n), 1.0 / double(n));
  if (first_total > 0)
    for (int i = 0; i < n; ++i) weight[size_t(i)] = ob.first[size_t(i)] / first_total;
  const bool exact = n <= kExactReferences;
  std::vector<double> e(size_t(n) + 1, 0.0), dist, others;
  std::vector<double> ones(size_t(n) + 2, 0.0);  // pooled: e[k] += ones[2..k] (P(others < k-1) = 1)
  BinomialBelow below;
  std::vector<double> p(static_cast<size_t>(n));
  auto add_others = [&](double w, double width) {  // e[k] += w width P(others < k - 1)
    double below_k = 0;
    for (int k = 2; k <= n; ++k) {
      below_k = std::min(1.0, below_k + others[size_t(k) - 2]);
      e[size_t(k)] += w * width * below_k;
    }
  };
  const auto& grid = d.grid;
  for (size_t g = 0; g + 1 < grid.size(); ++g) {
    const double width = grid[g + 1] - grid[g];
    if (ob.per_rank) {
      for (int i = 0; i < n; ++i) p[size_t(i)] = 1.0 - d.surv[size_t(i)].at(g, grid[g]);
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
      // e[k] += width P(Bin(n - 1, f) < k - 1): the cdf where it is between 0 and 1, and from
      // where it is 1 on, once in `ones`.
      binomial_below(size_t(n) - 1, 1.0 - d.surv[0].at(g, grid[g]), below);
      const size_t from = below.lo + 2, ones_from = from + below.cdf.size();
      for (size_t k = std::max<size_t>(2, from); k < ones_from && k <= size_t(n); ++k)
        e[k] += width * below.cdf[k - from];
      ones[std::max<size_t>(2, std::min(ones_from, size_t(n) + 1))] += width;
    }
  }
  if (!ob.per_rank) {
    double run = 0;
    for (int k = 2; k <= n; ++k) {
      run += ones[size_t(k)];
      e[size_t(k)] += run;
    }
  }
  return e;
}

// Phase 4: the rate of each k and the choice. The trust region: beyond the arrivals the
// window's steps observed, E[T(k)] rests on the extrapolated tail, which forgets the slow
// arrivals once the steps that saw them leave the window; the choice goes at most kExplore (at
// least one) beyond the median step's arrivals, and so observes them. The median, not the
// most: one exploring step does not open the way for the next to climb further.
void choose(const Observations& ob, const std::vector<double>& e, int n, int lo, int hi,
            double kappa, AutoQuorumChoice& c) {
  const int support = int(median(ob.observed));
  const int cap =
      std::max(lo, std::min(hi, support + std::max(1, int(std::ceil(double(support) * kExplore)))));
  c.overhead_ms = median(ob.overheads);
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
  Observations ob = observe(window, members);
  if (n == 1 || !ob.any_arrival || ob.overheads.empty()) return c;
  // Every arrival observed at the first's instant (members that arrive together), or none
  // observed after it: the tails decay at once, and the choice is the largest the trust region
  // allows (which observes more).
  const double theta = std::max(ob.events > 0 ? ob.event_sum / double(ob.events) : 0.0, 1e-6);
  const Distributions d = distributions(ob, theta);
  choose(ob, expected_arrivals(ob, d, n), n, lo, hi, kappa, c);
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
