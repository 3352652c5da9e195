// The membership of a quorum all-reduce (docs/design.md, "Membership" and "Rejoin"): the live
// ranks as views, the coordinator, a new incarnation's join and the transfer of the live state
// to it. One per QuorumAllreduce (QuorumAllreduce::membership()); any thread may call it.
//
//   auto& m = q.membership();
//   m.members();                        // the live ranks as of the last completed step
//   for (auto& v : views_learned(m.view_changes(), r.epoch, &known)) ...   // who left, who came
//   // a donor, when QuorumResult::joined names it:   m.send_state(j.rank, step, state);
//   // the joiner (QuorumOptions::join):  m.join(until); m.receive_state(buf, len, until);
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/clock.h"

namespace qring::collectives {

// A rank that entered the view by rejoining: a member from step `step` on; `donor` sends it
// the state after step - 1 (QuorumMembership::send_state).
struct Rejoined {
  int rank = -1;
  uint32_t incarnation = 0;
  uint64_t step = 0;
  int donor = -1;
};

// What join() returns: the first step this rank takes part in and who sends the state.
struct JoinInfo {
  uint64_t step = 0;
  int donor = -1;
  uint64_t epoch = 0;
  std::vector<int> members;
  double join_ms = 0;  // from the all-reduce's creation to the admission
};

// A change of the live members, as this rank applied it.
struct ViewChange {
  uint64_t epoch = 0;
  std::vector<int> members;
  struct Left {
    int rank;
    std::string why;   // "silent", "missed steps", "unreachable", "restarted", "left"
    double silent_ms;  // time since the coordinator had last heard from it
  };
  std::vector<Left> left;
  std::vector<Rejoined> joined;
  Clock::time_point seen{};  // when this rank applied it
};

// The view changes a caller learns of from a step decided in view `decided_in`, when it has
// learned of those up to view `*known`: of `views` (in epoch order, as view_changes() returns
// them), those after *known up to decided_in, each once; *known becomes the larger of the two.
// Steps do not arrive in view order: a step decided again after a loss takes the new view, while
// the next step may have been decided before that, in the old view (by ranks that had its result,
// without this one).
std::vector<ViewChange> views_learned(const std::vector<ViewChange>& views, uint64_t decided_in,
                                      uint64_t* known);

class QuorumMembership {
 public:
  virtual ~QuorumMembership() = default;
  // The live members as of the last step this rank completed, and every view change this rank
  // has applied so far (the first entry is epoch 0, the full world; a joiner's, the view it
  // entered).
  virtual std::vector<int> members() const = 0;
  virtual std::vector<ViewChange> view_changes() const = 0;
  // The rank that coordinates now (0 until it is lost; then the lowest live rank that took
  // over). It writes the job's outputs.
  virtual int coordinator() const = 0;
  // Whether the job goes on when a rank is lost (max(quorum, min_world) < world).
  virtual bool survives_loss() const = 0;

  // ---- Rejoin (QuorumOptions::store).
  // The joiner (QuorumOptions::join): blocks until this rank is admitted to a view, and
  // returns the first step it takes part in. QuorumTimeout at `until`, naming what it waited
  // for (members that had not published their address for it, or the coordinator's VIEW);
  // JobOver when the job ended first.
  virtual JoinInfo join(Deadline until) = 0;
  // The joiner, after join(): receives the donor's state (at most `len` bytes) into `buf`;
  // returns its length. QuorumTimeout at `until` naming the donor; Evicted when the state
  // will not come (the donor left the view first, or the transfer failed): this incarnation
  // left the view, and a new one rejoins with a live member's state.
  virtual size_t receive_state(void* buf, size_t len, Deadline until) = 0;
  // The donor of a rank that joined at `step` (QuorumResult::joined): sends it `state` and
  // returns at once (the transfer runs on the engine while the steps go on). The engine holds
  // its reference until the send completes (use_count() back to 1: the caller may reuse it).
  virtual void send_state(int to, uint64_t step,
                          std::shared_ptr<const std::vector<char>> state) = 0;
  void send_state(int to, uint64_t step, std::vector<char> state) {
    send_state(to, step, std::make_shared<const std::vector<char>>(std::move(state)));
  }
};

}  // namespace qring::collectives
