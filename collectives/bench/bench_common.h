// Shared by qring-bench and qring-mpi-bench (header-only; links nothing of qring): the
// command line, the data pattern and its bit-exact check, the nccl-tests style table, the JSON
// rows and the timed sweep over sizes, written once against a small backend interface so that
// both binaries measure exactly the same way.
//
// Conventions (nccl-tests, doc/PERFORMANCE.md):
//   size  = bytes of the largest buffer of the operation (all-gather: the gathered buffer,
//           reduce-scatter: the input buffer), count = size / element size;
//   time  = the slowest rank's average time per iteration, in microseconds;
//   algbw = size / time (GB/s, GB = 1e9 bytes); busbw = algbw x factor, factor 2(n-1)/n for
//           all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for broadcast and
//           send/receive;
//   #wrong = elements that differ from the locally computed expectation, summed over ranks,
//           checked once after the timed loop on freshly initialized data.
//
// Data: element j of rank r's input is pattern(j, r) = ((7j + 13r) mod 17) - 8, a small integer,
// so sums over up to 32 ranks are exact in every type (bfloat16 included) and results can be
// compared bit for bit.
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
#include <vector>

#include "collectives/types.h"
#include "net/error.h"

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

inline std::string_view op_name(BenchOp op) {
  switch (op) {
    case BenchOp::kSendRecv:
      return "sendrecv";
    case BenchOp::kAllreduce:
      return "allreduce";
    case BenchOp::kBroadcast:
      return "broadcast";
    case BenchOp::kAllgather:
      return "allgather";
    case BenchOp::kReduceScatter:
      return "reducescatter";
    case BenchOp::kBarrier:
      return "barrier";
    case BenchOp::kQuorum:
      return "quorum";
    case BenchOp::kIdle:
      return "idle";
  }
  return "?";
}

inline std::optional<BenchOp> parse_op(std::string_view s) {
  for (BenchOp op :
       {BenchOp::kSendRecv, BenchOp::kAllreduce, BenchOp::kBroadcast, BenchOp::kAllgather,
        BenchOp::kReduceScatter, BenchOp::kBarrier, BenchOp::kQuorum, BenchOp::kIdle}) {
    if (s == op_name(op)) return op;
  }
  return std::nullopt;
}

// The header-only names and sizes of collectives/types.h.
inline std::string_view dtype_name(DataType t) { return collectives::to_string(t); }
inline size_t dtype_bytes(DataType t) { return collectives::dtype_size(t); }
inline std::string_view redop_name(RedOp op) { return collectives::to_string(op); }
inline std::optional<DataType> parse_dtype_name(std::string_view s) {
  if (s == "float32" || s == "float" || s == "f32") return DataType::kFloat32;
  if (s == "float64" || s == "double" || s == "f64") return DataType::kFloat64;
  if (s == "int32") return DataType::kInt32;
  if (s == "int64") return DataType::kInt64;
  if (s == "bfloat16" || s == "bf16") return DataType::kBFloat16;
  return std::nullopt;
}
inline std::optional<RedOp> parse_redop_name(std::string_view s) {
  if (s == "sum") return RedOp::kSum;
  if (s == "avg") return RedOp::kAvg;
  if (s == "min") return RedOp::kMin;
  if (s == "max") return RedOp::kMax;
  return std::nullopt;
}

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

inline long parse_int(std::string_view flag, std::string_view s, long lo, long hi) {
  std::string str(s);
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(str.c_str(), &end, 10);
  if (str.empty() || *end != '\0' || errno != 0 || v < lo || v > hi)
    throw ConfigError(
        fmt::format("{}: expected an integer in [{}, {}], got '{}'", flag, lo, hi, s));
  return v;
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
  bool help = false;
};

