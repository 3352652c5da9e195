// net::Endpoint — the transport interface (gloo's transport/pair split, libfabric semantics).
//
// Tagged, non-blocking point-to-point messages between the ranks of one world. Two
// implementations: FabricEndpoint (libfabric RDM, net/transport/fabric_endpoint.h) and InprocEndpoint
// (ranks as threads in one process, net/transport/inproc_endpoint.h); FaultEndpoint wraps either to
// delay or drop messages (net/transport/fault_endpoint.h).
//
// Threading: an Endpoint is driven by one thread at a time (its owner, normally the
// communicator's progress engine). Requests are completed only inside progress().
//
// Matching: a receive matches a message whose tag equals its tag on every bit not set in
// `ignore`, from `peer` (or from any peer with kAnyPeer). Messages from one peer with the same
// tag are matched in the order they were sent. A message longer than the posted receive is an
// error (ProtocolError on the request); a shorter one completes with Request::bytes.
//
// Immediate data: a send may carry 64 bits beside its payload (`data`; libfabric's remote CQ
// data, no extra message); the receive that matches it reports them in Request::data (0 when
// the sender gave none). The collectives put a descriptor of the operation there (shape.h) so
// that ranks which disagree on its size, type or reduction fail instead of mixing data.
//
// Lifetime: a buffer handed to isend/irecv belongs to the transport until its request is done
// (a receive's also when cancel() returned). close() ends that for every request at once.
//
// Peers are independent: a peer that stops reading (stopped, dead, overloaded) may hold back
// the sends to itself, never traffic with other peers, and an error that concerns one peer
// fails only its requests (see suspect_peers()).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "net/transport/tags.h"

namespace qring::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
using std::chrono::milliseconds;

inline Deadline deadline_in(std::chrono::nanoseconds d) {
  return Clock::now() + d;
}

constexpr int kAnyPeer = -1;

enum class RequestState : uint8_t { kPending, kDone, kCancelled, kError };

// What a caller sees of a message in flight. A transport that needs bookkeeping per request
// hands out a type derived from it, made with std::make_shared (net/transport/fabric_endpoint.cc).
struct Request {
  bool is_send = false;
  int peer = kAnyPeer;       // peer as posted (kAnyPeer for wildcard receives)
  uint64_t tag = 0;          // tag as posted
  uint64_t matched_tag = 0;  // for receives: the tag of the message that matched
  size_t len = 0;            // posted length
  size_t bytes = 0;          // bytes transferred (receives: message length)
  uint64_t data = 0;         // receives: the sender's immediate data (0: none)
  bool truncated = false;    // receives: kError because the message was longer than len
  RequestState state = RequestState::kPending;
  std::string error;  // set when state == kError

  bool done() const { return state != RequestState::kPending; }
  bool ok() const { return state == RequestState::kDone; }
};
using RequestPtr = std::shared_ptr<Request>;

// What a transport is, for the policy of the layers above it (segment sizes, lanes and sends
// in flight of the ring: collectives/algorithms.cc), instead of its provider's name (gloo's
// transport/device.h exposes capabilities the same way).
struct TransportTraits {
  // A CPU of this host copies every byte (shm: cross-memory attach; tcp: the kernel's socket
  // copies), so the rank that reduces a segment is also the one that copies the next, and
  // data does not move while that CPU reduces. false for RDMA providers, whose NIC moves the
  // data, and for the in-process endpoint, which stands in for them in tests.
  bool host_copies = false;
  // Buffers are registered before the transport uses them (libfabric FI_MR_LOCAL, or
  // FabricOptions::always_register): register_memory() once saves registering per call.
  bool needs_registration = false;
};

