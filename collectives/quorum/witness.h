// Deaths witnessed, not guessed (docs/design.md, "Membership", "Witnessed deaths"): where the
// rendezvous store lives outside the ranks (qring-launch reaps its ranks; qring-store sees a
// rank's connection close), it records each death it is certain of as the key
// net::dead_key(rank, incarnation) (net/rendezvous/store.h). A witnessed death needs no majority: the dead leave the
// majority's denominator (failover.h, roster.h), so any set of losses that leaves
// max(quorum, quorum.min_world) live ranks goes on, the coordinator's included. Without a
// witness the majority rule stays.
//
// This is a member's side of it: which ranks it asks the join agent (join_agent.h) to look
// for in the store -- only ranks whose death a decision waits on (a coordinator or member
// silent for evict / 4, a member reported unreachable, the successors before this rank), so
// the store sees at most a few CHECKs every 100 ms per rank, never a storm -- and which of
// them were found dead, per incarnation (a rank that came back as a new incarnation is alive
// again).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "collectives/quorum/messages.h"

namespace qring::collectives {

struct JoinAgentIo;

// The ranks a member whose coordinator has been quiet for evict / 4 looks for: the coordinator
// and the successors before `self` (every candidate while this rank gathers acks). The
// coordinator looks for its members quiet that long (Coordinator::quiet).
std::vector<int> deaths_to_watch(const qproto::View& view, int coordinator, int self,
                                 bool gathering);
// The coordinator's event for a witnessed death (kDied, a local kind).
qproto::Up death_event(int rank, uint32_t incarnation);

class Witness {
 public:
  explicit Witness(int world);
  // Incarnation `inc` of rank r is the one the job knows now (a new one is alive).
  void incarnation(int r, uint32_t inc);
  uint32_t incarnation(int r) const { return inc_[size_t(r)]; }
  bool dead(int r) const { return dead_[size_t(r)] != 0; }
  // Per rank, 1 where witnessed dead (the form the pure rules take).
  const std::vector<char>& deaths() const { return dead_; }
  // The (rank, incarnation) pairs to look for: `ranks`, less those known dead already.
  std::vector<std::pair<int, uint32_t>> watch(const std::vector<int>& ranks) const;
  // Asks the join agent to look for the deaths of `ranks` (replacing the last request) and
  // takes what it found: the deaths new to this rank, as (rank, incarnation).
  std::vector<std::pair<int, uint32_t>> exchange(JoinAgentIo& io, const std::vector<int>& ranks);

 private:
  std::vector<uint32_t> inc_;
  std::vector<char> dead_;
};

}  // namespace qring::collectives
