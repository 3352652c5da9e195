// The quorum all-reduce: a bounded-wait ring all-reduce that completes once a quorum of
// contributions has arrived (synchronous SGD with backup workers, Chen et al. 2016).
// Contract and protocol: docs/design.md, "Quorum all-reduce".
//
//   QuorumAllreduce q(comm, grad.size(), opts);
//   for (step ...) {
//     compute(grad, [&] { return q.excluded(step); });  // may abandon stale work
//     q.contribute(step, grad.data(), grad.size());       // non-blocking
//     QuorumResult r = q.wait(step, grad.data());          // grad = mean over S(step)
//   }
//
// Every rank gets the same contributor set S(t) (|S(t)| >= quorum) and bit-identical output
// equal to the reduction of exactly the buffers of S(t). Ranks outside S(t) learn it at once
// (excluded(t)), still receive step t's result and move on. Fewer than `quorum`
// contributions by the hard deadline is a QuorumTimeout on every rank naming the missing ones.
//
// This class is the all-reduce only. Its membership (views, coordinator, rejoin and state
// transfer) and its reports are interfaces of their own (membership(), reports()). Inside, a
// member service on the engine (member.h) runs the protocol: its control stream, the
// coordinator's host, the step runner, rejoin and liveness (docs/design.md, "The quorum
// all-reduce's rooms").
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/quorum/errors.h"
#include "collectives/quorum/membership.h"
#include "collectives/quorum/reports.h"
#include "net/rendezvous/store.h"

namespace qring::collectives {

enum class LatePolicy : uint8_t { kDrop, kCarry };
LatePolicy parse_late_policy(std::string_view s);
std::string_view to_string(LatePolicy p);

struct QuorumOptions {
  int quorum = 0;  // contributions needed, 1..world; 0 = world size
  // After the quorum-th arrival, keep collecting for this long (0 = first `quorum` win).
  std::chrono::milliseconds grace{0};
  // Hard deadline: fewer than `quorum` contributions this long after the step's first one
  // fails the step (QuorumTimeout) on every rank. Also bounds every other wait of a step.
  std::chrono::milliseconds deadline{30000};
  LatePolicy late = LatePolicy::kDrop;
  DataType type = DataType::kFloat32;
  bool mean = true;  // mean over contributors, or sum
  // Membership (docs/design.md, "Membership"). > 0: the quorum is this fraction of the live
  // members, recomputed on every view change (`quorum` is then its value for the full world).
  double fraction = 0;
  // A rank silent this long (+ one heartbeat period: every rank's engine heartbeats every
  // evict / 8) leaves the view; a pause shorter than this never evicts.
  std::chrono::milliseconds evict{5000};
  // A rank that missed this many consecutive steps leaves the view (0 = never).
  int evict_steps = 0;
  // A rank whose oldest missing result was decided longer ago than this leaves the view
  // ("behind": stopped again and again, it would otherwise never catch up, and every member
  // would keep a result a step for it); a rank that can rejoins at once with a live member's
  // state (qring-train under a launcher that keeps the store). Only where the job survives
  // the loss; judged only while it runs (a pause shorter than `evict` never makes it leave).
  // 0: three times `evict`; negative: never.
  std::chrono::milliseconds max_lag{0};
  // Fewest live ranks the job continues with (0 = the quorum); below it every rank fails.
  int min_world = 0;
  // The adaptive quorum (quorum "auto", collectives/quorum/auto_quorum.h): the coordinator chooses
  // each step's quorum Q(t) from the recent arrivals, within [quorum, auto_max] (auto_max 0 =
  // the live members); `quorum` is the lower bound. Q(t) travels in DECIDE
  // (QuorumResult::quorum); the contract of every step is unchanged.
  bool adaptive = false;
  int auto_max = 0;
  // The rule's gradient-noise scale in contributions (0 = a step's value is linear in its
  // contributions; auto_quorum.h).
  double auto_kappa = 0;
  // The noise scale estimated in the run instead (noise_scale.h), from the norms the callers
  // pass to contribute() (auto_kappa until the first estimate).
  bool auto_estimate = false;
  // Rejoin (docs/design.md, "Rejoin"): the rendezvous store through which a rank that comes
  // back (a new incarnation: restarted, or evicted while alive) is found and connected. It
  // must outlive the all-reduce. nullptr: a rank that left stays out.
  net::Store* store = nullptr;
  // This process is a new incarnation of its rank (its endpoint's incarnation() > 0) joining
  // the running job: it takes part in no step until join() returns.
  bool join = false;
  // Settings a rank that comes back must share with every member to be admitted, besides the
  // communicator's (Communicator::settings_text): "key=value" lines (qring-train: its config
  // digests and kernels). A difference stops the joiner with a ConfigError naming the key.
  std::string agreed;
  // The instance number in the control tags and store keys, the same on every rank (a
  // joiner creates its all-reduce at another point of the communicator's sequence).
  // -1: the communicator's next sequence number.
  int instance = -1;
  // Called (on the engine; keep it short) with (step, "ring") once this rank's reduction of
  // the step has moved, and with (step, "donate") when a donor is about to send the state to a
  // rank that rejoins at `step`: where fault tests kill or stop a rank mid-reduction or
  // mid-transfer (fault_inject.h).
  std::function<void(uint64_t, const char*)> on_phase;
};

// "3" → 3; "0.75" → ceil(0.75 * world); "1.0" → world. ConfigError when out of [1, world].
int resolve_quorum(std::string_view spec, int world);
// The count a quorum fraction in (0, 1] stands for: ceil(fraction * world), the one rounding
// rule of resolve_quorum and of qring-train's quorum.quorum. The small tolerance keeps
// 0.75 * 4 at 3 despite rounding in the product.
inline int64_t quorum_of_fraction(double fraction, int world) {
  return static_cast<int64_t>(std::ceil(fraction * world - 1e-9));
}

struct QuorumResult {
  uint64_t step = 0;
  std::vector<uint8_t> contributors;  // bitmap: bit (r % 8) of byte r / 8 = rank r counted
  int count = 0;                      // |S(t)|
  bool self_counted = false;
  std::vector<int> dropped;  // ranks outside S(t)
  int quorum = 0;            // the quorum the step was decided with (Q(t) under "auto")
  // Times in ms relative to the first contribution of the step seen by the coordinator.
  double ready_ms = -1;  // this rank's contribution (-1: arrived after the decision)
  double decide_ms = 0;  // the decision
  std::vector<double> ready_offsets_ms;  // every rank's, as known at the decision (-1 = late)
  double reduce_ms = 0;                  // the ring reduction on this rank (0 when excluded)
  double wait_ms = 0;                    // time this rank spent inside wait()
  // No result: a member was lost mid-step and too few contributors survived. Every rank
  // skips the step alike (count 0, no update); the output buffer is left untouched.
  bool skipped = false;
  uint64_t epoch = 0;    // the view that decided the step
  uint32_t attempt = 0;  // > 0: decided again after a member was lost during the step
  // Ranks that entered the view at this step (rejoined). The donor of each sends it the
  // state before this step's update (send_state), after wait() and before applying it.
  std::vector<Rejoined> joined;
  bool contains(int rank) const { return (contributors[size_t(rank) / 8] >> (rank % 8)) & 1; }
};

class StepTable;
class MembershipBox;
class ReportBox;
struct JoinAgentIo;

class QuorumAllreduce {
 public:
  // One per communicator. `count` elements of opts.type per contribution.
  QuorumAllreduce(Communicator& comm, size_t count, QuorumOptions opts);
  ~QuorumAllreduce();
  QuorumAllreduce(const QuorumAllreduce&) = delete;
  QuorumAllreduce& operator=(const QuorumAllreduce&) = delete;

