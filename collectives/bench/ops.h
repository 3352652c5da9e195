// The operations of qring-bench and qring-mpi-bench, one descriptor each (nccl-tests'
// `struct testColl` in src/common.h): its name, how a row's size becomes a count, whether it
// reduces, its bus factor, how one call's input is initialized and how its result is checked.
// The benchmarks' sweep (bench_common.h) reads these instead of switching on the operation;
// what a library call is stays with each backend (qring_bench.cc, mpi_bench.cc).
//
// Header-only, like bench_common.h: qring-mpi-bench links nothing of qring.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "collectives/types.h"
#include "collectives/verifiable.h"

namespace qring::bench {

using collectives::DataType;
using collectives::RedOp;

enum class BenchOp {
  kSendRecv,
  kAllreduce,
  kBroadcast,
  kAllgather,
  kReduceScatter,
  kBarrier,
  kQuorum,
  kIdle
};

// One call of a collective in the sweep, as init() and check() see it. Buffers are `count`
// elements per rank (all-reduce, broadcast), or as nccl: all-gather recv and reduce-scatter
// send hold n * count elements.
struct Call {
  int rank = 0;
  int n = 0;
  DataType type = DataType::kFloat32;
  RedOp op = RedOp::kSum;
  int root = 0;
  size_t count = 0;  // elements each rank passes to the call
  bool in_place = false;
  // Reduce-scatter in place: where the result starts in recv, in elements (the backend's).
  size_t rs_in_place_offset = 0;

  size_t type_size() const { return collectives::dtype_size(type); }
};

struct OpDesc {
  BenchOp op;
  std::string_view name;
  bool qring_only = false;   // sendrecv, quorum, idle: not in qring-mpi-bench
  bool reduces = false;      // the table names the reduction (else "none")
  bool split = false;        // a row's size is the whole buffer: count per rank = size / n
  bool rooted = false;       // has a root (--root; the table's root column)
  bool out_of_place = true;  // measured out of place too (broadcast: in place only)
  bool sized = true;         // rows per size (barrier: one row, no data)
  double (*bus_factor)(int n) = nullptr;
  // Puts one call's input in place (the sweep filled recv with garbage before). nullptr:
  // the operation moves no data (barrier) or is not part of the sweep.
  void (*init)(const Call& c, unsigned char* send, unsigned char* recv) = nullptr;
  // Elements of the result that differ from the expectation (nullptr: nothing to check).
  int64_t (*check)(const Call& c, const unsigned char* recv) = nullptr;
};

namespace ops {

inline double factor_one(int) {
  return 1.0;
}
// nccl-tests: all-reduce moves 2(n-1)/n of the buffer over the busiest link.
inline double factor_allreduce(int n) {
  return n > 0 ? 2.0 * (n - 1) / n : 0.0;
}
// All-gather and reduce-scatter: (n-1)/n.
inline double factor_gather(int n) {
  return n > 0 ? double(n - 1) / n : 0.0;
}

inline void allreduce_init(const Call& c, unsigned char* s, unsigned char* r) {
  verifiable::fill_pattern(c.in_place ? r : s, c.type, c.count, 0, c.rank);
}
inline int64_t allreduce_check(const Call& c, const unsigned char* r) {
  return verifiable::count_wrong_reduced(r, c.type, c.count, 0, c.n, c.op);
}

inline void broadcast_init(const Call& c, unsigned char*, unsigned char* r) {
  if (c.rank == c.root) verifiable::fill_pattern(r, c.type, c.count, 0, c.rank);
}
inline int64_t broadcast_check(const Call& c, const unsigned char* r) {
  return verifiable::count_wrong_pattern(r, c.type, c.count, 0, c.root);
}

// Rank q's block of the gathered buffer holds pattern(j, q) at its global index j.
inline void allgather_init(const Call& c, unsigned char* s, unsigned char* r) {
  const size_t first = size_t(c.rank) * c.count;
  verifiable::fill_pattern(c.in_place ? r + first * c.type_size() : s, c.type, c.count, first,
                           c.rank);
}
inline int64_t allgather_check(const Call& c, const unsigned char* r) {
  int64_t w = 0;
  for (int src = 0; src < c.n; ++src) {
    const size_t first = size_t(src) * c.count;
    w += verifiable::count_wrong_pattern(r + first * c.type_size(), c.type, c.count, first, src);
  }
  return w;
}

inline void reducescatter_init(const Call& c, unsigned char* s, unsigned char* r) {
  verifiable::fill_pattern(c.in_place ? r : s, c.type, c.count * size_t(c.n), 0, c.rank);
}
// This rank's block: the reduction of elements rank * count ... of every rank's input.
inline int64_t reducescatter_check(const Call& c, const unsigned char* r) {
  const size_t off = c.in_place ? c.rs_in_place_offset : 0;
  return verifiable::count_wrong_reduced(r + off * c.type_size(), c.type, c.count,
                                         size_t(c.rank) * c.count, c.n, c.op);
}

// In the order --op lists them.
inline constexpr std::array<OpDesc, 8> kAll = {{
    {.op = BenchOp::kSendRecv, .name = "sendrecv", .qring_only = true, .bus_factor = factor_one},
    {.op = BenchOp::kAllreduce,
     .name = "allreduce",
     .reduces = true,
     .bus_factor = factor_allreduce,
     .init = allreduce_init,
     .check = allreduce_check},
    {.op = BenchOp::kBroadcast,
     .name = "broadcast",
     .rooted = true,
     .out_of_place = false,
     .bus_factor = factor_one,
     .init = broadcast_init,
     .check = broadcast_check},
    {.op = BenchOp::kAllgather,
     .name = "allgather",
     .split = true,
     .bus_factor = factor_gather,
     .init = allgather_init,
     .check = allgather_check},
    {.op = BenchOp::kReduceScatter,
     .name = "reducescatter",
     .reduces = true,
     .split = true,
     .bus_factor = factor_gather,
     .init = reducescatter_init,
     .check = reducescatter_check},
    {.op = BenchOp::kBarrier, .name = "barrier", .sized = false, .bus_factor = factor_one},
    // The quorum all-reduce moves what the all-reduce moves.
    {.op = BenchOp::kQuorum,
     .name = "quorum",
     .qring_only = true,
     .reduces = true,
     .bus_factor = factor_allreduce},
    {.op = BenchOp::kIdle, .name = "idle", .qring_only = true, .bus_factor = factor_one},
}};

}  // namespace ops

inline const OpDesc& op_desc(BenchOp op) {
  for (const OpDesc& d : ops::kAll)
    if (d.op == op) return d;
  return ops::kAll[0];  // unreachable: every BenchOp has a descriptor
}

inline std::string_view op_name(BenchOp op) {
  return op_desc(op).name;
}

inline std::optional<BenchOp> parse_op(std::string_view s) {
  for (const OpDesc& d : ops::kAll)
    if (s == d.name) return d.op;
  return std::nullopt;
}

inline double bus_factor(BenchOp op, int n) {
  return op_desc(op).bus_factor(n);
}

}  // namespace qring::bench
