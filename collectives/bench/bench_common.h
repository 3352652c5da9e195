// Shared by qring-bench and qring-mpi-bench (header-only; links nothing of qring): the
// command line, the nccl-tests style table, the JSON rows and the timed sweep over sizes,
// written once against a small backend interface so that both binaries measure exactly the
// same way. What differs per operation is its descriptor (ops.h).
//
// Conventions (nccl-tests, doc/PERFORMANCE.md):
//   size  = bytes of the largest buffer of the operation (all-gather: the gathered buffer,
//           reduce-scatter: the input buffer), count = size / element size;
//   time  = per rank the average time per iteration, in microseconds, then across ranks as
//           -a says: 1 (default) the mean, 3 the maximum, 2 the minimum, 0 rank 0's;
//   algbw = size / time (GB/s, GB = 1e9 bytes); busbw = algbw x factor, factor 2(n-1)/n for
//           all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for broadcast and
//           send/receive;
//   #wrong = elements that differ from the locally computed expectation, summed over ranks,
//           checked once after the timed loop on freshly initialized data;
//   algo  = the algorithm that ran (all-reduce: recursive doubling "rd", halving-doubling "hd"
//           or "ring", by size; qring-mpi-bench: "mpi"), the last column.
// Before the table, a line per rank: "#  Rank  R Pid P on HOST"; after it the footer
// "# Out of bounds values : N OK|FAILED" and "# Avg bus bandwidth    : X" (the mean busbw of
// every row, in-place and out-of-place).
//
// Data: collectives/verifiable.h (the pattern and checks the collective tests use too).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "collectives/bench/ops.h"
#include "collectives/types.h"
#include "collectives/verifiable.h"
#include "net/base/build_info.h"
#include "net/base/cli.h"
#include "net/base/error.h"