inline std::string usage(std::string_view prog, bool mpi) {
  std::string s = fmt::format(
      "Usage: {} --op OP [flags]\n"
      "  --op {}\n"
      "  -b, --minbytes N     smallest size (K/M/G suffixes, powers of 2; default 4K)\n"
      "  -e, --maxbytes N     largest size (default 16M)\n"
      "  -f, --stepfactor N   size multiplier between rows (default 4)\n"
      "  -n, --iters N        timed iterations per size (default 20)\n"
      "  -w, --warmup_iters N untimed iterations before (default 5)\n"
      "  -c, --check 0|1      check results bit-exactly after the timed loop (default 1)\n"
      "  --dtype T            float32|float64|int32|int64{} (default float32)\n"
      "  --redop R            sum|avg|min|max (default sum)\n"
      "  --root R             broadcast root (default 0)\n"
      "  --auto-iters S       per size, run as many timed iterations (at most -n, at least 1)\n"
      "                       as fit in about S seconds, judged from one probe iteration;\n"
      "                       warmup becomes min(-w, iterations / 4)\n"
      "  --json FILE          write every row as a JSON array (rank 0)\n",
      prog,
      mpi ? "allreduce|broadcast|allgather|reducescatter|barrier"
          : "sendrecv|allreduce|broadcast|allgather|reducescatter|barrier|quorum|idle",
      mpi ? "" : "|bfloat16");
  if (!mpi) {
    s +=
        "  --provider P         libfabric provider: auto|shm|tcp|... (default $QRING_PROVIDER or "
        "auto)\n"
        "  --segment-bytes N    ring segment size (default: the library's)\n"
        "  --inflight N         segments in flight per link (default: the library's)\n"
        "  --sends-inflight N   ring sends outstanding per link (default: the library's)\n"
        "  --small-bytes N      all-reduces up to N bytes use recursive doubling (0: never;\n"
        "                       default: the library's)\n"
        "  --hd-bytes N         larger all-reduces up to N bytes use halving-doubling when\n"
        "                       the rank count is a power of two (0: never; default: the\n"
        "                       library's)\n"
        "  --timeout-ms N       deadline of every operation (default 60000)\n"
        "  --seconds S          --op idle: how long every rank blocks in a receive (default 10)\n"
        "  --spin               sendrecv: busy-poll the completion queue (as fi_pingpong) instead\n"
        "                       of the endpoint's spin-yield-sleep wait\n"
        "sendrecv measures ping-pong between ranks 2i and 2i+1: time = round trip / 2 (as\n"
        "fi_pingpong's usec/xfer), bandwidth = size / time.\n"
        "  --quorum Q           quorum: contributions per step, a count or a fraction of the\n"
        "                       world, or auto (chosen per step from the arrivals, 1..world;\n"
        "                       docs/design.md) (default: all ranks)\n"
        "  --grace-ms G         quorum: keep waiting G ms for more after the quorum (default 0)\n"
        "  --deadline-ms H      quorum: hard deadline of a step (default 30000)\n"
        "  --straggler SPEC     quorum: none|fixed:RANK:MS|exp:MEAN_MS|lognormal:MU:SIGMA|\n"
        "                       tail:P:MS|trace:FILE (default none)\n"
        "  --compare-full       quorum: also run the same steps with Q = world size and print\n"
        "                       the latency ratio\n"
        "  --compare-allreduce  quorum: also run the same step loop with the plain in-place\n"
        "                       all-reduce instead of the quorum op and print the ratio\n"
        "  --seed N             quorum: seed of the straggler model (default 1)\n"
        "  --fault SPEC         quorum: a real fault in the timed loop: kill:RANK:STEP[:PHASE]\n"
        "                       (SIGKILL) or stop:RANK:STEP:MS[:PHASE] (SIGSTOP, SIGCONT MS\n"
        "                       later); comma list allowed; PHASE step (default), ready or\n"
        "                       ring; STEP counts the timed steps of the first size only (use\n"
        "                       -b = -e). Needs a quorum below the world size; not with\n"
        "                       --compare-*\n"
        "  --evict-ms N         quorum: a rank silent N ms leaves the view (default 1000 with\n"
        "                       --fault, else the library's 5000)\n"
        "quorum runs -n steps (after -w warm-up steps) per size; every rank sleeps its straggler\n"
        "delay (stopping early once excluded), contributes, and waits. Step latency is the\n"
        "slowest rank's time from the start of its step to the end of its wait; the timed\n"
        "steps read the result where it lies (QuorumAllreduce::View, no copy, as qring-train)\n"
        "and run back to back; with -c, up to 10 separate untimed steps (copied out) are\n"
        "checked first.\n"
        "With --fault the timed loop goes on past -n until each fault has played out (a killed\n"
        "rank left the view; a stopped one has run again for max(500 ms, --evict-ms), so that\n"
        "an evicted one learns it and exits 75) and at least max(10, -n - STEP) steps ran after\n"
        "the recovery. The row adds recovery_s (from the lost rank's last sign of life to the\n"
        "first step completed in the new view), p50/p99 before the fault and after the\n"
        "recovery, p50 and max of the steps in between, lost_ranks and skipped_steps. The\n"
        "coordinator at the end prints (rank 0 may be the victim). Ranks lost in the first\n"
        "size end the sweep there. Run it under qring-launch --tolerate-failures K (exit\n"
        "100 + lost ranks).\n"
        "  --idle-via W         idle: wait in the communicator's progress 'engine' (default) or\n"
        "                       in the raw 'endpoint' (Endpoint::wait)\n"
        "idle posts a receive that never matches on every rank, waits --seconds, cancels it and\n"
        "prints the CPU time each rank used meanwhile.\n";
  }
  return s;
}

