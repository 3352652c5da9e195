// The engine's own control stream with every peer: liveness probes, so that a collective that
// timed out names the rank it is missing (dead, or alive in another operation) rather than
// only the neighbour it waited on; and mismatch notices, so that a rank whose collective saw
// another rank call it differently makes every rank fail, not only the two that disagree.
// Engine thread only (one Prober per engine).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "collectives/clock.h"
#include "net/base/error.h"
#include "net/transport/endpoint.h"

namespace qring::collectives {

class EngineOp;

// A mismatch another rank saw (its notice): the same error here, passed on once.
class MismatchNotice : public UsageError {
 public:
  MismatchNotice(const std::string& msg, int origin, uint64_t seq, int peer, uint64_t mine,
                 uint64_t theirs)
      : UsageError(msg), origin(origin), seq(seq), peer(peer), mine(mine), theirs(theirs) {}
  int origin;
  uint64_t seq;
  int peer;
  uint64_t mine, theirs;
};

class Prober {
 public:
  // `window`: how long a probe waits for the answers.
  Prober(int rank, int size, std::chrono::milliseconds window);
  // Posts one standing receive per peer (once).
  void start(net::Endpoint& ep);
  // `peer` is a new incarnation: its stream starts over.
  void reset_peer(net::Endpoint& ep, int peer);
  // Answers probes (with the op this rank started last, `last_started`, and its shape), takes
  // the answers to its own, and throws MismatchNotice for a notice (unless `broken` already).
  // Returns whether anything arrived.
  bool poll(net::Endpoint& ep, int64_t last_started, uint64_t last_shape, bool broken);
  // `op` timed out (`reason`): asks every peer which operation it is in.
  void probe(net::Endpoint& ep, const EngineOp& op, const std::string& reason,
             int64_t last_started, Clock::time_point now);
  // The op being diagnosed (null: none).
  const EngineOp* probed() const;
  void forget();
  // Once every peer answered or the window passed: the reason, naming the silent ranks, those
  // that never started the op, those that called it differently; then forgets the probe.
  std::optional<std::string> verdict(Clock::time_point now);
  // Tells every other rank that `origin` saw rank `peer` call op #seq differently, and waits
  // (at most 1 s of `clock`) for the notices to go out.
  void tell_mismatch(net::Endpoint& ep, TimeSource& clock, int origin, uint64_t seq, int peer,
                     uint64_t mine, uint64_t theirs);

 private:
  // type 1 probe; 2 answer (last_started, its shape); 3 mismatch: op #last_started failed on
  // rank `probe_id` because rank `peer` sent a message with descriptor `other` (the
  // detector's: shape).
  struct Ctl {
    uint32_t magic;
    uint16_t version;
    uint8_t type;
    uint8_t pad;
    uint32_t from;
    uint32_t peer;
    int64_t last_started;
    int64_t probe_id;
    uint64_t shape;
    uint64_t other;
  };
  // One standing receive per peer with an exact tag numbered per (sender, receiver) stream
  // (no ignore masks: libfabric 1.17's shm provider loses unexpected messages matched
  // through one).
  struct In {
    Ctl msg{};
    net::RequestPtr req;
    uint64_t next = 0;
  };
  struct Diagnosis {
    const EngineOp* op;
    uint32_t seq;
    std::string op_name;
    std::string reason;
    Clock::time_point until;
    uint64_t shape;                // of the op that timed out
    std::vector<int64_t> answers;  // per rank: last started op, or -2 = no answer yet
    std::vector<uint64_t> shapes;  // per rank: the shape of that op
  };
  void post(net::Endpoint& ep, int peer);
  void send(net::Endpoint& ep, int peer, const Ctl& m);

  int rank_, size_;
  std::chrono::milliseconds window_;
  std::vector<In> in_;
  std::vector<uint64_t> out_next_;
  bool posted_ = false;
  std::deque<std::pair<net::RequestPtr, std::unique_ptr<Ctl>>> out_;
  int64_t probe_id_ = 0;
  std::unique_ptr<Diagnosis> diag_;
};

}  // namespace qring::collectives