namespace qring::bench {

using collectives::DataType;
using collectives::RedOp;

// The header-only names and sizes of collectives/types.h.
inline std::string_view dtype_name(DataType t) { return collectives::to_string(t); }
inline size_t dtype_bytes(DataType t) { return collectives::dtype_size(t); }
inline std::string_view redop_name(RedOp op) { return collectives::to_string(op); }

// "4096", "4K", "1M", "2G" (powers of 2, case-insensitive, optional trailing "B"/"iB").
inline size_t parse_size(std::string_view s) {
  std::string_view orig = s;
  if (s.empty()) throw ConfigError("empty size");
  size_t mult = 1;
  auto strip = [&](std::string_view suffix) {
    if (s.size() > suffix.size()) {
      std::string tail(s.substr(s.size() - suffix.size()));
      for (char& c : tail) c = char(std::toupper(static_cast<unsigned char>(c)));
      if (tail == suffix) {
        s.remove_suffix(suffix.size());
        return true;
      }
    }
    return false;
  };
  if (!strip("IB")) strip("B");
  char last = char(std::toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K') mult = size_t(1) << 10;
  if (last == 'M') mult = size_t(1) << 20;
  if (last == 'G') mult = size_t(1) << 30;
  if (mult != 1) s.remove_suffix(1);
  if (s.empty()) throw ConfigError(fmt::format("bad size '{}'", orig));
  size_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') throw ConfigError(fmt::format("bad size '{}'", orig));
    if (v > (SIZE_MAX - size_t(c - '0')) / 10)
      throw ConfigError(fmt::format("size '{}' too large", orig));
    v = v * 10 + size_t(c - '0');
  }
  if (v > SIZE_MAX / mult) throw ConfigError(fmt::format("size '{}' too large", orig));
  return v * mult;
}

struct Options {
  BenchOp op = BenchOp::kAllreduce;
  size_t min_bytes = size_t(4) << 10;
  size_t max_bytes = size_t(16) << 20;
  size_t factor = 4;
  int iters = 20;
  int warmup = 5;
  bool check = true;
  DataType dtype = DataType::kFloat32;
  RedOp redop = RedOp::kSum;
  int root = 0;
  int average = 1;           // -a: time across ranks, 0 rank 0, 1 mean, 2 minimum, 3 maximum
  std::string provider;      // qring: empty = $QRING_PROVIDER or "auto"
  size_t segment_bytes = 0;  // qring: 0 = library default
  int inflight = 0;          // qring: 0 = library default
  int sends_inflight = 0;    // qring: 0 = library default
  std::optional<size_t> small_bytes;  // qring: unset = library default
  std::optional<size_t> hd_bytes;     // qring: unset = library default
  long timeout_ms = 60000;   // qring: deadline of every operation
  std::string json_path;
  double seconds = 10.0;           // --op idle
  double auto_seconds = 0;         // > 0: per size, as many iterations (<= -n) as fit this time
  bool idle_via_endpoint = false;  // --op idle: wait in Endpoint::wait, not in the engine
  bool spin = false;               // --op sendrecv: busy-poll instead of the endpoint's wait
  // qring: a rank waiting for its peers blocks on its shm doorbell until their traffic wakes
  // it (true, --wait block: qring.init(wait="block")) or polls, yields and sleeps (false).
  bool block = false;
  // --op quorum
  std::string quorum = "";  // count or fraction; empty = world size
  long grace_ms = 0;
  long deadline_ms = 30000;
  std::string straggler = "none";
  bool compare_full = false;
  bool compare_allreduce = false;
  uint64_t seed = 1;
  // --op quorum --fault: kill:RANK:STEP[:PHASE] | stop:RANK:STEP:MS[:PHASE], comma-separated
  // (collectives/fault_inject.h; parsed by qring-bench, which links it).
  std::string fault;
  long evict_ms = 0;  // quorum: silence that evicts a rank; 0 = 1000 with --fault, else 5000
};

// The prose of --help below the flags.
inline std::string help_footer(bool mpi) {
  std::string s =
      "Sizes take K/M/G suffixes (powers of 2). Columns as nccl-tests: time is each rank's\n"
      "average per iteration, then the mean over ranks (-a 3: the slowest rank's), algbw =\n"
      "size / time, busbw = algbw x the operation's bus factor, #wrong = elements that differ\n"
      "from the expected result; algo = the algorithm that ran. A line per rank (pid, host)\n"
      "before the table; after it \"# Out of bounds values\" (the #wrong total) and\n"
      "\"# Avg bus bandwidth\" (the mean busbw of all rows). --json is checked before the sweep.\n"
      "Exit status: 0 every result correct; 1 wrong results; 2 bad command line or --json\n"
      "path; 3 a runtime failure (a rank lost, a deadline passed)" +
      std::string(mpi ? ".\n" : "; 75 this rank was evicted\n(--op quorum --fault stop).\n");
  if (mpi) return s;
  return s +
         "sendrecv measures ping-pong between ranks 2i and 2i+1: time = round trip / 2 (as\n"
         "fi_pingpong's usec/xfer), bandwidth = size / time.\n"
         "quorum runs -n steps (after -w warm-up steps) per size; every rank sleeps its "
         "straggler\ndelay (stopping early once excluded), contributes, and waits. Step latency "
         "is the\nslowest rank's time from the start of its step to the end of its wait; the "
         "timed\nsteps read the result where it lies (QuorumAllreduce::View, no copy, as "
         "qring-train)\nand run back to back; with -c, up to 10 separate untimed steps (copied "
         "out) are\nchecked first.\n"
         "With --fault the timed loop goes on past -n until each fault has played out (a killed\n"
         "rank left the view; a stopped one has run again for max(500 ms, --evict-ms), so that\n"
         "an evicted one learns it and exits 75) and at least max(10, -n - STEP) steps ran "
         "after\nthe recovery. The row adds recovery_s (from the lost rank's last sign of life "
         "to the\nfirst step completed in the new view), p50/p99 before the fault and after the\n"
         "recovery, p50 and max of the steps in between, lost_ranks and skipped_steps. The\n"
         "coordinator at the end prints (rank 0 may be the victim). Ranks lost in the first\n"
         "size end the sweep there. Run it under qring-launch --tolerate-failures K (exit\n"
         "100 + lost ranks).\n"
         "idle posts a receive that never matches on every rank, waits --seconds, cancels it "
         "and\nprints the CPU time each rank used meanwhile.\n";
}

// Callbacks for CLI::Option::each that convert a flag's value into `out`: a size (parse_size),
// an integer in [lo, hi] named after `flag`.
inline auto size_of(size_t& out) {
  return [&out](const std::string& v) { out = parse_size(v); };
}
template <class T>
auto int_in(T& out, const char* flag, long lo, long hi) {
  return [&out, flag, lo, hi](const std::string& v) {
    out = static_cast<T>(cli::to_int(flag, v, lo, hi));
  };
}

// The flags qring-bench and qring-mpi-bench share (`mpi`: qring-mpi-bench).
inline void add_common_flags(CLI::App& app, Options& o, bool mpi) {
  using cli::to_int;
  cli::add_value(app, "--op",
                 mpi ? "allreduce|broadcast|allgather|reducescatter|barrier"
                     : "sendrecv|allreduce|broadcast|allgather|reducescatter|barrier|quorum|idle")
      ->each([&o, mpi](const std::string& v) {
        auto op = parse_op(v);
        if (!op) throw ConfigError(fmt::format("--op: unknown operation '{}'", v));
        if (mpi && op_desc(*op).qring_only)
          throw ConfigError(fmt::format("--op {} is not supported by the MPI benchmark", v));
        o.op = *op;
      });
  cli::add_value(app, "-b,--minbytes", "smallest size (default 4K)")->each(size_of(o.min_bytes));
  cli::add_value(app, "-e,--maxbytes", "largest size (default 16M)")->each(size_of(o.max_bytes));
  cli::add_value(app, "-f,--stepfactor", "size multiplier between rows (default 4)")
      ->each(
          [&o](const std::string& v) { o.factor = size_t(to_int("--stepfactor", v, 2, 1 << 20)); });
  cli::add_value(app, "-n,--iters", "timed iterations per size (default 20)")
      ->each(int_in(o.iters, "--iters", 1, 100'000'000));
  cli::add_value(app, "-w,--warmup_iters", "untimed iterations before (default 5)")
      ->each(int_in(o.warmup, "--warmup_iters", 0, 100'000'000));
  cli::add_value(app, "-c,--check",
                 "0|1: check results bit-exactly after the timed loop (default 1)")
      ->each([&o](const std::string& v) { o.check = to_int("--check", v, 0, 1) != 0; });
  cli::add_value(app, "--dtype",
                 mpi ? "float32|float64|int32|int64 (default float32)"
                     : "float32|float64|int32|int64|bfloat16 (default float32)")
      ->each([&o, mpi](const std::string& v) {
        auto t = collectives::parse_dtype(v);
        if (!t) throw ConfigError(fmt::format("--dtype: unknown type '{}'", v));
        if (mpi && *t == DataType::kBFloat16)
          throw ConfigError("--dtype bfloat16: MPI has no bfloat16 type");
        o.dtype = *t;
      });
  cli::add_value(app, "--redop", "sum|avg|min|max (default sum)")->each([&o](const std::string& v) {
    auto r = collectives::parse_redop(v);
    if (!r) throw ConfigError(fmt::format("--redop: unknown reduction '{}'", v));
    o.redop = *r;
  });
  cli::add_value(app, "--root", "broadcast root (default 0)")
      ->each(int_in(o.root, "--root", 0, 1 << 24));
  cli::add_value(app, "-a,--average",
                 "time across ranks, as nccl-tests: 0 rank 0's, 1 the mean (default), 2 the "
                 "minimum, 3 the maximum (the slowest rank)")
      ->each(int_in(o.average, "--average", 0, 3));
  cli::add_value(app, "--auto-iters",
                 "S: per size, run as many timed iterations (at most -n, at least 1) as fit in "
                 "about S seconds, judged from one probe iteration; warmup becomes min(-w, "
                 "iterations / 4)")
      ->each([&o](const std::string& v) {
        o.auto_seconds = cli::to_seconds("--auto-iters", v, 3600);
      });
  app.add_option("--json", o.json_path, "write every row as a JSON array (rank 0)");
}

// qring-bench's own flags; qring-mpi-bench registers them hidden and refuses them
// (check_options).
inline void add_qring_flags(CLI::App& app, Options& o, bool mpi) {
  using cli::to_int;
  const std::string group = mpi ? "" : "qring";  // "": hidden (refused by qring-mpi-bench)
  auto q = [&](CLI::Option* opt) { return opt->group(group); };
  q(app.add_option("--provider", o.provider,
                   "libfabric provider: auto|shm|tcp|... (default $QRING_PROVIDER or auto)"));
  q(cli::add_value(app, "--segment-bytes", "ring segment size (default: the library's)"))
      ->each([&o](const std::string& v) {
        o.segment_bytes = parse_size(v);
        if (o.segment_bytes == 0) throw ConfigError("--segment-bytes must be > 0");
      });
  q(cli::add_value(app, "--inflight", "segments in flight per link (default: the library's)"))
      ->each(int_in(o.inflight, "--inflight", 1, 1024));
  q(cli::add_value(app, "--sends-inflight",
                   "ring sends outstanding per link (default: the library's)"))
      ->each(int_in(o.sends_inflight, "--sends-inflight", 1, 1024));
  q(cli::add_value(app, "--small-bytes",
                   "all-reduces up to N bytes use recursive doubling (0: never; default: the "
                   "library's)"))
      ->each([&o](const std::string& v) { o.small_bytes = parse_size(v); });
  q(cli::add_value(app, "--hd-bytes",
                   "larger all-reduces up to N bytes use halving-doubling when the rank count is "
                   "a power of two (0: never; default: the library's)"))
      ->each([&o](const std::string& v) { o.hd_bytes = parse_size(v); });
  q(cli::add_value(app, "--timeout-ms", "deadline of every operation (default 60000)"))
      ->each(int_in(o.timeout_ms, "--timeout-ms", 1, 86'400'000));
  q(cli::add_value(app, "--seconds", "idle: how long every rank blocks in a receive (default 10)"))
      ->each([&o](const std::string& v) {
        o.seconds = cli::to_seconds("--seconds", v, 86400, /*zero_ok=*/true);
      });
  q(cli::add_value(app, "--wait",
                   "poll (spin, yield, sleep with backoff) or block (over shm, on the process's "
                   "doorbell until peers' traffic wakes it; elsewhere as poll), as "
                   "qring.init(wait=) (default poll)"))
      ->each([&o](const std::string& v) {
        if (v != "poll" && v != "block")
          throw ConfigError("--wait '" + v + "': expected poll or block");
        o.block = v == "block";
      });
  q(app.add_flag("--spin", o.spin,
                 "sendrecv: busy-poll the completion queue (as fi_pingpong) instead of the "
                 "endpoint's spin-yield-sleep wait"));
  q(app.add_option("--quorum", o.quorum,
                   "quorum: contributions per step, a count or a fraction of the world, or auto "
                   "(chosen per step from the arrivals, 1..world; docs/design.md) (default: all "
                   "ranks)"));
  q(cli::add_value(app, "--grace-ms",
                   "quorum: keep waiting G ms for more after the quorum (default 0)"))
      ->each(int_in(o.grace_ms, "--grace-ms", 0, 86'400'000));
  q(cli::add_value(app, "--deadline-ms", "quorum: hard deadline of a step (default 30000)"))
      ->each(int_in(o.deadline_ms, "--deadline-ms", 1, 86'400'000));
  q(app.add_option("--straggler", o.straggler,
                   "quorum: none|fixed:RANK:MS|exp:MEAN_MS|lognormal:MU:SIGMA|tail:P:MS|trace:FILE "
                   "(default none)"));
  q(app.add_flag("--compare-full", o.compare_full,
                 "quorum: also run the same steps with Q = world size and print the latency "
                 "ratio"));
  q(app.add_flag("--compare-allreduce", o.compare_allreduce,
                 "quorum: also run the same step loop with the plain in-place all-reduce instead "
                 "of the quorum op and print the ratio"));
  q(cli::add_value(app, "--seed", "quorum: seed of the straggler model (default 1)"))
      ->each([&o](const std::string& v) { o.seed = uint64_t(to_int("--seed", v, 0, INT64_MAX)); });
  q(cli::add_value(app, "--fault",
                   "quorum: a real fault in the timed loop: kill:RANK:STEP[:PHASE] (SIGKILL) or "
                   "stop:RANK:STEP:MS[:PHASE] (SIGSTOP, SIGCONT MS later); comma list allowed; "
                   "PHASE step (default), ready or ring; STEP counts the timed steps of the first "
                   "size only (use -b = -e). Needs a quorum below the world size; not with "
                   "--compare-*"))
      ->each([&o](const std::string& v) {
        if (v.empty()) throw ConfigError("--fault needs a spec (kill:RANK:STEP, ...)");
        o.fault = v;
      });
  q(cli::add_value(app, "--evict-ms",
                   "quorum: a rank silent N ms leaves the view (default 1000 with --fault, else "
                   "the library's 5000)"))
      ->each(int_in(o.evict_ms, "--evict-ms", 1, 86'400'000));
  q(cli::add_value(app, "--idle-via",
                   "idle: wait in the communicator's progress 'engine' (default) or in the raw "
                   "'endpoint' (Endpoint::wait)"))
      ->each([&o](const std::string& v) {
        if (v != "engine" && v != "endpoint")
          throw ConfigError(fmt::format("--idle-via: expected engine or endpoint, got '{}'", v));
        o.idle_via_endpoint = v == "endpoint";
      });
}

// Checks across flags, after parsing.
inline void check_options(const CLI::App& app, const Options& o, bool mpi) {
  if (mpi)
    for (const CLI::Option* opt : app.get_options())
      if (opt->get_group().empty() && opt->count() > 0)
        throw ConfigError(fmt::format("{} is not supported by the MPI benchmark", opt->get_name()));
  if (o.min_bytes > o.max_bytes)
    throw ConfigError(fmt::format("-b {} is larger than -e {}", o.min_bytes, o.max_bytes));
  if (!o.fault.empty()) {
    if (o.op != BenchOp::kQuorum)
      throw ConfigError(fmt::format("--fault is only valid with --op quorum (not --op {})",
                                    op_name(o.op)));
    if (o.compare_full || o.compare_allreduce)
      throw ConfigError(
          "--fault cannot be combined with --compare-full or --compare-allreduce (their steps "
          "need every rank)");
  }
}

// Parses the command line into `o`. Returns the exit status when the program ends here
// (--help: 0; a bad command line: 2, printed when `report`), else nullopt.
inline std::optional<int> parse_args(int argc, char** argv, bool mpi, Options& o,
                                     bool report = true) {
  const std::string prog = mpi ? "qring-mpi-bench" : "qring-bench";
  CLI::App app{"nccl-tests style benchmark (usage: " + prog + " --op OP [flags]).", prog};
  cli::init(app);
  app.footer(help_footer(mpi));
  add_common_flags(app, o, mpi);
  add_qring_flags(app, o, mpi);
  cli::ParseOptions po;
  po.check = [&] { check_options(app, o, mpi); };
  po.report = report;
  const int rc = cli::parse(app, cli::args_of(argc, argv), po);
  return rc >= 0 ? std::optional<int>(rc) : std::nullopt;
}

// ---------------------------------------------------------------- data

// The data pattern and its bit-exact checks, shared with the collective tests.
using verifiable::count_mismatches;
using verifiable::count_wrong_pattern;
using verifiable::count_wrong_reduced;
using verifiable::fill_garbage;
using verifiable::fill_pattern;
using verifiable::kPatternPeriod;
using verifiable::load_value;
using verifiable::pattern;
using verifiable::store_value;

// Page-aligned buffer.
struct AlignedBuffer {
  explicit AlignedBuffer(size_t bytes) : size(bytes) {
    size_t rounded = std::max<size_t>(4096, (bytes + 4095) / 4096 * 4096);
    ptr.reset(static_cast<unsigned char*>(std::aligned_alloc(4096, rounded)));
    if (!ptr) throw std::bad_alloc();
    std::memset(ptr.get(), 0, rounded);
  }
  unsigned char* data() { return ptr.get(); }
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> ptr;
  size_t size;
};

// ---------------------------------------------------------------- table and JSON

struct Measurement {
  bool in_place = false;
  double time_us = 0;
  double algbw = 0;
  double busbw = 0;
  int64_t wrong = -1;  // -1: not checked
  int iters = 0;       // timed iterations behind time_us
};

struct RowKey {
  size_t bytes = 0;
  size_t count = 0;           // total elements (size / element size)
  size_t count_per_rank = 0;  // elements each rank passes to the call
  int root = -1;
  std::string algo;           // the algorithm that ran (the last column)
};

// Who ran a benchmark: a rank, its process and its host (the block before the table).
struct RankInfo {
  int rank = 0;
  long pid = 0;
  std::string host;
};

// -a's name for the header line.
inline const char* average_name(int average) {
  switch (average) {
    case 0:
      return "rank 0's";
    case 2:
      return "the minimum over ranks";
    case 3:
      return "the maximum over ranks";
    default:
      return "the mean over ranks";
  }
}

// -a's name in the JSON rows (time_across_ranks).
inline const char* average_key(int average) {
  static const char* const names[] = {"rank0", "mean", "min", "max"};
  return names[average >= 0 && average <= 3 ? average : 1];
}

// The time a row reports from every rank's average per iteration (`per_rank`), as -a says.
inline double combine_times(const std::vector<double>& per_rank, int average) {
  if (per_rank.empty()) return 0;
  switch (average) {
    case 0:
      return per_rank.front();
    case 2:
      return *std::min_element(per_rank.begin(), per_rank.end());
    case 3:
      return *std::max_element(per_rank.begin(), per_rank.end());
    default: {
      double sum = 0;
      for (double t : per_rank) sum += t;
      return sum / double(per_rank.size());
    }
  }
}

// The provenance line and the rank block: "# PROGRAM VERSION (commit ...)" and, per rank,
// "#  Rank  R Pid P on HOST" (nccl-tests' block, without devices).
inline std::string rank_block(const std::string& program, const std::vector<RankInfo>& ranks) {
  std::string s = "# " + build::version_text(program) + "\n";
  for (const RankInfo& r : ranks)
    s += fmt::format("#  Rank {:>2} Pid {:>7} on {:>10}\n", r.rank, r.pid, r.host);
  return s;
}

// The footer after the table, nccl-tests' words: the #wrong total, and the mean busbw over
// `bw_rows` rows whose busbw sum is `bw_sum`.
inline std::string table_footer(int64_t wrong, double bw_sum, int bw_rows) {
  return fmt::format("# Out of bounds values : {} {}\n# Avg bus bandwidth    : {:.6g} \n#\n", wrong,
                     wrong == 0 ? "OK" : "FAILED", bw_rows > 0 ? bw_sum / bw_rows : 0.0);
}

// Every JSON row gets the binary's provenance (net/base/build_info.h) and the ranks' hosts.
inline void add_provenance(std::vector<nlohmann::json>& rows, const std::vector<RankInfo>& ranks) {
  nlohmann::json hosts = nlohmann::json::array();
  for (const RankInfo& r : ranks) hosts.push_back(r.host);
  for (auto& j : rows) {
    j["build"] = build::fields();
    j["hosts"] = hosts;
  }
}

inline std::string table_header(BenchOp op, const Options& o, int ranks,
                                const std::string& provider) {
  std::string s;
  s += fmt::format(
      "# {}: {} ranks, provider {}, dtype {}, redop {}, iters {}, warmup {}, check {}, time {}\n",
      op_name(op), ranks, provider, dtype_name(o.dtype),
      op_desc(op).reduces ? redop_name(o.redop) : std::string_view("none"), o.iters, o.warmup,
      o.check ? 1 : 0, average_name(o.average));
  if (op == BenchOp::kSendRecv)
    s += "# ping-pong between ranks 2i and 2i+1: time = round trip / 2 (fi_pingpong's "
         "usec/xfer), algbw = size / time\n";
  s += "#\n";
  s += fmt::format("# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>29}  {:>29}\n", "", "", "", "", "",
                   "out-of-place", "in-place");
  s += fmt::format(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9} {:>7} {:>7} {:>6}  {:>9} {:>7} "
      "{:>7} {:>6}  {}\n",
      "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
      "busbw", "#wrong", "algo");
  s += fmt::format(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9} {:>7} {:>7} {:>6}  {:>9} {:>7} "
      "{:>7} {:>6}\n",
      "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
      "");
  return s;
}

