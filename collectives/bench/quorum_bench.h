// qring-bench --op quorum (quorum_bench.cc): the quorum all-reduce timed step by step, on the
// harness of bench_common.h.
//
// For each size of the sweep, `--iters` timed steps of a QuorumAllreduce with the quorum
// `--quorum` (a count, a fraction or "auto"), grace `--grace-ms` and the straggler model
// `--straggler`; rank 0 (or, after --fault, the coordinator at the end) prints p50/p99/max
// latency, bus bandwidth, the mean number of contributors and the dropped and wrong counts,
// and with --compare-full / --compare-allreduce the same steps at quorum = world or as plain
// all-reduces beside them. Every result is checked bit-exactly against the reduction of the
// contributors' verifiable inputs.
//
// --fault kill:RANK:STEP[:PHASE] | stop:RANK:STEP:MS[:PHASE] (comma list;
// collectives/fault_inject.h) kills or stops a rank at timed step STEP of the first size. The
// loop goes on until the fault played out, the statistics are reduced among the live members
// only and the coordinator at the end reports the recovery (recovery_s, p50/p99 before the
// fault and after the recovery, the slowest step in between).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

#include "collectives/bench/bench_common.h"
#include "collectives/communicator.h"
#include "collectives/fault_inject.h"

namespace qring::bench {

struct QuorumOutcome {
  int64_t wrong = 0;
  bool writer = false;    // printed the rows: writes --json
  std::vector<int> lost;  // ranks lost (--fault)
};

// The faults of --fault for a world of `n` ranks (n = 0: the syntax only). ConfigError when
// the spec is malformed or names a rank outside the world.
std::vector<collectives::FaultSpec> bench_faults(const Options& o, int n);

// Runs --op quorum on `comm`, appending one JSON row per size (and per comparison) to `rows`.
QuorumOutcome run_quorum(collectives::Communicator& comm, const Options& o,
                         std::vector<nlohmann::json>& rows);

}  // namespace qring::bench
