// qring-sim: the training algorithm of qring-train for W = N + b virtual workers in one
// process, on a virtual clock (train/sim.h; docs/reproduction.md).
//
//   qring-sim --config configs/fmnist-mlp.toml --workers 100 --backups 4 train.steps=300
//       straggler.model=shiftexp:5:20   (one line)
//   qring-sim --config configs/fmnist-mlp.toml --workers 50 --mode async
//
// Exit status: 0 done, 1 runtime failure, 2 bad command line, configuration or data.
#include <fmt/format.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "net/base/build_info.h"
#include "net/base/error.h"
#include "train/config.h"
#include "train/dataset.h"
#include "train/sim.h"

namespace {

const char* kUsage =
    "usage: qring-sim --config FILE --workers W [--backups B] [--mode sync|async]\n"
    "                 [--compute-ms MS] [--apply-ms MS] [--calibration FILE]\n"
    "                 [--alpha-us US] [--beta-ns NS] [--rtt-us US] [--progress]\n"
    "                 [--arrivals-only]\n"
    "                 [section.key=value ...]\n"
    "\n"
    "  --config FILE    TOML run configuration, as for qring-train\n"
    "  --workers W      virtual workers W = N + B\n"
    "  --backups B      sync: backup workers; each step averages the first N = W - B\n"
    "                   gradients to arrive (default 0: full sync). quorum.quorum=auto\n"
    "                   instead: N chosen every step by the adaptive quorum's rule, within\n"
    "                   quorum.min .. quorum.max; quorum.grace_ms counts the arrivals\n"
    "                   within the grace after the N-th too, as qring-train's coordinator\n"
    "  --mode M         sync or async (a parameter server); default: train.mode\n"
    "  --compute-ms MS  base compute time of one gradient (default: measured at the start)\n"
    "  --apply-ms MS    one optimizer step (default: measured at the start)\n"
    "  --calibration F  JSON: alpha_us, beta_ns_per_byte, rtt_us, optionally step_cost_ms\n"
    "                   {{full, backup: {{N: ms}}}} (scripts/reproduce.py calibrate)\n"
    "  --alpha-us US    latency of one message, per ring hop (default {})\n"
    "  --beta-ns NS     transfer time per byte (default {})\n"
    "  --rtt-us US      READY/DECIDE round trip, charged when B > 0 (default {})\n"
    "  --progress       a progress line on stderr every 5 s\n"
    "  --version        print the version, commit, build type and ISA, and exit\n"
    "  --arrivals-only  sync: only draw train.steps steps of arrivals and time them (no\n"
    "                   training; arrivals.jsonl and the mean k-th arrival in summary.json)\n"
    "  key=value        override any configuration key, e.g. straggler.model=shiftexp:5:20\n"
    "                   train.steps=200 train.target_accuracy=0.8\n"
    "\n"
    "Writes run.out_dir/run.name/{{metrics.jsonl, summary.json, config.toml, arrivals.jsonl}}.\n"
    "Compute time of worker w at its k-th gradient = compute + straggler.model's\n"
    "delay(run.seed, w, k). One compute thread unless OMP_NUM_THREADS is set.\n"
    "Sync runs estimate the gradient-noise scale B_simple from each step's gradients\n"
    "(samples; noise_scale on step lines, its means in summary.json): the value for\n"
    "quorum.noise_scale, the adaptive quorum's value of a step.\n";

std::string usage() {
  return fmt::format(fmt::runtime(kUsage), qring::train::kSimDefaultAlphaUs,
                     qring::train::kSimDefaultBetaNsPerByte, qring::train::kSimDefaultRttUs);
}

double parse_number(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
    throw qring::ConfigError(fmt::format("{}: '{}' is not a number", flag, s));
  return v;
}

// alpha_us, beta_ns_per_byte and rtt_us from a calibration file (all three required).
void read_calibration(const std::string& path, qring::train::SimOptions& o) {
  std::ifstream in(path);
  if (!in) throw qring::ConfigError(fmt::format("--calibration: cannot open '{}'", path));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw qring::ConfigError(fmt::format("--calibration {}: not JSON ({})", path, e.what()));
  }
  auto get = [&](const char* key) {
    if (!j.is_object() || !j.contains(key) || !j[key].is_number())
      throw qring::ConfigError(fmt::format("--calibration {}: needs a number '{}'", path, key));
    return j[key].get<double>();
  };
  o.alpha_us = get("alpha_us");
  o.beta_ns_per_byte = get("beta_ns_per_byte");
  o.rtt_us = get("rtt_us");
  // Optional: {"step_cost_ms": {"full": {"N": ms, ...}, "backup": {"N": ms, ...}}}.
  if (j.contains("step_cost_ms")) {
    const auto& t = j["step_cost_ms"];
    auto read = [&](const char* key, std::map<int, double>& out) {
      if (!t.is_object() || !t.contains(key)) return;
      if (!t[key].is_object())
        throw qring::ConfigError(fmt::format("--calibration {}: step_cost_ms.{}", path, key));
      for (auto it = t[key].begin(); it != t[key].end(); ++it) {
        int n = 0;
        try {
          n = std::stoi(it.key());
        } catch (const std::exception&) {
          n = 0;
        }
        if (n < 1 || !it.value().is_number())
          throw qring::ConfigError(fmt::format(
              "--calibration {}: step_cost_ms.{} needs \"N\": ms entries", path, key));
        out[n] = it.value().get<double>();
      }
    };
    read("full", o.step_cost_full_ms);
    read("backup", o.step_cost_backup_ms);
  }
}