inline std::string format_measurement(const std::optional<Measurement>& m) {
  if (!m) return fmt::format("{:>9} {:>7} {:>7} {:>6}", "N/A", "N/A", "N/A", "N/A");
  return fmt::format("{:>9.2f} {:>7.3f} {:>7.3f} {:>6}", m->time_us, m->algbw, m->busbw,
                     m->wrong < 0 ? std::string("N/A") : std::to_string(m->wrong));
}

inline std::string format_row(const RowKey& k, std::string_view type, std::string_view redop,
                              const std::optional<Measurement>& oop,
                              const std::optional<Measurement>& ip) {
  return fmt::format("  {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {}  {}  {}\n", k.bytes, k.count, type,
                     redop, k.root, format_measurement(oop), format_measurement(ip),
                     k.algo.empty() ? "-" : k.algo);
}

struct JsonContext {
  std::string op;
  std::string dtype;
  std::string redop;
  int ranks = 0;
  std::string provider;
  int iters = 0;
  int warmup = 0;
  std::string average;  // -a, as the header says it
};

inline nlohmann::json json_row(const JsonContext& c, const RowKey& k, const Measurement& m) {
  nlohmann::json j;
  j["op"] = c.op;
  j["dtype"] = c.dtype;
  j["redop"] = c.redop;
  j["bytes"] = k.bytes;
  j["count"] = k.count;
  j["count_per_rank"] = k.count_per_rank;
  j["root"] = k.root;
  j["ranks"] = c.ranks;
  j["provider"] = c.provider;
  j["in_place"] = m.in_place;
  j["time_us"] = m.time_us;
  j["algbw_gbps"] = m.algbw;
  j["busbw_gbps"] = m.busbw;
  if (m.wrong < 0)
    j["wrong"] = nullptr;
  else
    j["wrong"] = m.wrong;
  j["iters"] = m.iters ? m.iters : c.iters;
  j["warmup"] = c.warmup;
  j["algorithm"] = k.algo;
  j["time_across_ranks"] = c.average;
  return j;
}

