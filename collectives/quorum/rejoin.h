// Rejoin on a member (docs/design.md, "Rejoin"): a new incarnation of rank r is found in the
// store by the coordinator's join agent (kJoin); the coordinator tells every member
// (JOINING); each member fetches r's address, reconnects to it (Engine::reset_peer: a new
// generation in the tags, streams from message 0), publishes its own address for r and
// ACCEPTs; r finds those addresses, connects to every member and says HELLO to the
// coordinator, which admits it in the next view; its donor then sends it the live state.
// This is both sides of that on the engine (the store look-ups run on the join agent's
// thread, join_agent.h), and the state transfer. Engine thread only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "collectives/engine.h"
#include "collectives/quorum/control_stream.h"
#include "collectives/quorum/coordinator.h"
#include "collectives/quorum/join_agent.h"
#include "collectives/quorum/membership_box.h"
#include "collectives/quorum/outbox.h"
#include "collectives/quorum/quorum.h"

namespace qring::collectives {

class Rejoin {
 public:
  Rejoin(Engine& engine, const CommOptions& copts, const QuorumOptions& o, uint32_t instance,
         MembershipBox& membership, ControlStreams& streams, Outbox& out,
         std::shared_ptr<JoinAgentIo> agent);
  void start(net::Endpoint& ep);

  bool joining() const { return joining_; }
  // Nothing under way: no member reconnects to a joiner, and a joiner is admitted.
  bool idle() const { return member_joins_.empty() && (!joining_ || admitted_); }
  bool admitted() const { return admitted_; }
  // The joiner, admitted, before its state arrived: it must not coordinate (it would leave
  // the job at once if the state does not come).
  bool awaiting_state() const { return joining_ && admitted_ && !state_arrived_; }
  uint64_t join_step() const { return join_step_; }
  // Per rank: the incarnation this rank talks to.
  const std::vector<uint32_t>& incarnations() const { return inc_; }

  // ---- A member.
  // JOINING from the coordinator: reconnect to incarnation `inc` of `r`.
  void joining(int r, uint32_t inc);
  // `r` left the view and may come back: the transport prepares (net::Endpoint).
  void left(int r);
  // Whether the agent looks in the store for the end of the job (every 200 ms): a member
  // that has not heard its coordinator for long may be one the job finished without (left
  // behind or evicted at the end, its EVICTED or the goodbye lost with the coordinator's
  // connection). Once the end is found, poll() throws JobOver.
  void watch_for_end(bool on);

  // Every pass: what the agent found. `coordinator` (null unless this rank coordinates) gets
  // the new incarnations the agent found outside its view (kJoin, in `to_coordinator`) and is
  // watched by the agent; ACCEPTs for the coordinator go into `to_coordinator` too. The joiner
  // connects to the members, says HELLO once it reached them all and returns in
  // `*coordinator_found` the coordinator it said it to (else -1). `completed` goes with the
  // joiner's messages.
  bool poll(net::Endpoint& ep, const qproto::Coordinator* coordinator, int64_t completed,
            std::vector<qproto::Up>& to_coordinator, int* coordinator_found);
  // The joiner, admitted in `view` (its entry `j` in the VIEW), coordinated by `coordinator`.
  void admit(const qproto::Joined& j, const qproto::View& view, int coordinator);
  // State transfer: the donor's sends, the joiner's receive (ends when the donor leaves `view`).
  bool poll_state(net::Endpoint& ep, const qproto::View& view);
  // The joiner: why its state will not come (its donor left the view first, or the transfer
  // failed); empty while it may. Such a joiner leaves the view (member.h).
  const std::string& state_lost() const { return state_lost_; }
  void cancel(net::Endpoint& ep);

 private:
  struct MemberJoin {
    uint32_t incarnation = 0;
    std::string key;  // where this rank publishes its address for the joiner
    bool connected = false;
    bool refused = false;  // other settings: reconnected, but not accepted
    Clock::time_point started{};
  };
  struct Found {  // what the agent handed back
    std::vector<std::string> published;
    std::vector<std::tuple<int, uint32_t, std::string>> fetched;
    std::vector<std::pair<int, uint32_t>> incarnations;
    std::vector<std::pair<int, std::string>> values;
  };
  void exchange(const qproto::Coordinator* coordinator, Found& got);
  void connect(net::Endpoint& ep, int p, const std::string& address, uint32_t inc);
  std::string settings(net::Endpoint& ep) const;
  std::string own_value(net::Endpoint& ep) const;
  bool reconnect_to_joiners(net::Endpoint& ep, const Found& got);
  void forget_abandoned();
  bool accept_published(const Found& got, std::vector<qproto::Up>& to_coordinator);
  bool connect_to_members(net::Endpoint& ep, const Found& got, int64_t completed);
  void report_stage();
  bool say_hello(net::Endpoint& ep, int64_t completed, int* coordinator_found);

  Engine& engine_;
  const CommOptions& copts_;
  const QuorumOptions& o_;
  const int rank_, world_;
  const uint32_t instance_;
  MembershipBox& membership_;
  ControlStreams& streams_;
  Outbox& out_;
  std::shared_ptr<JoinAgentIo> agent_;
  const Clock::time_point created_;
  uint32_t my_inc_ = 0;         // this process's incarnation
  std::vector<uint32_t> inc_;   // per rank: the incarnation this rank talks to
  std::map<int, MemberJoin> member_joins_;  // ranks coming back that this member reconnects to
  // The joiner.
  const bool joining_;
  bool admitted_;
  uint64_t join_step_ = 0;
  int donor_ = -1;
  bool hello_sent_ = false;
  std::set<int> joiner_connected_;
  std::vector<int> joiner_members_;
  int joiner_coord_ = -1;
  uint64_t joiner_epoch_ = 0;
  net::RequestPtr state_req_;
  std::string state_lost_;
  bool state_arrived_ = false;
  bool watching_end_ = false;  // watch_for_end
  std::shared_ptr<Bytes> state_buf_;
};

}  // namespace qring::collectives
