// The quorum all-reduce's coordinator as a pure state machine: (state, Up, now) -> Downs.
// No threads, no clock reads, no I/O: its host (coordinator_host.h) feeds it the messages it
// receives and periodic ticks, and sends the messages it returns (DECIDE / VIEW / RECOVER /
// EVICTED / FATAL / JOINING, messages.h) to the members. Tests drive it with a simulated clock.
//
// What it decides (docs/design.md, "Membership"):
//  - S(t), the contributors of step t: every live member arrived, or the quorum arrived and
//    the grace passed; fewer than the quorum by first arrival + deadline is a timeout.
//  - The view (epoch, live members). A member silent for `evict` + a heartbeat period
//    (liveness.h, silence_limit: every rank's engine heartbeats every evict / 8, so a pause
//    shorter than evict never evicts), one that missed `evict_steps` consecutive steps (0 =
//    never), or one that a member had a transport error with and that has missed heartbeats
//    (silent for evict / 4) leaves the next view. A rank that said goodbye (finished the job)
//    is never evicted. The quorum follows the view when it is a fraction. Fewer than max(quorum, min_world) members stops the job.
//  - Recovery of a step that a departed member was part of: every live member reports
//    whether it holds the step's final result (aborting its reduction if not). If one does,
//    it forwards the result to the others (S(t) unchanged); if none does, the step is decided
//    again among the surviving contributors (late ones included: their contributions are
//    intact), or skipped on every rank when fewer than the quorum remain.
//    Either way every member ends the step with the same S(t) and the same bits.
//  - Rejoin: a new incarnation of a rank (restarted, or evicted while alive) is found by the
//    service in the rendezvous store (kJoin). If its old incarnation is still a member it
//    leaves the view at once ("restarted"). Every member is told (JOINING) and reconnects to
//    it (kAccept); once every member did and the joiner has connected to all of them (kHello),
//    it enters the next view at the next step to be decided, with this rank as the donor of
//    its state. It takes part in no step before that one (recovery, settling).
//  - Replicas that drifted: READYs may carry a digest of the sender's replicated state before
//    the step (qring-train: a parameter checksum every train.checksum_every steps); two
//    different digests for one step stop the job on every rank (FATAL naming both ranks).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "collectives/quorum/auto_quorum.h"
#include "collectives/quorum/messages.h"
#include "collectives/quorum/noise_scale.h"

namespace qring::collectives::qproto {

using Clock = std::chrono::steady_clock;
using Time = Clock::time_point;
using Ms = std::chrono::milliseconds;

struct Config {
  int world = 1;
  int self = 0;           // the coordinator's own rank
  int quorum = 0;         // > 0: a count, kept as given
  double fraction = 0;    // > 0: a fraction of the view, recomputed on every view change
  Ms grace{0};
  Ms deadline{30000};
  Ms evict{5000};
  int evict_steps = 0;    // consecutive missed steps that evict a member; 0 = never
  int min_world = 0;      // fewest members the job runs with; 0 = the quorum
  uint64_t count = 0;     // elements per contribution (checked on every READY)
  // quorum "auto" (auto_quorum.h): each step's quorum Q(t) is chosen when it opens from the
  // window of recent arrivals, within [quorum, auto_max] (auto_max 0 = the view's size);
  // `quorum` is then the lower bound, the one that membership rules use.
  bool adaptive = false;
  int auto_max = 0;
  double auto_kappa = 0;   // the rule's noise scale in contributions (0 = linear value)
  // The noise scale estimated in the run instead (noise_scale.h), from the norms READYs carry
  // (Up::grad_sq, prev_mean_sq); auto_kappa until the first estimate.
  bool auto_estimate = false;
  Ms join_timeout{30000};  // a join that does not complete in this time is abandoned
  uint32_t layout = 0;    // element type and reduction (layout_of; checked on every READY)
};

// The quorum in force for a view of `view_size` members (a fraction is rounded up).
int quorum_for(const Config& c, int view_size);
// Fewest members the job may continue with: max(quorum, min_world).
int floor_for(const Config& c, int view_size);

class Coordinator {
 public:
  Coordinator(Config cfg, Time now);
  // Failover: this rank (cfg.self, the lowest of `view`) takes over from a coordinator that
  // fell silent, after the members of `view` acknowledged it. `completed` (per rank) and
  // `known` (the union of what the members saw) rebuild the state; every known step that is
  // not completed by every member is recovered (RECOVER with a higher attempt), and steps
  // nobody saw decided are decided afresh from the READYs the members send again. `out`
  // gets the new VIEW and the RECOVERs.
  // `incarnations`: every rank's, as the new coordinator knows them (a rank that rejoined
  // before is not a new join).
  Coordinator(Config cfg, Time now, View view, const std::vector<int64_t>& completed,
              const std::vector<Known>& known, std::vector<Down>& out,
              const std::vector<uint32_t>& incarnations = {});