// Writes the rows as a JSON array, one object per line. Throws IoError when the file cannot be
// written.
inline void write_json(const std::string& path, const std::vector<nlohmann::json>& rows) {
  std::ofstream f(path, std::ios::trunc);
  if (!f) throw IoError(fmt::format("cannot open {} for writing: {}", path, std::strerror(errno)));
  f << "[\n";
  for (size_t i = 0; i < rows.size(); ++i)
    f << "  " << rows[i].dump() << (i + 1 < rows.size() ? ",\n" : "\n");
  f << "]\n";
  f.flush();
  if (!f) throw IoError(fmt::format("error writing {}", path));
}

// ---------------------------------------------------------------- the sweep

// Sizes -b, -b*f, ... up to -e.
inline std::vector<size_t> sweep_sizes(const Options& o) {
  std::vector<size_t> v;
  for (size_t s = o.min_bytes; s <= o.max_bytes; s *= o.factor) {
    v.push_back(s);
    if (s == 0) break;
    if (s > SIZE_MAX / o.factor) break;
  }
  return v;
}

// What the collective sweep needs from a library. Buffers are `count` elements per rank
// (allreduce, broadcast), or as nccl: all-gather recv and reduce-scatter send hold
// ranks() * count elements.
//
//   int rank(); int size(); std::string provider();
//   void barrier();
//   double reduce_over_ranks(double, RedOp);  int64_t sum_over_ranks(int64_t);
//   std::vector<RankInfo> rank_infos();  (every rank calls it; rank 0 gets the list)
//   std::string algorithm(BenchOp op, size_t bytes);  (the algo column)
//   void run(BenchOp op, const void* send, void* recv, size_t count, bool in_place);
//     in place: allreduce send == recv; broadcast buf == recv; all-gather input at
//     recv + rank*count; reduce-scatter input is the whole recv buffer, the result is at
//     recv + reduce_scatter_in_place_offset(count) elements.
//   size_t reduce_scatter_in_place_offset(size_t count);
//   void register_buffer(const void*, size_t);
template <class Backend>
class Sweep {
 public:
  Sweep(Backend& be, const Options& o) : be_(be), o_(o), desc_(op_desc(o.op)) {}

