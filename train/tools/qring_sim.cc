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
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "net/base/cli.h"
#include "net/base/error.h"
#include "train/config.h"
#include "train/dataset.h"
#include "train/sim.h"

namespace {

namespace cli = qring::cli;
using qring::ConfigError;

// A calibration table's key: a count N >= 1, or 0 when it is not one.
int count_key(const std::string& key) {
  try {
    size_t end = 0;
    const int n = std::stoi(key, &end);
    return end == key.size() && n >= 1 ? n : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

// Optional: {"arrival_offsets_ms": {"N": [[ms per rank], ...], ...}} (SimOptions); the rows'
// lengths are checked against --workers by simulate().
void read_arrival_offsets(const std::string& path, const nlohmann::json& j,
                          qring::train::SimOptions& o) {
  if (!j.contains("arrival_offsets_ms")) return;
  const auto& t = j["arrival_offsets_ms"];
  const auto bad = ConfigError(fmt::format(
      "--calibration {}: arrival_offsets_ms needs \"N\": [[ms per rank], ...] entries", path));
  if (!t.is_object()) throw bad;
  for (auto it = t.begin(); it != t.end(); ++it) {
    const int n = count_key(it.key());
    if (n < 1 || !it.value().is_array() || it.value().empty()) throw bad;
    auto& rows = o.arrival_offsets_ms[n];
    for (const auto& row : it.value()) {
      if (!row.is_array()) throw bad;
      rows.emplace_back();
      for (const auto& x : row) {
        if (!x.is_number()) throw bad;
        rows.back().push_back(x.get<double>());
      }
    }
  }
}

// alpha_us, beta_ns_per_byte and rtt_us from a calibration file (all three required).
void read_calibration(const std::string& path, qring::train::SimOptions& o) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("--calibration: cannot open '{}'", path));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("--calibration {}: not JSON ({})", path, e.what()));
  }
  auto get = [&](const char* key) {
    if (!j.is_object() || !j.contains(key) || !j[key].is_number())
      throw ConfigError(fmt::format("--calibration {}: needs a number '{}'", path, key));
    return j[key].get<double>();
  };
  o.alpha_us = get("alpha_us");
  o.beta_ns_per_byte = get("beta_ns_per_byte");
  o.rtt_us = get("rtt_us");
  read_arrival_offsets(path, j, o);
  // Optional: {"step_cost_ms": {"full": {"N": ms, ...}, "backup": {"N": ms, ...}}}.
  if (!j.contains("step_cost_ms")) return;
  const auto& t = j["step_cost_ms"];
  auto read = [&](const char* key, std::map<int, double>& out) {
    if (!t.is_object() || !t.contains(key)) return;
    if (!t[key].is_object())
      throw ConfigError(fmt::format("--calibration {}: step_cost_ms.{}", path, key));
    for (auto it = t[key].begin(); it != t[key].end(); ++it) {
      const int n = count_key(it.key());
      if (n < 1 || !it.value().is_number())
        throw ConfigError(fmt::format("--calibration {}: step_cost_ms.{} needs \"N\": ms entries",
                                      path, key));
      out[n] = it.value().get<double>();
    }
  };
  read("full", o.step_cost_full_ms);
  read("backup", o.step_cost_backup_ms);
}

// A finite number >= 0, or a ConfigError naming `flag`.
double to_ms(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(x) || x < 0)
    throw ConfigError(fmt::format("{} expects a number >= 0, got '{}'", flag, v));
  return x;
}

// The command line, checked.
struct Args {
  std::string config_path;
  std::vector<std::string> overrides;
  qring::train::SimOptions opts;
  std::optional<qring::train::SimMode> mode;
  std::string calibration;
  std::optional<double> alpha, beta, rtt;
};