  // Non-blocking. `buf` holds this rank's contribution and must stay untouched until
  // wait(step) returns; when counted, the reduction happens in place in it. Steps are
  // consecutive. Under LatePolicy::kCarry, gradients that missed earlier steps are added to
  // `buf` here (so they count exactly once).
  // `digest`: a digest of this rank's replicated state before the step (a parameter checksum),
  // sent with the READY; two ranks with different digests for one step stop the job on every
  // rank (QuorumLost, "replicas drifted", naming both).
  // `norms` (adaptive with auto_estimate): the squared norm of this contribution and that of
  // the previous step's result as a mean over its contributors (none for the first step),
  // sent with the READY to the coordinator's estimate of the gradient-noise scale.
  struct Norms {
    double contribution_sq = 0;
    std::optional<double> prev_result_sq;
  };
  void contribute(uint64_t step, void* buf, size_t count,
                  std::optional<uint64_t> digest = std::nullopt,
                  std::optional<Norms> norms = std::nullopt);
  // Blocks until step's result is known and writes it to `out` (count elements; may be the
  // contributed buffer). Allowed without contribute() for a step this rank abandons.
  QuorumResult wait(uint64_t step, void* out);
  // The same without a copy: `view` gets where the result lies (count elements) and a handle
  // that keeps it there, unchanged by later steps, until the caller drops or reassigns it.
  // In a job that can lose ranks the result lies in the all-reduce's own buffer (kept for
  // ranks that may need it again), so this saves a copy of the whole buffer per step; in
  // place it is the contributed buffer. data is null for a skipped step.
  struct View {
    const void* data = nullptr;
    std::shared_ptr<const void> hold;
  };
  QuorumResult wait(uint64_t step, View* view);
  // True as soon as this rank's contribution to `step` can no longer be counted.
  bool excluded(uint64_t step) const;

  // The late gradient waiting to be carried into the next contribution (LatePolicy::kCarry),
  // for checkpoints: empty when none is pending. restore_carry() takes what it returned.
  std::vector<char> pending_carry() const;
  void restore_carry(const std::vector<char>& bytes);

  // The membership (views, coordinator, rejoin, state transfer) and the reports of this
  // all-reduce: valid as long as it is.
  QuorumMembership& membership();
  const QuorumMembership& membership() const;
  QuorumReports& reports();

  const QuorumOptions& options() const { return opts_; }
  size_t count() const { return count_; }

 private:
  // What the destructor leaves in the store for a rank that comes back (join_agent.h).
  void record_job_end(const std::string& key, const std::string& value);
  // Why the job was lost here (a timeout ended the service: QuorumLost, QuorumTimeout, a
  // ring given up), or "".
  std::string lost_reason() const;
  QuorumResult wait_impl(uint64_t step, void* out, View* view);
  void start_join_agent(uint32_t instance);
  Communicator& comm_;
  size_t count_;
  QuorumOptions opts_;
  // The hand-offs between the callers' threads and the engine, one per concern.
  std::shared_ptr<StepTable> steps_;
  std::shared_ptr<MembershipBox> membership_;
  std::shared_ptr<ReportBox> reports_;
  std::shared_ptr<JoinAgentIo> agent_io_;
  std::shared_ptr<std::atomic<bool>> shutdown_;  // tells the service to say goodbye and end
  WorkPtr service_;
  std::thread agent_;  // store look-ups for rejoins (QuorumOptions::store)
  int instance_ = 0;
  // Caller-thread state.
  bool have_next_ = false;
  uint64_t next_step_ = 0;
  std::vector<char> carry_;
  bool carry_pending_ = false;
};

}  // namespace qring::collectives