  // Runs every size; rank 0 prints the rank block, the table and its footer to stdout
  // (`program` names the binary in the block). Returns the total #wrong.
  int64_t run(const std::string& program) {
    const int n = be_.size();
    const bool print = be_.rank() == 0;
    if (desc_.rooted && (o_.root < 0 || o_.root >= n))
      throw ConfigError(fmt::format("--root {} out of range for {} ranks", o_.root, n));
    ctx_ = JsonContext{std::string(op_name(o_.op)),
                       std::string(dtype_name(o_.dtype)),
                       std::string(redop_name(o_.redop)),
                       n,
                       be_.provider(),
                       o_.iters,
                       o_.warmup,
                       average_key(o_.average)};
    ranks_ = be_.rank_infos();
    if (print) {
      std::fputs(rank_block(program, ranks_).c_str(), stdout);
      std::fputs(table_header(o_.op, o_, n, be_.provider()).c_str(), stdout);
    }
    const int64_t wrong = run_sizes();
    if (print) std::fputs(table_footer(wrong, bw_sum_, bw_rows_).c_str(), stdout);
    std::fflush(stdout);
    return wrong;
  }

  const std::vector<nlohmann::json>& rows() const { return rows_; }
  const std::vector<RankInfo>& ranks() const { return ranks_; }