// The command line, or the exit status of --help (0) or of a usage error (2), through the
// shared CLI11 conventions of net/base/cli.h.
std::variant<Args, int> parse_args(int argc, char** argv) {
  Args a;
  CLI::App app{
      "The training algorithm of qring-train for W = N + B virtual workers in one process, on "
      "a virtual clock (usage: qring-sim --config FILE --workers W [flags] [section.key=value "
      "...]).",
      "qring-sim"};
  cli::init(app);
  app.add_option("--config", a.config_path, "TOML run configuration, as for qring-train; required");
  bool have_workers = false;
  cli::add_value(app, "--workers", "virtual workers W = N + B; required")
      ->each([&](const std::string& v) {
        a.opts.workers = int(cli::to_int("--workers", v, 1, 1000000));
        have_workers = true;
      });
  cli::add_value(app, "--backups",
                 "sync: backup workers B; each step averages the first N = W - B gradients "
                 "to arrive (default 0: full sync). quorum.quorum=auto instead: N chosen every "
                 "step by the coordinator's adaptive rule within quorum.min .. quorum.max; "
                 "quorum.grace_ms counts the arrivals within the grace after the N-th too")
      ->each([&](const std::string& v) {
        a.opts.backups = int(cli::to_int("--backups", v, 0, 1000000));
      });
  cli::add_value(app, "--mode", "sync or async (a parameter server); default: train.mode")
      ->each([&](const std::string& v) {
        if (v == "sync")
          a.mode = qring::train::SimMode::kSync;
        else if (v == "async")
          a.mode = qring::train::SimMode::kAsync;
        else
          throw ConfigError(fmt::format("--mode expects sync or async, got '{}'", v));
      });
  cli::add_value(app, "--compute-ms",
                 "base compute time of one gradient (default: measured at the start)")
      ->each([&](const std::string& v) { a.opts.compute_ms = to_ms("--compute-ms", v); });
  cli::add_value(app, "--apply-ms", "one optimizer step (default: measured at the start)")
      ->each([&](const std::string& v) { a.opts.apply_ms = to_ms("--apply-ms", v); });
  app.add_option("--calibration", a.calibration,
                 "JSON: alpha_us, beta_ns_per_byte, rtt_us, optionally step_cost_ms {full, "
                 "backup: {N: ms}} (scripts/reproduce.py calibrate)");
  cli::add_value(app, "--alpha-us",
                 fmt::format("latency of one message, per round of the all-reduce (default {})",
                             qring::train::kSimDefaultAlphaUs))
      ->each([&](const std::string& v) { a.alpha = to_ms("--alpha-us", v); });
  cli::add_value(app, "--beta-ns",
                 fmt::format("transfer time per byte (default {})",
                             qring::train::kSimDefaultBetaNsPerByte))
      ->each([&](const std::string& v) { a.beta = to_ms("--beta-ns", v); });
  cli::add_value(app, "--rtt-us",
                 fmt::format("READY/DECIDE round trip, charged when B > 0 (default {})",
                             qring::train::kSimDefaultRttUs))
      ->each([&](const std::string& v) { a.rtt = to_ms("--rtt-us", v); });
  app.add_flag("--progress", a.opts.progress, "a progress line on stderr every 5 s");
  app.add_flag("--arrivals-only", a.opts.arrivals_only,
               "sync: only draw train.steps steps of arrivals and time them (no training; "
               "arrivals.jsonl and the mean k-th arrival in summary.json)");
  cli::add_overrides(app, a.overrides,
                     "straggler.model=shiftexp:5:20 train.steps=200 train.target_accuracy=0.8");
  app.footer(
      "Writes run.out_dir/run.name/{metrics.jsonl, summary.json, config.toml, arrivals.jsonl}.\n"
      "Compute time of worker w at its k-th gradient = compute + straggler.model's\n"
      "delay(run.seed, w, k). One compute thread unless OMP_NUM_THREADS is set.\n"
      "Sync runs estimate the gradient-noise scale B_simple from each step's gradients\n"
      "(samples; noise_scale on step lines, its means in summary.json); quorum.quorum=auto\n"
      "values a step with it under quorum.noise_scale=\"estimate\".\n"
      "Exit status: 0 done, 1 runtime failure, 2 bad command line, configuration or data.");
  cli::ParseOptions po;
  po.check = [&] {
    cli::check_overrides(a.overrides);
    if (a.config_path.empty()) throw ConfigError("--config FILE is required (see --help)");
    if (!have_workers) throw ConfigError("--workers W is required (see --help)");
    // The file first, explicit flags over it.
    if (!a.calibration.empty()) read_calibration(a.calibration, a.opts);
  };
  if (int rc = cli::parse(app, cli::args_of(argc, argv), po); rc >= 0) return rc;
  if (a.alpha) a.opts.alpha_us = *a.alpha;
  if (a.beta) a.opts.beta_ns_per_byte = *a.beta;
  if (a.rtt) a.opts.rtt_us = *a.rtt;
  return a;
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
  if (!cfg.quorum.noise_scale_estimated())
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
  auto parsed = parse_args(argc, argv);
  if (const int* rc = std::get_if<int>(&parsed)) return *rc;
  Args& args = std::get<Args>(parsed);

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
