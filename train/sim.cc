#include "train/sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <queue>
#include <tuple>

#include "collectives/algorithms.h"
#include "collectives/quorum/auto_quorum.h"
#include "collectives/quorum/decide_rule.h"
#include "collectives/quorum/noise_scale.h"
#include "net/base/error.h"
#include "train/measure.h"
#include "train/model.h"
#include "train/trainer.h"
#include "train/trainer_core.h"

namespace qring::train {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Arrival order: time, ties by rank.
void sort_by_arrival(std::vector<SimArrival>& a) {
  std::sort(a.begin(), a.end(), [](const SimArrival& x, const SimArrival& y) {
    return x.ms != y.ms ? x.ms < y.ms : x.rank < y.rank;
  });
}

// Median of a few timed gradient computations on the first batch of the training set (the
// model's gradient buffer is overwritten, its parameters are not touched).
double measure_compute_ms(Model& model, const Dataset& train, int64_t batch) {
  std::vector<int32_t> idx(size_t(std::min<int64_t>(batch, train.size())));
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int32_t(i);
  AlignedVector<float> x(idx.size() * size_t(train.dim));
  std::vector<int32_t> y(idx.size());
  gather_batch(train, idx, x.data(), y.data());
  std::vector<double> ms;
  for (int i = 0; i < 7; ++i) {
    auto t0 = Clock::now();
    model.forward_backward(x.data(), y.data(), int(y.size()));
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return quantile(ms, 0.5);
}

// Median of a few optimizer steps on scratch parameters (the run's are not touched).
double measure_apply_ms(const TrainConfig& cfg, size_t P) {
  Sgd opt(P, sgd_options(cfg));
  std::vector<float> p(P, 0.5f), g(P, 0.25f);
  std::vector<double> ms;
  for (int i = 0; i < 7; ++i) {
    auto t0 = Clock::now();
    opt.step(p.data(), g.data(), 1e-3);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return quantile(ms, 0.5);
}

void check_options(const SimOptions& o) {
  if (o.workers < 1) throw ConfigError(fmt::format("--workers must be >= 1, got {}", o.workers));
  if (o.mode == SimMode::kAsync && o.backups != 0)
    throw ConfigError("--backups applies to --mode sync only (async has no quorum)");
  if (o.mode == SimMode::kAsync && o.arrivals_only)
    throw ConfigError("--arrivals-only applies to --mode sync only");
  if (o.adaptive && (o.mode != SimMode::kSync || o.backups != 0 || o.arrivals_only))
    throw ConfigError("quorum.quorum = \"auto\" applies to --mode sync, without --backups");
  if (o.adaptive && (o.auto_min < 1 || o.auto_max < 0 || o.auto_min > o.workers ||
                     o.auto_max > o.workers || (o.auto_max > 0 && o.auto_max < o.auto_min)))
    throw ConfigError(fmt::format("quorum.min {} / quorum.max {}: not within 1..{} workers",
                                  o.auto_min, o.auto_max, o.workers));
  if (o.backups < 0 || o.backups >= o.workers)
    throw ConfigError(fmt::format("--backups must be in 0..{} (workers - 1), got {}",
                                  o.workers - 1, o.backups));
  auto finite_nonneg = [](double v, const char* what) {
    if (!std::isfinite(v) || v < 0)
      throw ConfigError(fmt::format("{} must be a finite number >= 0, got {}", what, v));
  };
  if (o.compute_ms >= 0 || !std::isfinite(o.compute_ms)) finite_nonneg(o.compute_ms, "--compute-ms");
  if (o.apply_ms >= 0 || !std::isfinite(o.apply_ms)) finite_nonneg(o.apply_ms, "--apply-ms");
  finite_nonneg(o.alpha_us, "--alpha-us");
  finite_nonneg(o.beta_ns_per_byte, "--beta-ns");
  finite_nonneg(o.rtt_us, "--rtt-us");
  finite_nonneg(o.grace_ms, "quorum.grace_ms");
  if (o.grace_ms > 0 && o.mode != SimMode::kSync)
    throw ConfigError("quorum.grace_ms applies to --mode sync only (async has no quorum)");
  for (const auto& [n, rows] : o.arrival_offsets_ms)
    for (const auto& row : rows)
      if (int(row.size()) != o.workers ||
          !std::all_of(row.begin(), row.end(), [](double x) { return std::isfinite(x); }))
        throw ConfigError(fmt::format(
            "calibration: arrival offsets for quorum {}: every row needs {} finite numbers", n,
            o.workers));
  for (const auto* t : {&o.step_cost_full_ms, &o.step_cost_backup_ms})
    for (const auto& [n, ms] : *t)
      if (n < 1 || !std::isfinite(ms) || ms < 0)
        throw ConfigError(fmt::format("calibration: step cost {} ms for {} contributors", ms, n));
}

// Shared by both modes: the workers' data streams, the output files and the evaluations.
// |g|^2 in double, over kLanes interleaved partial sums (one long chain of dependent additions
// took as long as the gradient itself).
double squared_norm(const float* g, size_t n) {
  constexpr size_t kLanes = 8;
  double part[kLanes] = {};
  size_t p = 0;
  for (; p + kLanes <= n; p += kLanes)
    for (size_t j = 0; j < kLanes; ++j) part[j] += double(g[p + j]) * double(g[p + j]);
  double s = 0;
  for (; p < n; ++p) s += double(g[p]) * double(g[p]);
  for (double x : part) s += x;
  return s;
}

class SimRun {
 public:
  SimRun(const TrainConfig& cfg, const DatasetPair& data, const SimOptions& opts,
         TrainerCore& core, SimResult& res)
      : cfg_(cfg), data_(data), opts_(opts), core_(core), res_(res) {
    const int64_t b = cfg.train.batch_per_rank;
    for (int w = 0; w < opts.workers; ++w)
      sharders_.emplace_back(data.train.size(), w, opts.workers, b, uint64_t(cfg.run.seed));
    x_.resize(size_t(b * data.train.dim));
    y_.resize(size_t(b));
    if (!opts.out_dir.empty()) {
      fs::create_directories(opts.out_dir);
      std::ofstream(fs::path(opts.out_dir) / "config.toml") << cfg.to_toml();
      metrics_.open(fs::path(opts.out_dir) / "metrics.jsonl", std::ios::trunc);
      if (!metrics_)
        throw DataError(fmt::format("cannot write {}/metrics.jsonl", opts.out_dir));
      if (opts.mode == SimMode::kSync)
        arrivals_.open(fs::path(opts.out_dir) / "arrivals.jsonl", std::ios::trunc);
      else
        fs::remove(fs::path(opts.out_dir) / "arrivals.jsonl");
    }
    t0_ = last_progress_ = Clock::now();
  }

  int64_t batches_per_epoch() const { return sharders_[0].batches_per_epoch(); }

  // Worker w's next batch, its gradient (on the model's current parameters) in the model's
  // gradient buffer; returns the batch-mean loss.
  double gradient(int w) {
    gather_batch(data_.train, sharders_[size_t(w)].next_batch(), x_.data(), y_.data());
    ++res_.gradients_computed;
    return core_.model().forward_backward(x_.data(), y_.data(), int(y_.size()));
  }
  void skip(int w) { sharders_[size_t(w)].next_batch(); }

  // A sync step's update: the mean of the gradients of arr's first n workers (summed in
  // arrival order) into `mean`, their ranks appended to `ranks`; the others' batches are
  // skipped. Returns the mean loss; local_sq = the mean over them of |g_i|^2, mean_sq =
  // |mean|^2 (the noise scale's inputs, as READY carries them in qring-train).
  double average_first(const std::vector<SimArrival>& arr, int n, std::vector<float>& mean,
                       std::vector<int>& ranks, double& local_sq, double& mean_sq) {
    const size_t P = mean.size();
    std::fill(mean.begin(), mean.end(), 0.0f);
    double loss = 0, sq = 0;
    for (int i = 0; i < n; ++i) {
      const int w = arr[size_t(i)].rank;
      loss += gradient(w);
      const float* g = core_.gradient();
      for (size_t p = 0; p < P; ++p) mean[p] += g[p];
      sq += squared_norm(g, P);
      ranks.push_back(w);
    }
    for (size_t i = size_t(n); i < arr.size(); ++i) skip(arr[i].rank);
    const float inv = 1.0f / float(n);
    mean_sq = 0;
    for (size_t p = 0; p < P; ++p) {
      mean[p] *= inv;
      mean_sq += double(mean[p]) * double(mean[p]);
    }
    local_sq = sq / n;
    return loss / n;
  }

  // Every worker's arrival in ms after the step's first, by rank (qring-train's format).
  void record_arrivals(int64_t step, const std::vector<SimArrival>& arr) {
    if (!arrivals_.is_open() || arr.empty()) return;
    std::vector<double> off(arr.size());
    for (const auto& a : arr) off[size_t(a.rank)] = a.ms - arr.front().ms;
    arrivals_ << nlohmann::json{{"step", step}, {"ready_ms", off}}.dump() << '\n';
  }

  void record(const SimStepRecord& r, bool with_ranks) {
    if (metrics_.is_open()) {
      nlohmann::json j{{"type", "step"},           {"step", r.step},
                       {"virtual_s", r.virtual_s}, {"step_ms", r.step_ms},
                       {"loss", r.loss},           {"lr", r.lr},
                       {"contributors", r.contributors}};
      if (with_ranks) {
        if (r.noise_scale) j["noise_scale"] = *r.noise_scale;
        j["quorum"] = r.quorum;
        j["kth_arrival_ms"] = r.kth_arrival_ms;
        j["ranks"] = r.ranks;
      } else {
        j["staleness_mean"] = r.staleness_mean;
        j["staleness_max"] = r.staleness_max;
      }
      metrics_ << j.dump() << '\n';
    }
    res_.steps.push_back(r);
  }

  void evaluate(int64_t step, double virtual_s) {
    EvalResult e = core_.evaluate_test();
    SimEval ev;
    ev.step = step;
    ev.virtual_s = virtual_s;
    ev.accuracy = e.count ? double(e.correct) / double(e.count) : 0;
    ev.loss = e.count ? e.loss_sum / double(e.count) : 0;
    res_.evals.push_back(ev);
    res_.test_accuracy = ev.accuracy;
    res_.test_loss = ev.loss;
    res_.best_test_accuracy = std::max(res_.best_test_accuracy, ev.accuracy);
    if (cfg_.train.target_accuracy > 0 && !res_.time_to_target_s &&
        ev.accuracy >= cfg_.train.target_accuracy)
      res_.time_to_target_s = virtual_s;
    if (metrics_.is_open()) {
      nlohmann::json j{{"type", "eval"},
                       {"step", step},
                       {"virtual_s", virtual_s},
                       {"wall_s", std::chrono::duration<double>(Clock::now() - t0_).count()},
                       {"test_accuracy", ev.accuracy},
                       {"test_loss", ev.loss}};
      metrics_ << j.dump() << '\n' << std::flush;
    }
  }

  void progress(int64_t done, int64_t total, double virtual_s) {
    if (!opts_.progress) return;
    auto now = Clock::now();
    if (now - last_progress_ < std::chrono::seconds(5) && done != total) return;
    last_progress_ = now;
    fmt::print(stderr, "qring-sim: {}/{} virtual {:.1f} s wall {:.1f} s acc {}\n", done, total,
               virtual_s, std::chrono::duration<double>(now - t0_).count(),
               res_.evals.empty() ? std::string("-")
                                  : fmt::format("{:.4f}", res_.evals.back().accuracy));
  }

  void finish(double virtual_s) {
    res_.virtual_s = virtual_s;
    res_.wall_s = std::chrono::duration<double>(Clock::now() - t0_).count();
    res_.updates = core_.step();
    res_.params_checksum = checksum(core_.params(), core_.num_params());
    if (metrics_.is_open()) metrics_.close();
    if (arrivals_.is_open()) arrivals_.close();
  }

 private:
  const TrainConfig& cfg_;
  const DatasetPair& data_;
  const SimOptions& opts_;
  TrainerCore& core_;
  SimResult& res_;
  std::vector<Sharder> sharders_;
  AlignedVector<float> x_;
  std::vector<int32_t> y_;
  std::ofstream metrics_, arrivals_;
  Clock::time_point t0_, last_progress_;
};

// Adds one step's arrivals to the mean k-th arrival over `steps` steps.
void add_kth(SimResult& res, const std::vector<SimArrival>& arr, int64_t steps) {
  res.kth_arrival_mean_ms.resize(arr.size(), 0.0);
  for (size_t i = 0; i < arr.size(); ++i) res.kth_arrival_mean_ms[i] += arr[i].ms / double(steps);
}

// The arrival process alone: train.steps steps of W arrivals and their step times.
void run_arrivals(const TrainConfig& cfg, const DatasetPair& data, const SimOptions& opts,
                  SimResult& res) {
  const int W = opts.workers, N = W - opts.backups;
  const auto straggler = collectives::StragglerModel::parse(cfg.straggler.model);
  TrainerCore core(cfg, data, 0, W, N);
  SimRun run(cfg, data, opts, core, res);
  const double bytes = 4.0 * double(core.num_params() + 1);
  res.compute_ms = opts.compute_ms >= 0 ? opts.compute_ms : 0.0;
  res.apply_ms = opts.apply_ms >= 0 ? opts.apply_ms : 0.0;
  const int64_t total = core.total_steps();
  const auto offsets = opts.arrival_offsets_ms.find(N);
  std::vector<double> step_ms;
  double vt = 0;
  for (int64_t t = 0; t < total; ++t) {
    auto arr = sim_arrivals(straggler, uint64_t(cfg.run.seed), W, uint64_t(t), res.compute_ms);
    if (offsets != opts.arrival_offsets_ms.end()) sim_offset_arrivals(arr, offsets->second, uint64_t(t));
    run.record_arrivals(t, arr);
    add_kth(res, arr, total);
    const SimDecision d = sim_decide(arr, N, opts.grace_ms);
    SimStepRecord r;
    r.step = t;
    r.kth_arrival_ms = arr[size_t(N - 1)].ms;
    r.step_ms = d.at_ms + sim_sync_comm_ms(opts, d.count, bytes, res.apply_ms);
    vt += r.step_ms / 1000.0;
    r.virtual_s = vt;
    r.contributors = d.count;
    r.quorum = N;
    for (int i = 0; i < d.count; ++i) r.ranks.push_back(arr[size_t(i)].rank);
    step_ms.push_back(r.step_ms);
    run.record(r, true);
  }
  res.step_p50_ms = quantile(step_ms, 0.5);
  res.step_p90_ms = quantile(step_ms, 0.9);
  run.finish(vt);
}

// A decided step as the coordinator's window keeps it (auto_quorum.h): the arrivals counted,
// and any at the same instant as the decision (not counted here, but observed: not
// censored), after the step's first; the others had not arrived.
collectives::StepArrivals seen_by_coordinator(const std::vector<SimArrival>& arr,
                                              const SimDecision& dec) {
  collectives::StepArrivals a;
  a.offset_ms.assign(arr.size(), collectives::StepArrivals::kNotArrived);
  for (size_t i = 0; i < arr.size() && (int(i) < dec.count || arr[i].ms <= dec.at_ms); ++i)
    a.offset_ms[size_t(arr[i].rank)] = arr[i].ms - arr.front().ms;
  a.decided_ms = dec.at_ms - arr.front().ms;
  return a;
}

std::optional<double> mean_of(const std::vector<double>& v) {
  if (v.empty()) return std::nullopt;
  double s = 0;
  for (double x : v) s += x;
  return s / double(v.size());
}

void run_sync(const TrainConfig& cfg, const DatasetPair& data, const SimOptions& opts,
              SimResult& res) {
  const int W = opts.workers;
  // The adaptive quorum: the schedule of the largest quorum, each step's rate scaled by its
  // contributors over that (as qring-train does).
  const int qmax = opts.adaptive ? (opts.auto_max > 0 ? std::min(opts.auto_max, W) : W)
                                 : W - opts.backups;
  const uint64_t seed = uint64_t(cfg.run.seed);
  const auto straggler = collectives::StragglerModel::parse(cfg.straggler.model);
  TrainerCore core(cfg, data, 0, W, qmax);
  SimRun run(cfg, data, opts, core, res);
  const size_t P = core.num_params();
  const double bytes = 4.0 * double(P + 1);
  res.compute_ms = opts.compute_ms >= 0
                       ? opts.compute_ms
                       : measure_compute_ms(core.model(), data.train, cfg.train.batch_per_rank);
  res.apply_ms = opts.apply_ms >= 0 ? opts.apply_ms : measure_apply_ms(cfg, P);
  const int64_t total = core.total_steps();
  const int64_t eval_every =
      cfg.train.eval_every > 0 ? cfg.train.eval_every : run.batches_per_epoch();
  std::vector<float> sum(P);
  std::vector<double> step_ms;
  std::vector<int> members(static_cast<size_t>(W));
  for (int w = 0; w < W; ++w) members[size_t(w)] = w;
  collectives::AutoQuorumWindow window;
  collectives::NoiseScaleEstimate noise;
  std::vector<double> noise_all, noise_before_target;
  double since_first = -1;  // from the previous step's first arrival to its end
  double vt = 0;
  // A budget of gradients runs an unknown number of steps: the k-th arrival means are sums
  // until the end.
  int64_t t = 0;
  const auto offsets = opts.adaptive ? opts.arrival_offsets_ms.end()
                                     : opts.arrival_offsets_ms.find(W - opts.backups);
  for (; !core.budget_spent(t); ++t) {
    auto arr = sim_arrivals(straggler, seed, W, uint64_t(t), res.compute_ms);
    if (offsets != opts.arrival_offsets_ms.end()) sim_offset_arrivals(arr, offsets->second, uint64_t(t));
    run.record_arrivals(t, arr);
    add_kth(res, arr, 1);
    int Q = W - opts.backups;
    if (opts.adaptive) {
      // The coordinator's view of it: this step opens at its first arrival.
      if (since_first >= 0) window.opened(uint64_t(t), since_first + arr.front().ms);
      // The step's value: the configured noise scale, or the run's estimate so far (none yet:
      // the linear value), in contributions.
      const double kappa = opts.auto_kappa ? *opts.auto_kappa : noise.value().value_or(0.0);
      Q = collectives::choose_quorum(window.samples(), members, opts.auto_min, opts.auto_max,
                                     kappa)
              .quorum;
    }
    // The first N arrivals count: the quorum, and with a grace those within it.
    const SimDecision dec = sim_decide(arr, Q, opts.grace_ms);
    const int N = dec.count;
    SimStepRecord r;
    r.step = t;
    double local_sq = 0, mean_sq = 0;
    const double loss = run.average_first(arr, N, sum, r.ranks, local_sq, mean_sq);
    noise.add(N, local_sq, mean_sq);
    if (auto v = noise.value()) r.noise_scale = *v * double(cfg.train.batch_per_rank);
    if (r.noise_scale) {
      noise_all.push_back(*r.noise_scale);
      if (!res.time_to_target_s) noise_before_target.push_back(*r.noise_scale);
    }
    const double lr_scale = opts.adaptive ? double(N) / double(qmax) : 1.0;
    r.lr = core.lr() * lr_scale;
    core.apply_gradient(sum.data(), lr_scale, N);
    r.kth_arrival_ms = arr[size_t(Q - 1)].ms;
    // Under "auto" the quorum is below the world (no speculation): the round trip counts.
    r.step_ms = dec.at_ms +
                sim_step_comm_ms(opts, N, !opts.adaptive && opts.backups == 0, bytes, res.apply_ms);
    if (opts.adaptive) {
      window.decided(uint64_t(t), seen_by_coordinator(arr, dec));
      since_first = r.step_ms - arr.front().ms;
    }
    vt += r.step_ms / 1000.0;
    r.virtual_s = vt;
    r.loss = loss;
    r.contributors = N;
    r.quorum = Q;
    ++res.quorum_hist[Q];
    step_ms.push_back(r.step_ms);
    run.record(r, true);
    const int64_t done = t + 1;
    if (done % eval_every == 0 && !core.budget_spent(done)) run.evaluate(done, vt);
    run.progress(done, core.budget_gradients() > 0 ? done : total, vt);
  }
  for (double& m : res.kth_arrival_mean_ms) m /= double(std::max<int64_t>(1, t));
  run.evaluate(t, vt);
  res.step_p50_ms = quantile(step_ms, 0.5);
  res.step_p90_ms = quantile(step_ms, 0.9);
  res.noise_scale_mean = mean_of(noise_all);
  res.noise_scale_to_target = mean_of(noise_before_target);
  run.finish(vt);
}

// run_async: the per-worker step count of the equivalent sync run.
int64_t async_steps_per_worker(const TrainConfig& cfg_in, const DatasetPair& data, int W,
                               uint64_t seed) {
  Sharder s(data.train.size(), 0, W, cfg_in.train.batch_per_rank, seed);
  return cfg_in.train.steps > 0 ? cfg_in.train.steps : cfg_in.train.epochs * s.batches_per_epoch();
}

// An update with staleness `stale` (run_async).
void count_staleness(SimResult& res, int64_t stale) {
  if (size_t(stale) >= res.staleness_hist.size()) res.staleness_hist.resize(size_t(stale) + 1);
  ++res.staleness_hist[size_t(stale)];
  res.staleness_max = std::max(res.staleness_max, stale);
}

// The mean staleness of the updates counted in res.staleness_hist.
double mean_staleness(const SimResult& res) {
  double s = 0;
  int64_t n = 0;
  for (size_t i = 0; i < res.staleness_hist.size(); ++i) {
    s += double(i) * double(res.staleness_hist[i]);
    n += res.staleness_hist[i];
  }
  return n ? s / double(n) : 0;
}

void run_async(const TrainConfig& cfg_in, const DatasetPair& data, const SimOptions& opts,
               SimResult& res) {
  const int W = opts.workers;
  const uint64_t seed = uint64_t(cfg_in.run.seed);
  const auto straggler = collectives::StragglerModel::parse(cfg_in.straggler.model);
  // Per-worker step count of the equivalent sync run, then W updates per such step.
  const int64_t per_worker = async_steps_per_worker(cfg_in, data, W, seed);
  TrainConfig cfg = cfg_in;
  cfg.train.steps = per_worker * W;
  cfg.train.warmup_steps = cfg_in.train.warmup_steps * W;
  TrainerCore core(cfg, data, 0, W, 1);
  SimRun run(cfg, data, opts, core, res);
  const size_t P = core.num_params();
  const double bytes = 4.0 * double(P + 1);
  res.compute_ms = opts.compute_ms >= 0
                       ? opts.compute_ms
                       : measure_compute_ms(core.model(), data.train, cfg.train.batch_per_rank);
  res.apply_ms = opts.apply_ms >= 0 ? opts.apply_ms : measure_apply_ms(cfg, P);
  const double xfer_ms = bytes * opts.beta_ns_per_byte / 1e6;  // one transfer of the buffer
  const double hop_ms = opts.alpha_us / 1000.0 + xfer_ms;
  const double serve_ms = res.apply_ms + xfer_ms;  // the server's time per update
  const int64_t total = per_worker * W;
  const int64_t eval_every =
      (cfg_in.train.eval_every > 0 ? cfg_in.train.eval_every : run.batches_per_epoch()) * W;

  const size_t nw = static_cast<size_t>(W);
  std::vector<std::vector<float>> grad(nw, std::vector<float>(P));
  std::vector<double> loss(nw, 0.0), start_ms(nw, 0.0);
  std::vector<int64_t> pulled(nw, 0), iters(nw, 0);
  using Event = std::tuple<double, int>;  // (arrival at the server, rank): time, then rank
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> q;
  // Worker w computes its next gradient on the current parameters, starting at `now`.
  auto launch = [&](int w, double now) {
    loss[size_t(w)] = run.gradient(w);
    std::copy(core.gradient(), core.gradient() + P, grad[size_t(w)].begin());
    const double ready = now + res.compute_ms +
                         double(straggler.delay(seed, w, uint64_t(iters[size_t(w)])).count()) /
                             1000.0;
    ++iters[size_t(w)];
    start_ms[size_t(w)] = now;
    q.emplace(ready + hop_ms, w);
  };
  for (int w = 0; w < W; ++w) launch(w, 0.0);

  double server_free = 0, vt_ms = 0;
  std::vector<double> iter_ms;
  SimStepRecord r;
  double round_loss = 0, round_stale = 0, round_iter = 0;
  int64_t version = 0;
  while (!q.empty()) {
    auto [arrive, w] = q.top();
    q.pop();
    const double applied = std::max(arrive, server_free) + serve_ms;
    server_free = applied;
    const int64_t stale = version - pulled[size_t(w)];
    const double scale = staleness_lr_scale(cfg.train.async_staleness == "divide", stale);
    if (r.contributors == 0) r.lr = core.lr() * scale;
    core.apply_gradient(grad[size_t(w)].data(), scale);
    ++version;
    count_staleness(res, stale);
    const double pull_done = applied + hop_ms;
    const double it = pull_done - start_ms[size_t(w)];
    iter_ms.push_back(it);
    vt_ms = applied;
    round_loss += loss[size_t(w)];
    round_stale += double(stale);
    round_iter += it;
    r.staleness_max = std::max(r.staleness_max, stale);
    ++r.contributors;
    pulled[size_t(w)] = version;
    if (iters[size_t(w)] < per_worker) launch(w, pull_done);

    if (version % W == 0 || version == total) {
      r.step = (version - 1) / W;
      r.virtual_s = vt_ms / 1000.0;
      r.loss = round_loss / r.contributors;
      r.staleness_mean = round_stale / r.contributors;
      r.step_ms = round_iter / r.contributors;
      run.record(r, false);
      r = SimStepRecord();
      round_loss = round_stale = round_iter = 0;
    }
    if (version % eval_every == 0 && version < total) run.evaluate(version, vt_ms / 1000.0);
    run.progress(version, total, vt_ms / 1000.0);
  }
  run.evaluate(total, vt_ms / 1000.0);
  res.staleness_mean = mean_staleness(res);
  res.step_p50_ms = quantile(iter_ms, 0.5);
  res.step_p90_ms = quantile(iter_ms, 0.9);
  run.finish(vt_ms / 1000.0);
}

}  // namespace

std::vector<SimArrival> sim_arrivals(const collectives::StragglerModel& straggler, uint64_t seed,
                                     int workers, uint64_t step, double compute_ms) {
  std::vector<SimArrival> a(size_t(std::max(0, workers)));
  for (int w = 0; w < workers; ++w)
    a[size_t(w)] = {compute_ms + double(straggler.delay(seed, w, step).count()) / 1000.0, w};
  sort_by_arrival(a);
  return a;
}

void sim_offset_arrivals(std::vector<SimArrival>& arr,
                         const std::vector<std::vector<double>>& rows, uint64_t step) {
  if (rows.empty()) return;
  const auto& row = rows[size_t(step % rows.size())];
  for (auto& a : arr) a.ms += row[size_t(a.rank)];
  sort_by_arrival(arr);
}

int sim_allreduce_rounds(int k, double bytes) {
  if (k <= 1) return 0;
  int lg = 0;
  while ((2 << lg) <= k) ++lg;  // floor(log2 k)
  const bool pow2 = (k & (k - 1)) == 0;
  if (bytes <= double(collectives::kSmallAllreduceBytes)) return lg + (pow2 ? 0 : 2);
  if (pow2 && bytes <= double(collectives::kHalvingDoublingBytes)) return 2 * lg;
  return 2 * (k - 1);
}

double sim_allreduce_ms(int k, double bytes, double alpha_us, double beta_ns_per_byte) {
  if (k <= 1) return 0;
  return (double(sim_allreduce_rounds(k, bytes)) * alpha_us * 1000.0 +
          bytes * beta_ns_per_byte * 2.0 * double(k - 1) / double(k)) /
         1e6;
}

SimDecision sim_decide(const std::vector<SimArrival>& arr, int n, double grace_ms) {
  // The coordinator's rule (collectives/quorum/decide_rule.h) on the virtual clock: the
  // arrivals taken in one at a time, and between two of them the instant the grace runs out.
  using collectives::qproto::RuleMs;
  const int all = int(arr.size());
  const RuleMs grace(grace_ms);
  std::optional<double> quorum_at;
  for (int i = 0; i < all; ++i) {
    const double now = arr[size_t(i)].ms;
    // The grace runs out before this arrival: the rule, asked at that instant, decides.
    if (quorum_at && *quorum_at + grace_ms < now &&
        collectives::qproto::step_due(i, all, grace, grace))
      return {i, *quorum_at + grace_ms};
    if (i + 1 >= n && !quorum_at) quorum_at = now;
    const auto since = quorum_at ? std::optional<RuleMs>(RuleMs(now - *quorum_at)) : std::nullopt;
    if (collectives::qproto::step_due(i + 1, all, since, grace)) return {i + 1, now};
  }
  return {all, all > 0 ? arr.back().ms : 0.0};
}

double sim_step_comm_ms(const SimOptions& o, int n, bool speculative, double bytes,
                        double apply_ms) {
  const auto& measured = speculative ? o.step_cost_full_ms : o.step_cost_backup_ms;
  if (auto it = measured.find(n); it != measured.end()) return it->second + apply_ms;
  return (speculative ? 0.0 : o.rtt_us / 1000.0) +
         sim_allreduce_ms(n, bytes, o.alpha_us, o.beta_ns_per_byte) + apply_ms;
}

double sim_sync_comm_ms(const SimOptions& o, int n, double bytes, double apply_ms) {
  return sim_step_comm_ms(o, n, o.backups == 0, bytes, apply_ms);
}

nlohmann::json SimResult::to_json() const {
  nlohmann::json j;
  j["test_accuracy"] = test_accuracy;
  j["best_test_accuracy"] = best_test_accuracy;
  j["test_loss"] = test_loss;
  j["time_to_target_s"] = time_to_target_s ? nlohmann::json(*time_to_target_s) : nlohmann::json();
  j["virtual_s"] = virtual_s;
  j["wall_s"] = wall_s;
  j["compute_ms"] = compute_ms;
  j["apply_ms"] = apply_ms;
  j["gradients_computed"] = gradients_computed;
  j["gradients_per_wall_s"] = wall_s > 0 ? double(gradients_computed) / wall_s : 0;
  j["updates"] = updates;
  j["step_p50_ms"] = step_p50_ms;
  j["step_p90_ms"] = step_p90_ms;
  j["staleness_mean"] = staleness_mean;
  j["staleness_max"] = staleness_max;
  j["staleness_hist"] = staleness_hist;
  j["kth_arrival_mean_ms"] = kth_arrival_mean_ms;
  j["params_checksum"] = fmt::format("{:016x}", params_checksum);
  auto opt = [](const std::optional<double>& v) {
    return v ? nlohmann::json(*v) : nlohmann::json();
  };
  j["noise_scale_mean"] = opt(noise_scale_mean);
  j["noise_scale_to_target"] = opt(noise_scale_to_target);
  return j;
}

SimResult simulate(const TrainConfig& cfg, const DatasetPair& data, const SimOptions& opts) {
  check_options(opts);
  cfg.validate();
  SimResult res;
  if (opts.arrivals_only)
    run_arrivals(cfg, data, opts, res);
  else if (opts.mode == SimMode::kSync)
    run_sync(cfg, data, opts, res);
  else
    run_async(cfg, data, opts, res);
  if (!opts.out_dir.empty()) {
    nlohmann::json j = res.to_json();
    j["mode"] = opts.mode == SimMode::kSync ? "sync" : "async";
    j["arrivals_only"] = opts.arrivals_only;
    j["workers"] = opts.workers;
    j["backups"] = opts.backups;
    j["quorum"] = opts.adaptive ? nlohmann::json("auto") : nlohmann::json(opts.workers - opts.backups);
    j["grace_ms"] = opts.grace_ms;
    j["quorum_histogram"] = nlohmann::json::object();
    for (const auto& [q, n] : res.quorum_hist) j["quorum_histogram"][std::to_string(q)] = n;
    j["straggler"] = collectives::StragglerModel::parse(cfg.straggler.model).spec();
    j["seed"] = cfg.run.seed;
    j["alpha_us"] = opts.alpha_us;
    j["beta_ns_per_byte"] = opts.beta_ns_per_byte;
    j["rtt_us"] = opts.rtt_us;
    auto table = [](const std::map<int, double>& t) {
      nlohmann::json o = nlohmann::json::object();
      for (const auto& [n, ms] : t) o[std::to_string(n)] = ms;
      return o;
    };
    j["step_cost_full_ms"] = table(opts.step_cost_full_ms);
    j["step_cost_backup_ms"] = table(opts.step_cost_backup_ms);
    j["target_accuracy"] = cfg.train.target_accuracy;
    j["budget"] = cfg.train.budget;
    j["evals"] = nlohmann::json::array();
    for (const auto& e : res.evals)
      j["evals"].push_back({{"step", e.step}, {"virtual_s", e.virtual_s},
                            {"test_accuracy", e.accuracy}, {"test_loss", e.loss}});
    std::ofstream(fs::path(opts.out_dir) / "summary.json") << j.dump(2) << '\n';
  }
  return res;
}

}  // namespace qring::train