 private:
  int64_t run_sizes() {
    const int n = be_.size();
    const bool print = be_.rank() == 0;
    const size_t ts = dtype_bytes(o_.dtype);
    if (!desc_.sized) {
      RowKey k;
      k.algo = be_.algorithm(o_.op, 0);
      Measurement m = time_op(0, 0, false, nullptr, nullptr);
      emit(k, "none", "none", m, std::nullopt);
      return 0;
    }
    const size_t max_bytes = o_.max_bytes;
    AlignedBuffer sbuf(max_bytes), rbuf(max_bytes);
    be_.register_buffer(sbuf.data(), sbuf.size);
    be_.register_buffer(rbuf.data(), rbuf.size);
    int64_t total_wrong = 0;
    for (size_t bytes : sweep_sizes(o_)) {
      RowKey k;
      k.count_per_rank = desc_.split ? bytes / (ts * size_t(n)) : bytes / ts;
      k.count = desc_.split ? k.count_per_rank * size_t(n) : k.count_per_rank;
      k.bytes = k.count * ts;
      k.root = desc_.rooted ? o_.root : -1;
      k.algo = be_.algorithm(o_.op, k.bytes);
      if (k.count_per_rank == 0) {
        if (print) std::printf("# %zu bytes: fewer than one element per rank, skipped\n", bytes);
        continue;
      }
      std::optional<Measurement> oop, ip;
      if (desc_.out_of_place) {
        oop = measure(k, false, sbuf.data(), rbuf.data());
        total_wrong += std::max<int64_t>(0, oop->wrong);
      }
      ip = measure(k, true, sbuf.data(), rbuf.data());
      total_wrong += std::max<int64_t>(0, ip->wrong);
      emit(k, dtype_name(o_.dtype), desc_.reduces ? redop_name(o_.redop) : "none", oop, ip);
    }
    return total_wrong;
  }

