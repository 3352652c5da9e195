// The step runner: the data plane of a decided step on one member. A step's reduction among
// its contributors is an ordinary engine op over that subset of ranks (make_collective_op,
// failing alone: EngineOp::OnFailure::kFailsOp); a rank outside S(t) receives the result from
// one member of S(t); a step decided again after a loss either takes the result from a member
// that has it or runs a new reduction; with quorum = world the reduction starts at contribute
// time (speculation). It writes each step's outcome into the step table (steps.h) for the
// caller. Engine thread only.
//
// In a job that survives a lost rank ("tolerant") every contribution stays intact until its
// step completes (reductions out of place) and every result is kept until every live rank has
// the step (settled), so that a step can be decided again, or its result forwarded.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "collectives/engine.h"
#include "collectives/quorum/messages.h"
#include "collectives/quorum/outbox.h"
#include "collectives/quorum/quorum.h"
#include "collectives/quorum/steps.h"

namespace qring::collectives {

class StepRunner {
 public:
  StepRunner(Engine& engine, const CommOptions& copts, const QuorumOptions& o, size_t count,
             uint32_t instance, bool tolerant, StepTable& steps, Outbox& out);

  // This rank contributed to `t` (its READY is on its way): with quorum = world, once one step
  // was decided, its reduction over `members` starts now.
  void contributed(uint64_t t, const std::vector<int>& members);
  // A decision in force on this rank (the member checked its epoch), from `coordinator`.
  // Throws the step's failure (timeout, mismatch).
  void decided(net::Endpoint& ep, const qproto::Decision& d, int coordinator);
  // RECOVER of step t: whether this rank holds its result. If not, its reduction and its
  // result receive are given up (the others may have sent their parts: those are discarded).
  bool recover(net::Endpoint& ep, uint64_t t);
  // Reductions that ended, results that arrived.
  bool advance(net::Endpoint& ep, const qproto::View& view);
  // A view without `rank`: the results queued for it are not sent.
  void left(int rank) { out_.forget_results(rank); }
  // A rank joined at `step`: it takes no result of a step before that.
  void joined(int rank, uint64_t step) { join_step_of_[size_t(rank)] = step; }
  // This rank takes part from `step` on (a joiner; else the first step decided): every step
  // before counts as completed.
  void start_at(uint64_t step);
  // Every step <= t is complete on every live member: its result is no longer kept.
  void settled(int64_t t);
  // Throws when a reduction or a result receive is past its deadline, or a step whose
  // reduction failed here was not decided again in time.
  void check_deadlines(Clock::time_point now);
  // A transport error with `peer` that the coordinator should hear of (a result receive).
  std::vector<std::pair<int, std::string>> take_suspects();
  // Every step <= completed() is complete here (results from different members may come out
  // of order: the coordinator settles, and a takeover recovers, by this prefix).
  int64_t completed() const { return completed_; }
  // The latest completed step came as its result from a member (this rank was outside S(t)).
  bool received_last() const { return completed_ >= 0 && received_ == completed_; }
  bool done(uint64_t t) const { return done_.count(t) != 0; }
  // Nothing in flight on this rank.
  bool idle() const { return rings_.empty() && result_recvs_.empty(); }
  // The end (or a failure): every reduction and result receive is given up.
  void cancel(net::Endpoint& ep);

 private:
  struct Ring {
    WorkPtr work;
    Clock::time_point started;
    std::vector<int> members;
    uint32_t attempt = 0;
    bool speculative = false;
  };
  struct ResultRecv {
    net::RequestPtr req;
    int from;
    Clock::time_point started;
  };
  struct Placed {  // where a decided step's data is (settle())
    void* buf = nullptr;
    std::shared_ptr<Bytes> out;
    bool spec = false, finished = false, newly_excluded = false;
  };
  void throw_if_failed(const qproto::Decision& d, const QuorumResult& res, int coordinator) const;
  bool forward_held_result(net::Endpoint& ep, const qproto::Decision& d);
  bool settle(const qproto::Decision& d, QuorumResult& res, Placed& p);
  void start_ring(uint64_t t, uint32_t attempt, void* buf, void* out, std::vector<int> members,
                  bool speculative);
  void post_result_recv(net::Endpoint& ep, uint64_t t, uint32_t attempt, int from,
                        const std::shared_ptr<Bytes>& out);
  void ring_done(net::Endpoint& ep, uint64_t t, Ring& ring, const qproto::View& view);
  bool ring_failed(uint64_t t, Ring& ring);
  bool poll_results();
  void advance_completed();  // completed_ over the steps ahead_ that now follow it
  void mark_done(uint64_t t, std::shared_ptr<Bytes> out);
  std::shared_ptr<Bytes> free_buffer() const;
  std::shared_ptr<Bytes> result_buffer();
  bool reserve_result_buffer();

  Engine& engine_;
  const CommOptions& copts_;
  const QuorumOptions& o_;
  const size_t count_, esz_;
  const int rank_, world_;
  const uint32_t instance_;
  const bool tolerant_;
  StepTable& steps_;
  Outbox& out_;
  bool speculate_ = false;  // quorum = world and a step was decided OK: start rings early
  int64_t completed_ = -1;
  std::set<uint64_t> ahead_;  // completed here after a step that is not yet
  bool started_ = false;      // completed_ is where this rank's run starts, or later
  int64_t received_ = -1;  // the latest step completed by a result received from a member
  std::map<uint64_t, Ring> rings_;
  std::map<uint64_t, ResultRecv> result_recvs_;
  std::map<uint64_t, Clock::time_point> failed_;  // steps whose reduction failed here
  std::set<uint64_t> done_;  // completed here, not yet settled everywhere (tolerant jobs)
  std::map<uint64_t, std::shared_ptr<Bytes>> kept_;  // their results
  std::vector<std::shared_ptr<Bytes>> pool_;
  std::vector<uint64_t> join_step_of_;  // per rank: the step it (re)joined at
  std::vector<std::pair<int, std::string>> suspects_;
};

}  // namespace qring::collectives
