// The steps decided but not yet completed by every live member, and their recovery
// (docs/design.md, "Membership"): when a member that was part of such a step leaves the view,
// every live member reports whether it holds the step's final result (RECOVER / REPORT). If
// one does, it forwards the result to the others (S(t) unchanged); if none does, the step is
// decided again among the surviving contributors (late ones included: their contributions are
// intact), or skipped on every rank when fewer than the quorum remain. A step is settled once
// every member that takes part in it completed it; DECIDE carries the highest settled step so
// members forget what they kept for recovery. After a takeover the new coordinator rebuilds
// this from what the members knew (rebuild). Pure: the coordinator (coordinator.h) drives it.
#pragma once

#include <map>
#include <vector>

#include "collectives/quorum/messages.h"
#include "collectives/quorum/roster.h"

namespace qring::collectives::qproto {

class StepRecovery {
 public:
  // Takeover at `now`: every step in `known` (what the members saw decided) that not every
  // member of the view completed is recovered, with a higher attempt (a RECOVER to `out`).
  // Returns the step after the highest known one (every step below it was decided).
  uint64_t rebuild(const std::vector<Known>& known, const Roster& roster, std::vector<Down>& out,
                   Time now);
  // Step t decided OK with `contributors` at `now`.
  void decided(uint64_t t, const std::vector<int>& contributors, Time now) {
    Unsettled& u = unsettled_[t];
    u.contributors = contributors;
    if (u.decided_at == Time{}) u.decided_at = now;
  }
  // The members (not `self`) whose oldest missing result, a step they take part in, was
  // decided more than `limit` ago: lag counted from the later of that decision and
  // Roster::lag_from (a joiner's state arrived, the coordinator's own stop), less the
  // coordinator's own stalls since it last heard from them. In rank order.
  std::vector<int> behind(const Roster& roster, Time now, Clock::duration limit) const;
  // A READY of member `from` for step t after its decision: its contribution is intact.
  void late(uint64_t t, int from);
  // A REPORT of member `from`.
  void report(int from, const Event& e);
  // `left` left the view: the unsettled steps one of them was part of (as a contributor or as
  // the source of the result) are recovered (RECOVER to `out`).
  void lost(const std::vector<Departure>& left, std::vector<Down>& out);
  // The recoveries every member reported on: their new decisions (DECIDE to `out`), and the
  // steps decided again among their survivors (to `redecided`).
  void resolve(const Roster& roster, int world, std::vector<Down>& out,
               std::vector<uint64_t>& redecided);
  // Forgets the steps every member that takes part in completed, in order.
  void settle(const Roster& roster);

  int64_t settled() const { return settled_; }
  size_t unsettled() const { return unsettled_.size(); }
  bool recovering() const;

 private:
  struct Unsettled {
    std::vector<int> contributors;
    std::vector<int> late;  // contributed after the decision (their buffers are intact)
    Time decided_at{};      // its first decision (a takeover: when it rebuilt it)
    uint32_t attempt = 0;
    int source = -1;
    bool skipped = false;
    bool recovering = false;
    std::map<int, uint8_t> reports;  // rank -> kHave, kNeed or kAbsent
  };
  static constexpr uint8_t kNeed = 0, kHave = 1, kAbsent = 2;
  void redecide(Unsettled& u, const Roster& roster, Decision& d);

  std::map<uint64_t, Unsettled> unsettled_;
  int64_t settled_ = -1;
};

}  // namespace qring::collectives::qproto