// Throws ConfigError with a message naming the flag.
inline Options parse_args(int argc, char** argv, bool mpi) {
  Options o;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::optional<std::string> inline_value;
    if (flag.rfind("--", 0) == 0) {
      size_t eq = flag.find('=');
      if (eq != std::string::npos) {
        inline_value = flag.substr(eq + 1);
        flag = flag.substr(0, eq);
      }
    }
    if (flag == "-h" || flag == "--help") {
      o.help = true;
      continue;
    }
    auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= args.size()) throw ConfigError(fmt::format("{} needs a value", flag));
      return args[++i];
    };
    auto qring_only = [&]() {
      if (mpi) throw ConfigError(fmt::format("{} is not supported by the MPI benchmark", flag));
    };
    if (flag == "--op") {
      std::string v = value();
      auto op = parse_op(v);
      if (!op) throw ConfigError(fmt::format("--op: unknown operation '{}'", v));
      if (mpi && (*op == BenchOp::kSendRecv || *op == BenchOp::kQuorum || *op == BenchOp::kIdle))
        throw ConfigError(fmt::format("--op {} is not supported by the MPI benchmark", v));
      o.op = *op;
    } else if (flag == "-b" || flag == "--minbytes") {
      o.min_bytes = parse_size(value());
    } else if (flag == "-e" || flag == "--maxbytes") {
      o.max_bytes = parse_size(value());
    } else if (flag == "-f" || flag == "--stepfactor") {
      o.factor = size_t(parse_int(flag, value(), 2, 1 << 20));
    } else if (flag == "-n" || flag == "--iters") {
      o.iters = int(parse_int(flag, value(), 1, 100'000'000));
    } else if (flag == "-w" || flag == "--warmup_iters") {
      o.warmup = int(parse_int(flag, value(), 0, 100'000'000));
    } else if (flag == "-c" || flag == "--check") {
      o.check = parse_int(flag, value(), 0, 1) != 0;
    } else if (flag == "--dtype") {
      std::string v = value();
      auto t = parse_dtype_name(v);
      if (!t) throw ConfigError(fmt::format("--dtype: unknown type '{}'", v));
      if (mpi && *t == DataType::kBFloat16)
        throw ConfigError("--dtype bfloat16: MPI has no bfloat16 type");
      o.dtype = *t;
    } else if (flag == "--redop") {
      std::string v = value();
      auto r = parse_redop_name(v);
      if (!r) throw ConfigError(fmt::format("--redop: unknown reduction '{}'", v));
      o.redop = *r;
    } else if (flag == "--auto-iters") {
      std::string v = value();
      char* end = nullptr;
      o.auto_seconds = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(o.auto_seconds > 0) || o.auto_seconds > 3600)
        throw ConfigError(fmt::format("--auto-iters: expected seconds > 0, got '{}'", v));
    } else if (flag == "--root") {
      o.root = int(parse_int(flag, value(), 0, 1 << 24));
    } else if (flag == "--json") {
      o.json_path = value();
    } else if (flag == "--provider") {
      qring_only();
      o.provider = value();
    } else if (flag == "--segment-bytes") {
      qring_only();
      o.segment_bytes = parse_size(value());
      if (o.segment_bytes == 0) throw ConfigError("--segment-bytes must be > 0");
    } else if (flag == "--inflight") {
      qring_only();
      o.inflight = int(parse_int(flag, value(), 1, 1024));
    } else if (flag == "--sends-inflight") {
      qring_only();
      o.sends_inflight = int(parse_int(flag, value(), 1, 1024));
    } else if (flag == "--small-bytes") {
      qring_only();
      o.small_bytes = parse_size(value());
    } else if (flag == "--hd-bytes") {
      qring_only();
      o.hd_bytes = parse_size(value());
    } else if (flag == "--timeout-ms") {
      qring_only();
      o.timeout_ms = parse_int(flag, value(), 1, 86'400'000);
    } else if (flag == "--idle-via") {
      qring_only();
      std::string v = value();
      if (v != "engine" && v != "endpoint")
        throw ConfigError(fmt::format("--idle-via: expected engine or endpoint, got '{}'", v));
      o.idle_via_endpoint = v == "endpoint";
    } else if (flag == "--spin") {
      qring_only();
      o.spin = true;
    } else if (flag == "--quorum") {
      qring_only();
      o.quorum = value();
    } else if (flag == "--grace-ms") {
      qring_only();
      o.grace_ms = parse_int(flag, value(), 0, 86'400'000);
    } else if (flag == "--deadline-ms") {
      qring_only();
      o.deadline_ms = parse_int(flag, value(), 1, 86'400'000);
    } else if (flag == "--straggler") {
      qring_only();
      o.straggler = value();
    } else if (flag == "--compare-full") {
      qring_only();
      o.compare_full = true;
    } else if (flag == "--compare-allreduce") {
      qring_only();
      o.compare_allreduce = true;
    } else if (flag == "--fault") {
      qring_only();
      o.fault = value();
      if (o.fault.empty()) throw ConfigError("--fault needs a spec (kill:RANK:STEP, ...)");
    } else if (flag == "--evict-ms") {
      qring_only();
      o.evict_ms = parse_int(flag, value(), 1, 86'400'000);
    } else if (flag == "--seed") {
      qring_only();
      o.seed = uint64_t(parse_int(flag, value(), 0, INT64_MAX));
    } else if (flag == "--seconds") {
      qring_only();
      std::string v = value();
      char* end = nullptr;
      o.seconds = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(o.seconds >= 0) || o.seconds > 86400)
        throw ConfigError(fmt::format("--seconds: bad value '{}'", v));
    } else {
      throw ConfigError(fmt::format("unknown flag '{}' (see --help)", args[i]));
    }
  }
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
  return o;
}

