// qring-decide-bench: the cost of one adaptive-quorum decision (collectives/quorum/auto_quorum.h) at
// a given number of members. The coordinator makes one per step, on its engine thread, when a
// step's first contribution arrives; a decision that takes longer than the quorum's own wait
// delays the step. The window is the coordinator's (AutoQuorumWindow::kWindow steps) of
// synthetic arrivals: lognormal offsets, each step decided at a fraction of its arrivals (the
// later ones censored), the rest of the cycle a fixed time beyond the decision.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <deque>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "collectives/quorum/auto_quorum.h"
#include "collectives/bench/bench_common.h"

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "qring-decide-bench: the time of one adaptive-quorum decision (quorum \"auto\") per "
      "number of members, on the coordinator's window of synthetic lognormal arrivals"};
  std::vector<int> members{4, 8, 16, 32, 100, 128, 129, 1000};
  double mu = 2.7, sigma = 1.0, decided_fraction = 0.5, cycle_ms = 7, kappa = 100.0 / 32;
  double min_time_ms = 200;
  int batches = 5;
  std::string json;
  app.add_option("--members", members, "numbers of members, e.g. 4,100,1000")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--mu", mu, "lognormal offsets: mu of the log (ms)");
  app.add_option("--sigma", sigma, "lognormal offsets: sigma of the log")
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--decided-fraction", decided_fraction,
                 "each window step decided at this fraction of its arrivals")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--cycle-ms", cycle_ms, "the rest of a step's cycle beyond its decision")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--kappa", kappa, "noise scale over the batch (0: the linear value)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--min-time-ms", min_time_ms, "time each batch of decisions at least this long")
      ->check(CLI::Range(0.001, 1e6));
  app.add_option("--batches", batches, "batches per number of members; the median is reported")
      ->check(CLI::Range(1, 1000));
  app.add_option("--json", json, "also write the rows as a JSON array to this file");
  CLI11_PARSE(app, argc, argv);

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
                    {"window_steps", AutoQuorumWindow::kWindow}});
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
