// qring-decide-bench: the cost of one adaptive-quorum decision (collectives/quorum/auto_quorum.h) at
// a given number of members. The coordinator makes one per step, on its engine thread, when a
// step's first contribution arrives; a decision that takes longer than the quorum's own wait
// delays the step. The window is the coordinator's (AutoQuorumWindow::kWindow steps) of
// synthetic arrivals: lognormal offsets, each step decided at a fraction of its arrivals (the
// later ones censored), the rest of the cycle a fixed time beyond the decision.
// Command line on the shared rules of net/base/cli.h (exit 2 with one line on a bad flag).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "collectives/quorum/auto_quorum.h"
#include "collectives/bench/bench_common.h"
#include "net/base/cli.h"

namespace {

using qring::collectives::AutoQuorumWindow;
using qring::collectives::choose_quorum;
using qring::collectives::StepArrivals;

std::deque<StepArrivals> make_window(int n, double mu, double sigma, double decided_fraction,
                                     double cycle_ms, uint32_t seed) {
  std::mt19937 rng(seed);
  std::lognormal_distribution<double> delay(mu, sigma);
  std::deque<StepArrivals> w;
  const size_t decided_at = size_t(std::clamp(int(decided_fraction * n + 0.5), 1, n)) - 1;
  for (size_t t = 0; t < AutoQuorumWindow::kWindow; ++t) {
    std::vector<double> v(static_cast<size_t>(n));
    for (auto& x : v) x = delay(rng);
    const double first = *std::min_element(v.begin(), v.end());
    for (auto& x : v) x -= first;
    std::vector<double> sorted = v;
    std::nth_element(sorted.begin(), sorted.begin() + long(decided_at), sorted.end());
    StepArrivals s;
    s.decided_ms = sorted[decided_at];
    for (auto& x : v)
      if (x > s.decided_ms) x = StepArrivals::kNotArrived;
    s.offset_ms = std::move(v);
    s.cycle_ms = s.decided_ms + cycle_ms;
    w.push_back(std::move(s));
  }
  return w;
}

struct Args {
  std::vector<int> members{4, 8, 16, 32, 100, 128, 129, 1000};
  double mu = 2.7, sigma = 1.0, decided_fraction = 0.5, cycle_ms = 7, kappa = 100.0 / 32;
  double min_time_ms = 200;
  int batches = 5;
  std::string json;
};

// The command line on the shared rules (net/base/cli.h): the exit status of --help,
// --version (0) or of a usage error (2), or -1 to go on.
int parse_args(int argc, char** argv, Args& a) {
  using qring::cli::add_value;
  using qring::cli::to_number;
  CLI::App app{
      "The time of one adaptive-quorum decision (quorum \"auto\") per number of members, on "
      "the coordinator's window of synthetic lognormal arrivals (usage: qring-decide-bench "
      "[flags]).",
      "qring-decide-bench"};
  qring::cli::init(app);
  add_value(app, "--members", "numbers of members, comma-separated (default 4,8,16,32,100,128,129,1000)")
      ->each([&](const std::string& v) {
        a.members.clear();
        size_t start = 0;
        while (start <= v.size()) {
          const size_t comma = std::min(v.find(',', start), v.size());
          a.members.push_back(
              int(qring::cli::to_int("--members", v.substr(start, comma - start), 1, 1 << 16)));
          start = comma + 1;
        }
      });
  add_value(app, "--mu", "lognormal offsets: mu of the log, ms (default 2.7)")
      ->each([&](const std::string& v) { a.mu = to_number("--mu", v, -20, 20); });
  add_value(app, "--sigma", "lognormal offsets: sigma of the log (default 1)")
      ->each([&](const std::string& v) { a.sigma = to_number("--sigma", v, 0, 10); });
  add_value(app, "--decided-fraction",
            "each window step decided at this fraction of its arrivals (default 0.5)")
      ->each([&](const std::string& v) {
        a.decided_fraction = to_number("--decided-fraction", v, 0, 1);
      });
  add_value(app, "--cycle-ms", "the rest of a step's cycle beyond its decision (default 7)")
      ->each([&](const std::string& v) { a.cycle_ms = to_number("--cycle-ms", v, 0, 1e9); });
  add_value(app, "--kappa", "noise scale over the batch, 0: the linear value (default 3.125)")
      ->each([&](const std::string& v) { a.kappa = to_number("--kappa", v, 0, 1e12); });
  add_value(app, "--min-time-ms", "time each batch of decisions at least this long (default 200)")
      ->each([&](const std::string& v) {
        a.min_time_ms = to_number("--min-time-ms", v, 0.001, 1e6);
      });
  add_value(app, "--batches", "batches per number of members; the median is reported (default 5)")
      ->each([&](const std::string& v) {
        a.batches = int(qring::cli::to_int("--batches", v, 1, 1000));
      });
  app.add_option("--json", a.json, "also write the rows as a JSON array to this file");
  app.footer(
      "Exit status: 0 done; 1 the JSON file could not be written at the end; 2 bad command\n"
      "line (the --json path is checked before the first measurement).");
  qring::cli::ParseOptions po;
  po.check = [&] {
    if (!a.json.empty()) qring::cli::check_output_path("--json", a.json);
  };
  return qring::cli::parse(app, qring::cli::args_of(argc, argv), po);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (int rc = parse_args(argc, argv, a); rc >= 0) return rc;
  const std::vector<int>& members = a.members;
  const double mu = a.mu, sigma = a.sigma, decided_fraction = a.decided_fraction,
               cycle_ms = a.cycle_ms, kappa = a.kappa, min_time_ms = a.min_time_ms;
  const int batches = a.batches;
  const std::string& json = a.json;

  using Clock = std::chrono::steady_clock;
  std::vector<nlohmann::json> rows;
  fmt::print("{:>8} {:>12} {:>12} {:>8}\n", "members", "decision_us", "decisions", "quorum");
  for (int n : members) {
    const auto window = make_window(n, mu, sigma, decided_fraction, cycle_ms, uint32_t(n));
    std::vector<int> ranks(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) ranks[size_t(i)] = i;
    int quorum = choose_quorum(window, ranks, 1, 0, kappa).quorum;  // warm-up
    std::vector<double> per;
    int64_t decisions = 0;
    for (int b = 0; b < batches; ++b) {
      int64_t k = 0;
      const auto t0 = Clock::now();
      double elapsed_ms = 0;
      do {
        quorum = choose_quorum(window, ranks, 1, 0, kappa).quorum;
        ++k;
        elapsed_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      } while (elapsed_ms < min_time_ms);
      per.push_back(elapsed_ms * 1000 / double(k));
      decisions += k;
    }
    std::sort(per.begin(), per.end());
    const double us = per[per.size() / 2];
    fmt::print("{:>8} {:>12.1f} {:>12} {:>8}\n", n, us, decisions, quorum);
    rows.push_back({{"members", n},
                    {"decision_us", us},
                    {"decision_us_min", per.front()},
                    {"decision_us_max", per.back()},
                    {"decisions", decisions},
                    {"quorum", quorum},
                    {"window_steps", AutoQuorumWindow::kWindow},
                    {"build", qring::build::fields()}});
  }
  if (!json.empty()) {
    try {
      qring::bench::write_json(json, rows);
    } catch (const std::exception& e) {
      fmt::print(stderr, "qring-decide-bench: {}\n", e.what());
      return 1;
    }
  }
  return 0;
}