inline double bus_factor(BenchOp op, int n) {
  switch (op) {
    case BenchOp::kAllreduce:
    case BenchOp::kQuorum:
      return n > 0 ? 2.0 * (n - 1) / n : 0.0;
    case BenchOp::kAllgather:
    case BenchOp::kReduceScatter:
      return n > 0 ? double(n - 1) / n : 0.0;
    default:
      return 1.0;
  }
}

// ---------------------------------------------------------------- data

inline int pattern(size_t j, int r) {
  return int((j * 7 + size_t(r) * 13) % 17) - 8;
}

// Writes value v (a small integer) as type t at element i of buf.
inline void store_value(void* buf, DataType t, size_t i, double v) {
  switch (t) {
    case DataType::kFloat32:
      static_cast<float*>(buf)[i] = float(v);
      break;
    case DataType::kFloat64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DataType::kInt32:
      static_cast<int32_t*>(buf)[i] = int32_t(v);
      break;
    case DataType::kInt64:
      static_cast<int64_t*>(buf)[i] = int64_t(v);
      break;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(buf)[i] = collectives::float_to_bf16(float(v));
      break;
  }
}

// Element i of buf (type t) as a double.
inline double load_value(const void* buf, DataType t, size_t i) {
  switch (t) {
    case DataType::kFloat32:
      return static_cast<const float*>(buf)[i];
    case DataType::kFloat64:
      return static_cast<const double*>(buf)[i];
    case DataType::kInt32:
      return static_cast<const int32_t*>(buf)[i];
    case DataType::kInt64:
      return double(static_cast<const int64_t*>(buf)[i]);
    case DataType::kBFloat16:
      return collectives::bf16_to_float(static_cast<const uint16_t*>(buf)[i]);
  }
  return 0;
}