class Endpoint {
 public:
  virtual ~Endpoint() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Provider actually in use ("shm", "tcp;ofi_rxm", "inproc", ...): for logs and for the
  // settings peers must share; policy comes from traits().
  virtual std::string provider() const = 0;
  virtual TransportTraits traits() const { return {}; }
  // Largest message the transport moves in one piece; larger ones are split by the endpoint.
  virtual size_t max_message_size() const = 0;
  // Bytes of immediate data a message carries: 8 (shm, tcp;ofi_rxm, inproc); a provider with
  // fewer delivers the low bytes only (0: none, Request::data stays 0).
  virtual size_t data_bytes() const { return 8; }

  // Non-blocking. The buffer must stay valid and untouched until the request is done.
  // `data`: immediate data delivered with the message (see above).
  virtual RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len,
                           uint64_t data = 0) = 0;
  virtual RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len, uint64_t ignore = 0) = 0;

  // One non-blocking pass over the completion queue. Returns completions handled.
  virtual size_t progress() = 0;

  // Cancels a pending receive. Returns true if it was cancelled (buffer free again), false if
  // it had already completed. Sends cannot be cancelled once handed to the transport. Throws
  // TimeoutError when the transport does not confirm the cancellation in time (a provider
  // busy with a message that already matched it): the receive is then still posted, and
  // only its completion or close() frees its buffer.
  virtual bool cancel(const RequestPtr& req) = 0;

  // A message this rank no longer wants: the receive of an operation it gave up on (posted
  // and cancelled, or never posted) whose sender may have sent it, or may still send it until
  // it gives up too. A transport where a message nobody receives holds back the sender's later
  // ones (shm completes an endpoint's sends in order, and a large send only once the receiver
  // takes it) receives it into a buffer of its own and drops it; the receive is withdrawn at
  // `until` if nothing came. Errors of such a receive mark no one suspect. A transport where
  // an unreceived message costs the sender nothing ignores it (the default).
  virtual void discard(int /*peer*/, uint64_t /*tag*/, size_t /*len*/, Deadline /*until*/) {}

  // Closes the transport ahead of destruction. Every request still pending ends (kCancelled:
  // a receive got nothing, a send may or may not have been delivered) and no buffer given to
  // isend or irecv is read or written after close() returns, including the buffer of a
  // receive whose cancel() timed out and of a send that never completed. Completions that
  // arrive within a short drain (200 ms) are still reported. Afterwards isend/irecv throw
  // IoError and progress() does nothing. Idempotent. For an owner that must return
  // buffers it cannot otherwise get back (a failed collective, collectives/engine.cc).
  virtual void close() = 0;
  virtual bool closed() const = 0;

  // Memory that is reused across operations can be registered once (no-op where the provider
  // needs no registration). Unregistered buffers are registered on the fly and cached.
  virtual void register_memory(const void* /*ptr*/, size_t /*len*/) {}
  virtual void deregister_memory(const void* /*ptr*/) {}

  // Ranks that an error has concerned, sorted: a post the transport refused outright or a
  // completion error of a request to or from that rank (truncation included). Such an
  // error fails only its request (RequestState::kError, the message names the rank); the
  // endpoint and its traffic with other ranks go on. Cancellations mark no one, nor do
  // errors of any-peer receives (no source known). Called by the thread driving the endpoint.
  virtual std::vector<int> suspect_peers() const { return {}; }
  // `peer` said goodbye (kAnyPeer: this rank says goodbye to all): its connections may close
  // from now on, so an error with it is expected at the end of a job. Such an error still
  // fails its request and marks the peer suspect, but is logged at debug level, not as a
  // warning. reset_peer(peer) ends it for that peer. Called by the thread driving the endpoint.
  virtual void expect_departure(int /*peer*/) {}

  // ---- Ranks that come back (a restarted process, or one evicted while alive: docs/design.md,
  // "Rejoin"). Every rank has an incarnation, 0 at the job's start and one more each time the
  // rank starts again. Tags carry the generation of the pair (net/transport/tags.h), so a message of an
  // earlier incarnation never matches a receive of the new one.
  //
  // What this endpoint publishes for its peers (the value it stored in the rendezvous store at
  // creation; after reset_peer(p) this rank's entry for p may be new), and its incarnation.
  virtual std::string published_address() const { return {}; }
  virtual uint32_t incarnation() const { return 0; }
  // Forgets `peer`'s old incarnation and connects to the new one: every request to or from it
  // that is not done ends cancelled (sends the transport already has may still complete, and
  // their buffers must stay valid until they are done), its queued posts are dropped, it is no
  // longer suspect, and from now on its messages carry the generation (incarnation() +
  // `incarnation`) mod 16. `published` is what the peer published (its published_address()).
  // Throws ProtocolError for a malformed address, ConfigError for one of another provider or
  // setting, UsageError where the transport cannot replace a peer.
  virtual void reset_peer(int peer, const std::string& published, uint32_t incarnation);
  // A hint that `peer` left and may come back: the transport may make ready now what a later
  // reset_peer(peer) needs, so that the reconnection, which happens while the others train,
  // costs them less then (pairwise shm: a new endpoint, whose region takes tens of
  // milliseconds to set up on a virtual machine). Changes nothing a caller sees.
  virtual void prepare_reset_peer(int /*peer*/) {}
  // Whether `peer` can be reached. An endpoint created to join a running job starts with no
  // peer connected; posts to a peer that is not connected wait until reset_peer connects it.
  virtual bool connected(int /*peer*/) const { return true; }

  // ---- Waiting without polling (net/transport/doorbell.h). Where peers wake this endpoint when
  // they send to it or take its messages, wakes_on_traffic() is true: an idle caller takes
  // traffic_token() before its last progress(), and wait_traffic(token, max) blocks until
  // traffic (or wake()) came after the token, or `max` passed, and returns whether something
  // came. Elsewhere wait_traffic returns false at once and callers sleep as they did. A hint:
  // the caller polls after every wait, so a wake-up that never comes costs at most `max`.
  // These three may be called from any thread.
  virtual bool wakes_on_traffic() const { return false; }
  virtual uint32_t traffic_token() const { return 0; }
  virtual bool wait_traffic(uint32_t /*token*/, std::chrono::nanoseconds /*max*/) { return false; }
  // Ends a wait_traffic of another thread of this process (new work for it).
  virtual void wake() {}

  // Blocks cheaply (spin briefly, then yield, then sleep with backoff) until `req` is done or
  // the deadline passes. On expiry throws TimeoutError naming `what`, the peer and the wait.
  void wait(const RequestPtr& req, Deadline deadline, std::string_view what = {});
  void wait_all(std::span<const RequestPtr> reqs, Deadline deadline, std::string_view what = {});

  // Keeps `what` alive until this endpoint is destroyed. For the buffer of a send that may
  // never complete (its peer died or stopped) when the operation that owns it goes away: the
  // transport may read the buffer until the endpoint is closed, and it is freed after that
  // (the implementations close their transport in their own destructors, which run first).
  // Called by the thread driving the endpoint.
  void retain_until_closed(std::shared_ptr<const void> what) {
    retained_.push_back(std::move(what));
  }

 private:
  std::vector<std::shared_ptr<const void>> retained_;
};

// Spin-then-sleep waiting policy shared by every wait loop: cheap on oversubscribed nodes.
// 64 polls, then sched_yield until 512, then sleeps doubling from 1 us to 0.5 ms; after 50 ms
// without progress the sleeps keep doubling up to 4 ms, so a long wait costs ~250 wake-ups a
// second instead of ~2000.
class Backoff {
 public:
  // Call when a poll made no progress.
  void idle();
  // Call when a poll made progress.
  void reset() { idle_polls_ = 0; }
  // How long to sleep at this point of an idle stretch (0: do not sleep yet).
  std::chrono::nanoseconds next_sleep();

 private:
  uint32_t idle_polls_ = 0;
  Clock::time_point idle_since_{};
};

// Throws UsageError/ProtocolError for a failed request with a message naming `what`.
void throw_if_failed(const Request& req, std::string_view what);

}  // namespace qring::net
