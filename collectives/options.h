// The settings of a communicator (CommOptions) and the time it reads. Below the engine and the
// communicator: both include it, neither includes the other for it.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>

#include "collectives/clock.h"

namespace qring::collectives {

struct CommOptions {
  // Default deadline of each operation, measured from its submission.
  std::chrono::milliseconds timeout{60000};
  // Segment size in bytes (the unit of the ring, halving-doubling and broadcast messages);
  // 0 = by transport: 2 MiB where the host copies the bytes (net::TransportTraits: shm, tcp),
  // 1 MiB on others (algorithms.cc). Tests set it tiny to cover many segments.
  size_t segment_bytes = 0;
  // Segments in flight per link (the ring's lanes; qring-bench --inflight); 0 = by transport
  // (1 where the host copies, 4 on others).
  int segments_in_flight = 0;
  // Ring sends posted and not yet completed per link; further segments wait for the oldest
  // send to complete. 0 = 1 where the host copies (shm, tcp) and it has more ranks than cores (a
  // send posted while the receiver still copies only costs cycles: shm senders spin on the
  // receiver's region lock), unlimited otherwise (algorithms.cc).
  int sends_in_flight = 0;
  // All-reduces up to this size use recursive doubling (log2 n rounds). 0: never. Unset:
  // 32 KiB (algorithms.h).
  std::optional<size_t> small_allreduce_bytes;
  // Larger all-reduces up to this size use Rabenseifner's halving-doubling (2 log2 n steps,
  // bandwidth-optimal like the ring) when the number of ranks is a power of two; above it,
  // and for other rank counts, the ring. 0: never. Unset: 1 MiB (algorithms.h).
  std::optional<size_t> halving_doubling_bytes;
  // Threads for reduction kernels on large segments (0 = hardware threads / local ranks).
  int reduce_threads = 0;
  // Ranks sharing this host (used by reduce_threads = 0).
  int local_size = 1;
  // The time of everything above the endpoint (collectives/clock.h); null: the steady clock.
  // Tests pass a VirtualClock (collectives/virtual_clock.h) to run protocols on virtual time.
  std::shared_ptr<TimeSource> clock;
};

}  // namespace qring::collectives
