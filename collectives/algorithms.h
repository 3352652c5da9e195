// The collective algorithms as engine operations: the ring (reduce-scatter, all-gather and
// large all-reduces), recursive doubling and halving-doubling (smaller all-reduces) and the
// broadcast (the barrier: barrier.cc). make_collective_op picks among them (below).
//
// The buffer of `count` elements is cut into n = ranks chunks, balanced: the first count % n
// chunks get one element more. Worked example, n = 3, rank r sends right to r+1 and receives
// from r-1 (c0, c1, c2 are chunks; "+" marks a reduction):
//
//   reduce-scatter, stage s: send chunk (r - s), receive chunk (r - s - 1) and reduce it
//     s=0: r0 sends c0 → r1 (c0 = a0+b0 at r1);  r1 sends c1 → r2;  r2 sends c2 → r0
//     s=1: r1 sends c0 → r2 (c0 = a0+b0+c0 complete at r2); r2: c1 complete at r0; r0: c2 at r1
//   all-gather, stage s: send chunk (r + 1 - s), receive chunk (r - s) and copy it
//     after n-1 stages every rank holds every complete chunk.
//
// Each chunk is cut into segments of CommOptions::segment_bytes (by transport: 2 MiB where the
// host copies the bytes, shm and tcp, 1 MiB elsewhere); segment j of every chunk forms a lane
// that walks through the 2(n-1) stages on its own, and up to CommOptions::segments_in_flight
// lanes run at once (1 where the host copies, 4 elsewhere), so transfers and reductions of
// different segments overlap. Out of place, a received segment lands directly in the output and is
// reduced with the local input there; in place it lands in engine scratch memory first.
#pragma once

#include <memory>
#include <vector>

#include "collectives/engine.h"
#include "collectives/types.h"

namespace qring::collectives {

enum class CollKind { kAllreduce, kReduceScatter, kAllgather };

struct CollArgs {
  CollKind kind = CollKind::kAllreduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // allreduce: elements; allgather/reduce-scatter: elements per rank
  DataType type = DataType::kFloat32;
  RedOp op = RedOp::kSum;
  net::Op tag_op = net::Op::kAllreduce;
  // Ranks forming the ring, in ring order; empty = every rank in rank order. The quorum
  // all-reduce runs the ring among its contributors only.
  std::vector<int> members;
};

// All-reduce algorithm by size (CommOptions; the defaults' measurements: docs/benchmarks.md):
// recursive doubling up to small_allreduce_bytes, then halving-doubling up to
// halving_doubling_bytes when the ring has a power-of-two size, then the ring. The choice
// does not depend on the provider, so the same job gives the same bits over shm and tcp.
// Reduce-scatter and all-gather always use the ring.
constexpr size_t kSmallAllreduceBytes = 32 * 1024;
constexpr size_t kHalvingDoublingBytes = size_t(1) << 20;
size_t small_allreduce_bytes(const CommOptions& opts);
size_t halving_doubling_bytes(const CommOptions& opts);
// The all-reduce algorithm of that rule for `bytes` on `n` ranks: "rd" (recursive doubling),
// "hd" (halving-doubling) or "ring" (qring-bench's algo column).
const char* allreduce_algorithm(const CommOptions& opts, size_t bytes, size_t n);
// The segment size in force (CommOptions::segment_bytes, or by the transport's traits).
size_t segment_bytes(const CommOptions& opts, const net::TransportTraits& traits);
std::unique_ptr<EngineOp> make_collective_op(Engine& engine, const CommOptions& opts,
                                             const CollArgs& args);
std::unique_ptr<EngineOp> make_broadcast_op(Engine& engine, const CommOptions& opts, void* buf,
                                            size_t count, DataType type, int root);
std::unique_ptr<EngineOp> make_barrier_op(Engine& engine);

// Rank (or chunk) `a` of a ring of n, wrapped into [0, n): a may be negative.
inline int ring_index(int a, int n) { return ((a % n) + n) % n; }

// Balanced chunking: the first len % n chunks get one element more.
inline size_t chunk_offset(size_t len, int n, int c) {
  size_t base = len / size_t(n), extra = len % size_t(n);
  return size_t(c) * base + std::min(size_t(c), extra);
}
inline size_t chunk_length(size_t len, int n, int c) {
  return len / size_t(n) + (size_t(c) < len % size_t(n) ? 1 : 0);
}

}  // namespace qring::collectives