  void emit(const RowKey& k, std::string_view type, std::string_view redop,
            const std::optional<Measurement>& oop, const std::optional<Measurement>& ip) {
    if (be_.rank() != 0) return;
    std::fputs(format_row(k, type, redop, oop, ip).c_str(), stdout);
    std::fflush(stdout);
    for (const auto* m : {&oop, &ip}) {
      if (!*m) continue;
      rows_.push_back(json_row(ctx_, k, **m));
      bw_sum_ += (*m)->busbw;
      ++bw_rows_;
    }
  }

  // The call the sweep makes for row k, as the operation's init and check see it.
  Call call(const RowKey& k, bool in_place) {
    Call c;
    c.rank = be_.rank();
    c.n = be_.size();
    c.type = o_.dtype;
    c.op = o_.redop;
    c.root = o_.root;
    c.count = k.count_per_rank;
    c.in_place = in_place;
    c.rs_in_place_offset = be_.reduce_scatter_in_place_offset(k.count_per_rank);
    return c;
  }

  // Puts fresh input in place for one call.
  void prepare(const RowKey& k, bool in_place, unsigned char* s, unsigned char* r) {
    fill_garbage(r, k.bytes);
    if (desc_.init) desc_.init(call(k, in_place), s, r);
  }

  int64_t check(const RowKey& k, bool in_place, const unsigned char* r) {
    return desc_.check ? desc_.check(call(k, in_place), r) : 0;
  }