constexpr size_t kPatternPeriod = 17;  // pattern(j, r) depends on j only through j mod 17

// buf[i] = pattern(first + i, rank) for i in [0, count).
inline void fill_pattern(void* buf, DataType t, size_t count, size_t first, int rank) {
  const size_t ts = dtype_bytes(t);
  alignas(8) unsigned char enc[kPatternPeriod][8];
  for (size_t k = 0; k < kPatternPeriod; ++k) store_value(enc[k], t, 0, pattern(k, rank));
  auto* p = static_cast<unsigned char*>(buf);
  size_t k = first % kPatternPeriod;
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(p + i * ts, enc[k], ts);
    if (++k == kPatternPeriod) k = 0;
  }
}

// Bytes that decode as wrong values in every type.
inline void fill_garbage(void* buf, size_t bytes) {
  std::memset(buf, 0xA5, bytes);
}

// The expected reduction of pattern(j, r) over ranks 0..n-1, encoded as type t into `out`
// exactly the way the implementations compute it: exact integer sum, min or max; avg = the
// sum divided by n in t's own arithmetic (integers truncate; bfloat16 divides in float32 and
// rounds to nearest even).
inline void expected_reduced(size_t j, int n, RedOp op, DataType t, void* out) {
  int64_t sum = 0, mn = INT64_MAX, mx = INT64_MIN;
  for (int r = 0; r < n; ++r) {
    int64_t v = pattern(j, r);
    sum += v;
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  int64_t v = op == RedOp::kMin ? mn : op == RedOp::kMax ? mx : sum;
  if (op != RedOp::kAvg) {
    store_value(out, t, 0, double(v));
    return;
  }
  switch (t) {
    case DataType::kFloat32:
      *static_cast<float*>(out) = float(sum) / float(n);
      break;
    case DataType::kFloat64:
      *static_cast<double*>(out) = double(sum) / double(n);
      break;
    case DataType::kInt32:
      *static_cast<int32_t*>(out) = int32_t(sum / n);
      break;
    case DataType::kInt64:
      *static_cast<int64_t*>(out) = sum / n;
      break;
    case DataType::kBFloat16:
      *static_cast<uint16_t*>(out) = collectives::float_to_bf16(float(sum) / float(n));
      break;
  }
}

// Elements i in [0, count) of buf that differ from the encoded values want[(first + i) % 17].
inline int64_t count_mismatches(const void* buf, size_t ts, size_t count, size_t first,
                                const unsigned char (&want)[kPatternPeriod][8]) {
  int64_t wrong = 0;
  const auto* p = static_cast<const unsigned char*>(buf);
  size_t k = first % kPatternPeriod;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(p + i * ts, want[k], ts) != 0) ++wrong;
    if (++k == kPatternPeriod) k = 0;
  }
  return wrong;
}

// Elements i in [0, count) where buf[i] != reduction over n ranks of pattern(first + i, .).
inline int64_t count_wrong_reduced(const void* buf, DataType t, size_t count, size_t first, int n,
                                   RedOp op) {
  alignas(8) unsigned char want[kPatternPeriod][8];
  for (size_t k = 0; k < kPatternPeriod; ++k) expected_reduced(k, n, op, t, want[k]);
  return count_mismatches(buf, dtype_bytes(t), count, first, want);
}

// Elements i in [0, count) where buf[i] != pattern(first + i, src).
inline int64_t count_wrong_pattern(const void* buf, DataType t, size_t count, size_t first,
                                   int src) {
  alignas(8) unsigned char want[kPatternPeriod][8];
  for (size_t k = 0; k < kPatternPeriod; ++k) store_value(want[k], t, 0, pattern(k, src));
  return count_mismatches(buf, dtype_bytes(t), count, first, want);
}

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
};