int parse_int(const std::string& flag, const std::string& s) {
  double v = parse_number(flag, s);
  if (v != std::floor(v) || v < -1e9 || v > 1e9)
    throw qring::ConfigError(fmt::format("{}: '{}' is not an integer", flag, s));
  return int(v);
}

// The command line, checked (ConfigError when it is wrong).
struct Args {
  std::string config_path;
  std::vector<std::string> overrides;
  qring::train::SimOptions opts;
  bool have_workers = false;
  std::optional<qring::train::SimMode> mode;
  std::string calibration;
  std::optional<double> alpha, beta, rtt;
};

// False after --help or --version (printed).
bool parse_args(int argc, char** argv, Args& args) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw qring::ConfigError(fmt::format("{} needs a value", a));
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      fputs(usage().c_str(), stdout);
      return false;
    } else if (a == "--version") {
      fmt::print("{}\n", qring::build::version_text("qring-sim"));
      return false;
    } else if (a == "--config") {
      args.config_path = value();
    } else if (a == "--workers") {
      args.opts.workers = parse_int(a, value());
      args.have_workers = true;
    } else if (a == "--backups") {
      args.opts.backups = parse_int(a, value());
    } else if (a == "--mode") {
      std::string m = value();
      if (m == "sync")
        args.mode = qring::train::SimMode::kSync;
      else if (m == "async")
        args.mode = qring::train::SimMode::kAsync;
      else
        throw qring::ConfigError(fmt::format("--mode: '{}' is not sync or async", m));
    } else if (a == "--compute-ms") {
      args.opts.compute_ms = parse_number(a, value());
      if (args.opts.compute_ms < 0)
        throw qring::ConfigError(
            fmt::format("--compute-ms must be >= 0, got {}", args.opts.compute_ms));
    } else if (a == "--apply-ms") {
      args.opts.apply_ms = parse_number(a, value());
      if (args.opts.apply_ms < 0)
        throw qring::ConfigError(
            fmt::format("--apply-ms must be >= 0, got {}", args.opts.apply_ms));
    } else if (a == "--calibration") {
      args.calibration = value();
    } else if (a == "--alpha-us") {
      args.alpha = parse_number(a, value());
    } else if (a == "--beta-ns") {
      args.beta = parse_number(a, value());
    } else if (a == "--rtt-us") {
      args.rtt = parse_number(a, value());
    } else if (a == "--progress") {
      args.opts.progress = true;
    } else if (a == "--arrivals-only") {
      args.opts.arrivals_only = true;
    } else if (a.find('=') != std::string::npos && a.rfind("-", 0) != 0) {
      args.overrides.push_back(a);
    } else {
      throw qring::ConfigError(fmt::format("unknown argument '{}'", a));
    }
  }
  if (args.config_path.empty()) throw qring::ConfigError("--config FILE is required");
  if (!args.have_workers) throw qring::ConfigError("--workers W is required");
  // The file first, explicit flags over it.
  if (!args.calibration.empty()) read_calibration(args.calibration, args.opts);
  if (args.alpha) args.opts.alpha_us = *args.alpha;
  if (args.beta) args.opts.beta_ns_per_byte = *args.beta;
  if (args.rtt) args.opts.rtt_us = *args.rtt;
  return true;
}