  Measurement time_op(size_t count, size_t bytes, bool in_place, const void* s, void* r) {
    int iters = o_.iters, warmup = o_.warmup;
    if (o_.auto_seconds > 0) {
      // One probe iteration (also a warmup); every rank derives the same count from the
      // slowest rank's probe.
      be_.barrier();
      auto p0 = std::chrono::steady_clock::now();
      be_.run(o_.op, s, r, count, in_place);
      double probe = be_.reduce_over_ranks(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count(),
          RedOp::kMax);
      double fit = probe > 0 ? o_.auto_seconds / probe : double(o_.iters);
      iters = int(std::clamp(fit, 1.0, double(o_.iters)));
      warmup = std::min(o_.warmup, iters / 4);
    }
    for (int i = 0; i < warmup; ++i) be_.run(o_.op, s, r, count, in_place);
    be_.barrier();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) be_.run(o_.op, s, r, count, in_place);
    auto t1 = std::chrono::steady_clock::now();
    double local_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
    Measurement m;
    m.in_place = in_place;
    m.iters = iters;
    m.time_us = across_ranks(local_us);
    m.algbw = m.time_us > 0 ? double(bytes) / (m.time_us * 1e-6) / 1e9 : 0.0;
    m.busbw = m.algbw * bus_factor(o_.op, be_.size());
    return m;
  }

  // A rank's time as the row reports it (-a): every rank calls this with its own.
  double across_ranks(double local_us) {
    switch (o_.average) {
      case 0:
        return be_.reduce_over_ranks(be_.rank() == 0 ? local_us : 0.0, RedOp::kSum);
      case 2:
        return be_.reduce_over_ranks(local_us, RedOp::kMin);
      case 3:
        return be_.reduce_over_ranks(local_us, RedOp::kMax);
      default:
        return be_.reduce_over_ranks(local_us, RedOp::kSum) / double(be_.size());
    }
  }

  Measurement measure(const RowKey& k, bool in_place, unsigned char* s, unsigned char* r) {
    prepare(k, in_place, s, r);
    be_.barrier();
    Measurement m = time_op(k.count_per_rank, k.bytes, in_place, s, r);
    if (o_.check) {
      prepare(k, in_place, s, r);
      be_.barrier();
      be_.run(o_.op, s, r, k.count_per_rank, in_place);
      m.wrong = be_.sum_over_ranks(check(k, in_place, r));
    }
    return m;
  }

  Backend& be_;
  const Options& o_;
  const OpDesc& desc_;
  JsonContext ctx_;
  std::vector<nlohmann::json> rows_;
  std::vector<RankInfo> ranks_;
  double bw_sum_ = 0;  // busbw of the rows printed, for the footer
  int bw_rows_ = 0;
};

}  // namespace qring::bench
