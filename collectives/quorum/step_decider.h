// The decision of each step (docs/design.md, "The quorum all-reduce"): the READYs of the steps
// still open, counted against the members of the view, and S(t) once it is due: every member
// that can contribute arrived, or the quorum did and the grace passed since (decide_rule.h);
// fewer than the quorum by first arrival + deadline is a timeout, a READY with another count
// or layout a mismatch. Under quorum "auto" it chooses each step's Q(t) as the step opens from
// the window of recent arrivals (auto_quorum.h), and estimates the gradient-noise scale from
// the norms READYs carry (noise_scale.h). It also catches replicas that drifted (two digests
// of one step). Pure: the coordinator (coordinator.h) feeds it READYs with the time, and
// takes its decisions with the roster (roster.h) it counts against.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "collectives/quorum/auto_quorum.h"
#include "collectives/quorum/coordinator_config.h"
#include "collectives/quorum/messages.h"
#include "collectives/quorum/noise_scale.h"
#include "collectives/quorum/roster.h"

namespace qring::collectives::qproto {

class StepDecider {
 public:
  explicit StepDecider(const Config& cfg) : cfg_(cfg) {}
  // A takeover: every step below `next` was decided by the coordinator before.
  void start_at(uint64_t next) { low_water_ = next_step_ = next; }

  // The digest a READY carries: the FATAL reason when another rank's for the step differs.
  std::optional<std::string> check_digest(int from, uint64_t step, uint64_t digest);
  // member `from`'s READY `e`; false when its step was decided already (a late arrival: the
  // rank learns from DECIDE).
  bool arrive(int from, const Event& e, const Roster& roster, Time now);
  // The view changed: every open step counts its members again.
  void recount(const Roster& roster, Time now);
  // The open steps that are due now, in step order, as DECIDEs to `out`; after one that fails
  // (a timeout or a mismatch) no further one: the job ends. `settled`: what every DECIDE
  // carries.
  void decide(const Roster& roster, Time now, int64_t settled, std::vector<Down>& out);
  // Step t is decided again (recovery): its first contributors' norms do not apply.
  void forget_norms(uint64_t t) { step_norms_.erase(t); }

  bool open() const { return !open_.empty(); }
  // The next step to be decided (a rank admitted now is a member from it on).
  uint64_t next_step() const { return next_step_; }
  // Every arrival (late ones included), as (step, rank, ms after the step's first arrival).
  void on_arrival(std::function<void(uint64_t, int, double)> cb) { on_arrival_ = std::move(cb); }
  // auto_estimate: the run's estimate of the gradient-noise scale so far, in contributions.
  std::optional<double> noise_scale() const { return noise_.value(); }

 private:
  struct Open {
    Time first{};
    std::vector<std::optional<Time>> arrived;
    std::vector<double> grad_sq;  // auto_estimate: per rank, its contribution's (-1: none)
    int quorum = 0;  // adaptive: Q(t), chosen when the step opened
    int n = 0;
    std::optional<Time> quorum_time;
    bool mismatch = false;
    int bad_rank = -1;
    uint64_t bad_count = 0;
    uint32_t bad_layout = 0;
  };
  bool on_ready(int from, uint64_t step, uint64_t count, uint32_t layout, const Roster& roster,
                Time now);
  Decision decision(uint64_t t, const Open& o, Status st, const Roster& roster, Time now,
                    int64_t settled) const;
  void count_arrivals(Open& o, const Roster& roster, Time now) const;
  int quorum_of(const Open& o, const Roster& roster) const;
  void take_result_norm(const Event& e);
  void take_grad_norm(int from, const Event& e);
  void keep_norms(uint64_t t, const Open& o, const std::vector<int>& contributors);
  double kappa() const;

  Config cfg_;
  std::map<uint64_t, Open> open_;
  std::map<uint64_t, Time> first_of_decided_;  // for late arrivals' offsets
  uint64_t low_water_ = 0;                     // every step below was decided
  uint64_t next_step_ = 0;                     // the lowest step not decided yet
  std::map<uint64_t, std::pair<int, uint64_t>> digests_;  // step -> (first rank, its digest)
  std::function<void(uint64_t, int, double)> on_arrival_;
  AutoQuorumWindow window_;  // adaptive: the recent steps' arrivals
  // auto_estimate: per decided step, its contributors' count and mean squared norm, until a
  // READY of the next step brings the result's norm; and the estimate.
  std::map<uint64_t, std::pair<int, double>> step_norms_;
  NoiseScaleEstimate noise_;
};

}  // namespace qring::collectives::qproto