inline std::string table_header(BenchOp op, const Options& o, int ranks,
                                const std::string& provider) {
  std::string s;
  s += fmt::format(
      "# {}: {} ranks, provider {}, dtype {}, redop {}, iters {}, warmup {}, check {}\n",
      op_name(op), ranks, provider, dtype_name(o.dtype),
      (op == BenchOp::kAllreduce || op == BenchOp::kReduceScatter || op == BenchOp::kQuorum)
          ? redop_name(o.redop)
          : std::string_view("none"),
      o.iters, o.warmup, o.check ? 1 : 0);
  if (op == BenchOp::kSendRecv)
    s += "# ping-pong between ranks 2i and 2i+1: time = round trip / 2 (fi_pingpong's "
         "usec/xfer), algbw = size / time\n";
  s += "#\n";
  s += fmt::format("# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>29}  {:>29}\n", "", "", "", "", "",
                   "out-of-place", "in-place");
  s += fmt::format(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>9} {:>7} {:>7} {:>6}  {:>9} {:>7} "
      "{:>7} {:>6}\n",
      "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
      "busbw", "#wrong");
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
  return fmt::format("  {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {}  {}\n", k.bytes, k.count, type,
                     redop, k.root, format_measurement(oop), format_measurement(ip));
}

struct JsonContext {
  std::string op;
  std::string dtype;
  std::string redop;
  int ranks = 0;
  std::string provider;
  int iters = 0;
  int warmup = 0;
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
//   double max_over_ranks(double);  int64_t sum_over_ranks(int64_t);
//   void run(BenchOp op, const void* send, void* recv, size_t count, bool in_place);
//     in place: allreduce send == recv; broadcast buf == recv; all-gather input at
//     recv + rank*count; reduce-scatter input is the whole recv buffer, the result is at
//     recv + reduce_scatter_in_place_offset(count) elements.
//   size_t reduce_scatter_in_place_offset(size_t count);
//   void register_buffer(const void*, size_t);
template <class Backend>
class Sweep {
 public:
  Sweep(Backend& be, const Options& o) : be_(be), o_(o) {}

  // Runs every size; rank 0 prints the table to stdout. Returns the total #wrong.
  int64_t run() {
    const int n = be_.size();
    const bool print = be_.rank() == 0;
    if (o_.op == BenchOp::kBroadcast && (o_.root < 0 || o_.root >= n))
      throw ConfigError(fmt::format("--root {} out of range for {} ranks", o_.root, n));
    ctx_ = JsonContext{std::string(op_name(o_.op)),
                       std::string(dtype_name(o_.dtype)),
                       std::string(redop_name(o_.redop)),
                       n,
                       be_.provider(),
                       o_.iters,
                       o_.warmup};
    if (print) std::fputs(table_header(o_.op, o_, n, be_.provider()).c_str(), stdout);

    const size_t ts = dtype_bytes(o_.dtype);
    if (o_.op == BenchOp::kBarrier) {
      RowKey k;
      Measurement m = time_op(0, 0, false, nullptr, nullptr);
      emit(k, "none", "none", m, std::nullopt);
      return 0;
    }
    const size_t max_bytes = o_.max_bytes;
    AlignedBuffer sbuf(max_bytes), rbuf(max_bytes);
    be_.register_buffer(sbuf.data(), sbuf.size);
    be_.register_buffer(rbuf.data(), rbuf.size);
    const bool per_rank_split = o_.op == BenchOp::kAllgather || o_.op == BenchOp::kReduceScatter;
    int64_t total_wrong = 0;
    for (size_t bytes : sweep_sizes(o_)) {
      RowKey k;
      k.count_per_rank = per_rank_split ? bytes / (ts * size_t(n)) : bytes / ts;
      k.count = per_rank_split ? k.count_per_rank * size_t(n) : k.count_per_rank;
      k.bytes = k.count * ts;
      k.root = o_.op == BenchOp::kBroadcast ? o_.root : -1;
      if (k.count_per_rank == 0) {
        if (print) std::printf("# %zu bytes: fewer than one element per rank, skipped\n", bytes);
        continue;
      }
      std::optional<Measurement> oop, ip;
      if (o_.op != BenchOp::kBroadcast) {
        oop = measure(k, false, sbuf.data(), rbuf.data());
        total_wrong += std::max<int64_t>(0, oop->wrong);
      }
      ip = measure(k, true, sbuf.data(), rbuf.data());
      total_wrong += std::max<int64_t>(0, ip->wrong);
      emit(k, dtype_name(o_.dtype),
           (o_.op == BenchOp::kAllreduce || o_.op == BenchOp::kReduceScatter)
               ? redop_name(o_.redop)
               : std::string_view("none"),
           oop, ip);
    }
    return total_wrong;
  }