// The configuration and the data (qring::Error when they are wrong); the options that
// follow from the configuration.
void load_run(Args& args, qring::train::TrainConfig& cfg, qring::train::DatasetPair& data) {
  cfg = qring::train::TrainConfig::from_file(args.config_path, args.overrides);
  cfg.validate();
  args.opts.mode = args.mode ? *args.mode
                            : (cfg.train.mode == "async" ? qring::train::SimMode::kAsync
                                                         : qring::train::SimMode::kSync);
  args.opts.adaptive = cfg.quorum.quorum_auto;
  args.opts.auto_min = int(cfg.quorum.min);
  args.opts.auto_max = int(cfg.quorum.max);
  args.opts.auto_kappa = cfg.quorum.noise_scale / double(cfg.train.batch_per_rank);
  args.opts.grace_ms = double(cfg.quorum.grace_ms);
  args.opts.out_dir = (std::filesystem::path(cfg.run.out_dir) / cfg.run.name).string();
  data = qring::train::load_datasets(cfg.data, uint64_t(cfg.run.seed));
}

void print_result(const qring::train::SimOptions& opts, const qring::train::SimResult& r) {
  fmt::print(
      "mode {} workers {} backups {} test_accuracy {:.4f} best {:.4f} time_to_target_s {} "
      "virtual_s {:.2f} step_p50_ms {:.2f} step_p90_ms {:.2f} staleness_mean {:.2f} "
      "compute_ms {:.3f} gradients {} noise_scale_to_target {} wall_s {:.1f}\n",
      opts.mode == qring::train::SimMode::kSync ? "sync" : "async", opts.workers, opts.backups,
      r.test_accuracy, r.best_test_accuracy,
      r.time_to_target_s ? fmt::format("{:.2f}", *r.time_to_target_s) : std::string("-"),
      r.virtual_s, r.step_p50_ms, r.step_p90_ms, r.staleness_mean, r.compute_ms,
      r.gradients_computed,
      r.noise_scale_to_target ? fmt::format("{:.0f}", *r.noise_scale_to_target) : std::string("-"),
      r.wall_s);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    if (!parse_args(argc, argv, args)) return 0;
  } catch (const qring::ConfigError& e) {
    fmt::print(stderr, "qring-sim: {}\n{}", e.what(), usage());
    return 2;
  }

  // One compute thread unless OMP_NUM_THREADS says otherwise: the gradients are many and
  // small, and OpenMP's spinning lanes collapse on a machine shared with other work (a run
  // of 48 small gradients took 0.9 s with two threads under load, 0.05 s with one).
  if (!std::getenv("OMP_NUM_THREADS")) omp_set_num_threads(1);

  qring::train::TrainConfig cfg;
  qring::train::DatasetPair data;
  try {
    load_run(args, cfg, data);
  } catch (const qring::Error& e) {
    fmt::print(stderr, "qring-sim: {}\n", e.what());
    return 2;
  }

  try {
    auto r = qring::train::simulate(cfg, data, args.opts);
    print_result(args.opts, r);
  } catch (const qring::ConfigError& e) {
    fmt::print(stderr, "qring-sim: {}\n", e.what());
    return 2;
  } catch (const qring::DataError& e) {
    fmt::print(stderr, "qring-sim: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "qring-sim: {}\n", e.what());
    return 1;
  }
  return 0;
}
