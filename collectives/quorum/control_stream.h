// The member's control stream: with every peer, one stream of up messages (any rank -> the
// coordinator) and one of down messages (coordinator -> rank) in each direction, since any
// rank may become the coordinator (failover). Each stream is exactly tagged and numbered in
// send order (never ignore masks: libfabric 1.17's shm provider loses unexpected messages
// matched through one), so a rank applies a coordinator's messages in the order they were
// sent. Messages are decoded here (wire.h) and handed on whole. Engine thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "collectives/quorum/messages.h"
#include "collectives/quorum/outbox.h"
#include "net/transport/endpoint.h"

namespace qring::collectives {

class ControlStreams {
 public:
  ControlStreams(int rank, int world, uint32_t instance, Outbox& out);
  // Posts the receives of every stream.
  void start(net::Endpoint& ep);
  // Streams with `peer` start over (its new incarnation, or this rank's first contact).
  void reset(net::Endpoint& ep, int peer);
  // Up to `to`: the coordinator (or a deposed one, told so; a member a joiner warms up).
  void send_up(net::Endpoint& ep, int to, const qproto::Up& m);
  // Down to each of `to` but this rank (one encoding).
  void send_down(net::Endpoint& ep, const std::vector<int>& to, const qproto::Down& m);
  // The messages that arrived, in stream order per peer, at most 16 per stream and call (a
  // backlog is taken over several passes). A failed receive ends its stream: the error
  // concerns that peer only, which falls silent and leaves the view. A peer's BYE tells the
  // endpoint that it may be gone from now on (Endpoint::expect_departure).
  bool poll_up(net::Endpoint& ep, const std::function<void(qproto::Up&&)>& take);
  bool poll_down(net::Endpoint& ep, const std::function<void(int, qproto::Down&&)>& take);
  // Withdraws every receive (the end, or a failure).
  void cancel(net::Endpoint& ep);

 private:
  struct In {
    std::vector<char> msg;
    net::RequestPtr req;
    uint64_t next = 0;  // number of the next message expected from this peer
  };
  void post_up(net::Endpoint& ep, int p);
  void post_down(net::Endpoint& ep, int p);
  bool arrived(In& in, int from);

  int rank_, world_;
  uint32_t instance_;
  Outbox& out_;
  std::vector<In> up_in_, down_in_;
  std::vector<uint64_t> up_next_, down_next_;  // per destination: the next message's number
};

}  // namespace qring::collectives
