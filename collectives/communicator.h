// collectives::Communicator — owns an endpoint, the ring order and one progress engine
// thread that runs every protocol, so collectives progress while the caller computes.
//
// A communicator is used by one thread at a time; several communicators per process are fine.
// Usage (all ranks call collectives in the same order):
//   Communicator comm(std::move(endpoint), opts);
//   comm.allreduce(send, recv, count, DataType::kFloat32, RedOp::kSum);   // blocking
//   auto w = comm.allreduce_async(...); ...; w->wait();                     // non-blocking
//
// Creation is collective: every rank sends the settings that must match (settings_text) to
// every other and waits up to CommOptions::timeout for theirs; a difference is a ConfigError
// naming both ranks and the setting. A rank that joins a running job (its endpoint's
// incarnation() > 0, no peer connected yet) skips the exchange; the quorum all-reduce's join
// compares the same settings with every member it connects to (quorum.h).
//
// Deadlines: every operation has one (CommOptions::timeout unless given). On expiry the op
// fails with CollectiveTimeout naming the operation, its sequence number, the peer it waited
// on and for how long; the communicator is then broken and refuses further operations.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "collectives/options.h"
#include "collectives/types.h"
#include "collectives/work.h"
#include "net/base/error.h"
#include "net/transport/endpoint.h"

namespace qring::collectives {

class Engine;
class EngineOp;

class Communicator {
 public:
  Communicator(std::unique_ptr<net::Endpoint> endpoint, CommOptions opts = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string provider() const;
  const CommOptions& options() const { return opts_; }
  bool broken() const;

  // recv may equal send (in place). count in elements. Buffers must stay valid until done.
  // `members` (sorted ranks, this one among them; empty = every rank) runs the collective
  // among those ranks only: the live members of a quorum all-reduce's view after a loss.
  WorkPtr allreduce_async(const void* send, void* recv, size_t count, DataType type, RedOp op,
                          const std::vector<int>& members = {});
  // Every rank's `count` elements from `send` land at recv[rank * count]; with `members`,
  // member i's land at recv[i * count].
  WorkPtr allgather_async(const void* send, void* recv, size_t count, DataType type,
                          const std::vector<int>& members = {});
  // send holds size()*count elements; rank r receives the reduction of block r into recv.
  WorkPtr reduce_scatter_async(const void* send, void* recv, size_t count, DataType type, RedOp op);
  WorkPtr broadcast_async(void* buf, size_t count, DataType type, int root);
  WorkPtr barrier_async();

  // Blocking forms: the calling thread drives the operation itself (no hand-off to the
  // engine thread unless it takes long).
  void allreduce(const void* send, void* recv, size_t count, DataType type, RedOp op,
                 const std::vector<int>& members = {}) {
    caller_drives_ = true;
    allreduce_async(send, recv, count, type, op, members)->wait();
  }
  void allgather(const void* send, void* recv, size_t count, DataType type,
                 const std::vector<int>& members = {}) {
    caller_drives_ = true;
    allgather_async(send, recv, count, type, members)->wait();
  }
  void reduce_scatter(const void* send, void* recv, size_t count, DataType type, RedOp op) {
    caller_drives_ = true;
    reduce_scatter_async(send, recv, count, type, op)->wait();
  }
  void broadcast(void* buf, size_t count, DataType type, int root) {
    caller_drives_ = true;
    broadcast_async(buf, count, type, root)->wait();
  }
  void barrier() {
    caller_drives_ = true;
    barrier_async()->wait();
  }

  // Registers a buffer that will be reused across calls (no-op where not needed).
  void register_buffer(const void* ptr, size_t bytes);

  // For protocols built on the engine (quorum all-reduce): submit an op.
  WorkPtr submit(std::unique_ptr<EngineOp> op);
  // Next sequence number for a collective (identical on every rank that calls in order).
  uint32_t next_seq() { return seq_++; }
  Engine& engine() { return *engine_; }

  // The settings that must be equal on every rank, "key=value" lines: protocol versions,
  // provider, message size limit, algorithm thresholds, segment size, build id, kernel ISA.
  // The constructor exchanges them with every rank and fails with a ConfigError naming both
  // ranks and the setting when they differ.
  static std::string settings_text(const net::Endpoint& ep, const CommOptions& opts);
  // The first setting in which two settings_text()s differ, as "key is 'a' ... 'b'"; empty
  // when they agree. `mine_rank` and `their_rank` name them in the text.
  static std::string settings_difference(const std::string& mine, int mine_rank,
                                         const std::string& theirs, int their_rank);

 private:
  static void check_settings(net::Endpoint& ep, const CommOptions& opts);
  int rank_;
  int size_;
  CommOptions opts_;
  uint32_t seq_ = 0;
  bool caller_drives_ = false;  // the next submission is waited for at once by its caller
  std::unique_ptr<Engine> engine_;
};

}  // namespace qring::collectives
