// The adaptive quorum (quorum.quorum = "auto", issue 18): the number of contributions Q(t) a
// step waits for, chosen by the coordinator from the arrivals of recent steps. A pure function
// of the window (no clock, no I/O), called by the coordinator (step_decider.cc) when a
// step opens and by qring-sim on its virtual clock (train/sim.cc); docs/design.md, "Adaptive
// quorum", has the rule and its formula.
//
// The rule (after Xu, Neglia and Sebastianelli, "Dynamic Backup Workers for Parallel Machine
// Learning"): choose k in [min, max] maximizing the expected training progress per second,
//
//     value(k) / (E[T(k)] + C)
//
// - the value of a step that averages k gradients is taken as proportional to k: with the
//   linear learning-rate rule (qring-train scales the rate with the contributors in auto mode)
//   every counted gradient moves the parameters by the same amount, the small-batch regime of
//   the gradient-noise model; or, given the gradient-noise scale kappa (in contributions:
//   quorum.noise_scale over the batch per rank), as k / (1 + k / kappa), the progress per step
//   of a batch of k in that model (McCandlish et al., "An Empirical Model of Large-Batch
//   Training", 2018: steps to a target S = S_min (1 + B_noise / B)), which values a gradient
//   in a large step less than one in a small step;
// - T(k), the time from a step's first arrival to its k-th, is 0 for k = 1 and otherwise the
//   (k-1)-th order statistic of the offsets of the members other than the step's reference
//   (its first arrival, at 0 by definition: not an observation), averaged over how often each
//   member was the reference; each member's offset distribution is estimated by Kaplan-Meier
//   from its offsets in the steps where another member was the reference. A contribution
//   that had not arrived when its step was decided (a backup worker abandons its work) is
//   censored there, not dropped, and beyond a member's last observation its survival decays
//   exponentially with the observed mean offset, so a member that was always cut off looks
//   soon-to-arrive and is tried again (which observes it) rather than assumed slow for ever.
//   E[T(k)] = the sum over references f of P(f first) times the integral over x of P(fewer
//   than k - 1 of the others arrived by x), the others independent (a Poisson-binomial count,
//   f's factor divided out); above kPerRankMembers members the offsets are pooled over members
//   and treated as identically distributed (a binomial count of n - 1), which keeps a
//   decision at 1000 members cheap;
// - C, the rest of a step's cycle (from its decision to the next step's first arrival:
//   DECIDE, the reduction, the update, the next computation), is the window's median.
// - the trust region: k at most kExplore (a quarter, at least one) beyond the arrivals the
//   median step of the window observed; beyond them E[T(k)] is the extrapolated tail, which
//   turns optimistic whenever the steps that observed the slow arrivals leave the window
//   (without it, N = 100 under lognormal delays jumped from ~23 to ~67 every 33 steps).
// Without observations (the first step, or no cycle measured yet) the rule returns the middle
// of [min, max], rounded up: it observes at least half the arrivals without paying for the
// slowest one (docs/design.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <vector>

namespace qring::collectives {

// One decided step as the coordinator saw it: per rank of the world, its arrival after the
// step's first arrival (ms, >= 0), kNotArrived (a member that had not contributed when the
// step was decided), or kNotMember.
struct StepArrivals {
  static constexpr double kNotArrived = -1;
  static constexpr double kNotMember = -2;
  std::vector<double> offset_ms;
  double decided_ms = 0;  // the decision, after the first arrival
  double cycle_ms = -1;   // first arrival to the next step's first; < 0: not known yet
};

struct AutoQuorumChoice {
  int quorum = 0;
  double overhead_ms = 0;           // C
  std::vector<double> expected_ms;  // [k - 1] = E[T(k)], k = 1 .. n (empty: no estimate)
  std::vector<double> rate;         // [k - 1] = value(k) / (E[T(k)] + C)
};

constexpr int kPerRankMembers = 128;
// Up to this many members, T(k) is averaged over every member that was a step's reference
// (its first arrival); above, the others are those of a mean reference.
constexpr int kExactReferences = 8;
// The trust region: a choice goes at most this fraction (and at least one) beyond the
// arrivals the median step of the window observed.
constexpr double kExplore = 0.25;

// The choice for a step among `members` (ranks, sorted), bounded by [min, max] (max 0 = all
// members; both clamped to 1 .. members.size()); kappa > 0: the noise scale in contributions
// (value k / (1 + k / kappa)), 0: the linear value k.
AutoQuorumChoice choose_quorum(const std::deque<StepArrivals>& window,
                               const std::vector<int>& members, int min, int max, double kappa = 0);

// The window the coordinator keeps: the last kWindow decided steps, updated as they are
// decided, as late contributions arrive and as the next step opens.
class AutoQuorumWindow {
 public:
  static constexpr size_t kWindow = 32;
  void decided(uint64_t step, StepArrivals s);
  // A contribution of `rank` to decided step `step` arrived `offset_ms` after its first.
  void late(uint64_t step, int rank, double offset_ms);
  // Step `step` opened `since_prev_first_ms` after step `step - 1`'s first arrival.
  void opened(uint64_t step, double since_prev_first_ms);
  std::deque<StepArrivals> samples() const;

 private:
  std::map<uint64_t, StepArrivals> steps_;
};

}  // namespace qring::collectives