  // `more`: further events of the same instant follow (the messages one poll of the streams
  // found): this one is taken in, and the decisions wait for the last of them, so that every
  // contribution that is already in when the quorum is reached is counted (grace 0 means the
  // first Q to arrive, and those found together arrived together).
  std::vector<Down> handle(const Event& e, Time now, bool more = false);

  const View& view() const { return view_; }
  // The quorum in force: a fraction counts the members that can contribute, not those that
  // rejoined and apply the results they missed before they contribute again.
  int quorum() const { return quorum_for(cfg_, contributing()); }
  int contributing() const;
  bool stopped() const { return stopped_; }
  const Config& config() const { return cfg_; }
  // Every arrival (late ones included), as (step, rank, ms after the step's first arrival).
  void on_arrival(std::function<void(uint64_t, int, double)> cb) { on_arrival_ = std::move(cb); }
  // auto_estimate: the run's estimate of the gradient-noise scale so far, in contributions.
  std::optional<double> noise_scale() const { return noise_.value(); }
  // Steps decided but not yet completed by every live member.
  size_t unsettled() const { return unsettled_.size(); }
  // The next step to be decided (a rank admitted now is a member from it on).
  uint64_t next_step() const { return next_step_; }
  // Joins under way (found, not yet admitted or abandoned).
  size_t joining() const { return joins_.size(); }
  uint32_t incarnation(int r) const { return incarnation_[size_t(r)]; }
  // True while a step is open (READYs counted, no decision yet) or being recovered: the
  // caller should tick promptly (the grace and the deadline run).
  bool waiting() const;
  // The coordinator's own process was stopped for a while: silence measured across the
  // pause says nothing about the others, so every member starts a fresh evict period.
  void resync(Time now);

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
  struct Unsettled {
    std::vector<int> contributors;
    std::vector<int> late;  // contributed after the decision (their buffers are intact)
    uint32_t attempt = 0;
    int source = -1;
    bool skipped = false;
    bool recovering = false;
    std::map<int, uint8_t> reports;  // rank -> kHave, kNeed or kAbsent
  };

  static constexpr uint8_t kNeed = 0, kHave = 1, kAbsent = 2;
  void on_ready(int from, uint64_t step, uint64_t count, uint32_t layout, Time now);
  void check_digest(int from, uint64_t step, uint64_t digest, std::vector<Down>& out);
  void tick(Time now, std::vector<Down>& out);
  void change_view(std::vector<Departure> left, Time now, std::vector<Down>& out);
  void resolve_recoveries(std::vector<Down>& out);
  void decide_open(Time now, std::vector<Down>& out);
  void settle();
  void take_result_norm(const Up& e);
  void take_grad_norm(int from, const Up& e);
  void keep_norms(uint64_t t, const Open& o, const std::vector<int>& contributors);
  void recount(Open& o, Time now) const;
  int quorum_of(const Open& o) const;
  void on_join(int r, uint32_t inc, Time now, std::vector<Down>& out);
  void admit_joiners(Time now, std::vector<Down>& out);
  // Whether member r takes part in step t (it joined at or before it).
  bool in_step(int r, uint64_t t) const { return joined_at_[size_t(r)] <= t; }

  Config cfg_;
  View view_;
  bool stopped_ = false;
  std::vector<Time> last_heard_;
  std::vector<int64_t> completed_;
  std::vector<int> missed_;
  std::vector<Departure> pending_;  // evictions decided outside tick()
  std::vector<bool> suspect_;       // a member reported a transport error with it
  std::vector<bool> finished_;      // said goodbye
  std::vector<bool> heard_;         // has spoken at least once (start-up takes longer)
  std::map<uint64_t, Open> open_;
  std::map<uint64_t, Time> first_of_decided_;  // for late arrivals' offsets
  uint64_t low_water_ = 0;                     // every step below was decided
  std::map<uint64_t, Unsettled> unsettled_;
  int64_t settled_ = -1;
  std::map<uint64_t, std::pair<int, uint64_t>> digests_;  // step -> (first rank, its digest)
  uint64_t next_step_ = 0;               // the lowest step not decided yet
  std::vector<uint32_t> incarnation_;    // per rank: the newest incarnation known
  std::vector<uint64_t> joined_at_;      // per rank: first step it takes part in
  std::vector<bool> catching_up_;        // per rank: joined, has not contributed since
  struct Join {
    uint32_t incarnation = 0;
    Time started{};
    std::vector<int> accepted;  // members that reconnected to it
    bool hello = false;         // it connected to every member
  };
  std::map<int, Join> joins_;
  std::function<void(uint64_t, int, double)> on_arrival_;
  AutoQuorumWindow window_;  // adaptive: the recent steps' arrivals
  // auto_estimate: per decided step, its contributors' count and mean squared norm, until a
  // READY of the next step brings the result's norm; and the estimate.
  std::map<uint64_t, std::pair<int, double>> step_norms_;
  NoiseScaleEstimate noise_;
  double kappa() const;
};

}  // namespace qring::collectives::qproto