  const std::vector<nlohmann::json>& rows() const { return rows_; }

 private:
  void emit(const RowKey& k, std::string_view type, std::string_view redop,
            const std::optional<Measurement>& oop, const std::optional<Measurement>& ip) {
    if (be_.rank() != 0) return;
    std::fputs(format_row(k, type, redop, oop, ip).c_str(), stdout);
    std::fflush(stdout);
    if (oop) rows_.push_back(json_row(ctx_, k, *oop));
    if (ip) rows_.push_back(json_row(ctx_, k, *ip));
  }

  // Puts fresh input in place for one call.
  void prepare(const RowKey& k, bool in_place, unsigned char* s, unsigned char* r) {
    const int n = be_.size();
    const int rank = be_.rank();
    const size_t ts = dtype_bytes(o_.dtype);
    const size_t c = k.count_per_rank;
    fill_garbage(r, k.bytes);
    switch (o_.op) {
      case BenchOp::kAllreduce:
        fill_pattern(in_place ? r : s, o_.dtype, c, 0, rank);
        break;
      case BenchOp::kBroadcast:
        if (rank == o_.root) fill_pattern(r, o_.dtype, c, 0, rank);
        break;
      case BenchOp::kAllgather:
        fill_pattern(in_place ? r + size_t(rank) * c * ts : s, o_.dtype, c, size_t(rank) * c, rank);
        break;
      case BenchOp::kReduceScatter:
        fill_pattern(in_place ? r : s, o_.dtype, c * size_t(n), 0, rank);
        break;
      default:
        break;
    }
  }

  int64_t check(const RowKey& k, bool in_place, const unsigned char* r) {
    const int n = be_.size();
    const int rank = be_.rank();
    const size_t ts = dtype_bytes(o_.dtype);
    const size_t c = k.count_per_rank;
    switch (o_.op) {
      case BenchOp::kAllreduce:
        return count_wrong_reduced(r, o_.dtype, c, 0, n, o_.redop);
      case BenchOp::kBroadcast:
        return count_wrong_pattern(r, o_.dtype, c, 0, o_.root);
      case BenchOp::kAllgather: {
        int64_t w = 0;
        for (int src = 0; src < n; ++src)
          w += count_wrong_pattern(r + size_t(src) * c * ts, o_.dtype, c, size_t(src) * c, src);
        return w;
      }
      case BenchOp::kReduceScatter: {
        size_t off = in_place ? be_.reduce_scatter_in_place_offset(c) : 0;
        return count_wrong_reduced(r + off * ts, o_.dtype, c, size_t(rank) * c, n, o_.redop);
      }
      default:
        return 0;
    }
  }

  Measurement time_op(size_t count, size_t bytes, bool in_place, const void* s, void* r) {
    int iters = o_.iters, warmup = o_.warmup;
    if (o_.auto_seconds > 0) {
      // One probe iteration (also a warmup); every rank derives the same count from the
      // slowest rank's probe.
      be_.barrier();
      auto p0 = std::chrono::steady_clock::now();
      be_.run(o_.op, s, r, count, in_place);
      double probe = be_.max_over_ranks(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count());
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
    m.time_us = be_.max_over_ranks(local_us);
    m.algbw = m.time_us > 0 ? double(bytes) / (m.time_us * 1e-6) / 1e9 : 0.0;
    m.busbw = m.algbw * bus_factor(o_.op, be_.size());
    return m;
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
  JsonContext ctx_;
  std::vector<nlohmann::json> rows_;
};

}  // namespace qring::bench
