#include "train/async_sgd.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "collectives/param_server.h"
#include "collectives/straggler.h"
#include "net/base/error.h"
#include "train/dataset.h"
#include "train/measure.h"
#include "train/trainer_core.h"

namespace qring::train {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct ServerResult {
  RunSummary sum;
  int64_t updates = 0;
  double staleness_mean = 0;
  int64_t staleness_max = 0;
  std::vector<int64_t> staleness_hist;
  double iteration_p50_ms = 0, iteration_p90_ms = 0;
};

// Applies push `p` as update `u` at `scale` times the rate. A push or update that is not
// finite fails the run (train.nonfinite = "fail") or is left out and counted ("skip").
void apply_push(const TrainConfig& cfg, TrainerCore& core, const collectives::ParamServer::Push& p,
                double scale, int64_t u, RunSummary& sum) {
  const bool skip = cfg.train.nonfinite == "skip";
  std::string bad = nonfinite_text(p.data, core.num_params());
  if (bad.empty() && !core.apply_gradient_finite(p.data, scale, 0, skip))
    bad = "a parameter after the update";
  if (bad.empty()) return;
  if (!skip)
    throw Error(fmt::format("async SGD server: update {} (worker {}'s push {}): {} is not "
                            "finite: the run diverged (train.lr = {}); train.nonfinite = "
                            "\"skip\" leaves such pushes out instead",
                            u, p.rank, p.index, bad, cfg.train.lr));
  if (sum.nonfinite_steps++ % 100 == 0)
    spdlog::warn("update {}: worker {}'s push left out: {} is not finite ({} so far)", u, p.rank,
                 bad, sum.nonfinite_steps);
}

// The server loop on rank 0 (its own thread): applies every push in arrival order, answers it,
// records the update and evaluates on schedule.
ServerResult serve(const TrainConfig& cfg, const DatasetPair& data, collectives::ParamServer& ps,
                   int world, int64_t per_worker, int64_t spe, std::ofstream& metrics,
                   Clock::time_point t_start) {
  TrainConfig scfg = cfg;
  scfg.train.steps = per_worker * world;
  scfg.train.warmup_steps = cfg.train.warmup_steps * world;
  TrainerCore core(scfg, data, 0, world, 1);
  const size_t P = core.num_params();
  const int64_t total = per_worker * world;
  const int64_t eval_every = (cfg.train.eval_every > 0 ? cfg.train.eval_every : spe) * world;
  ServerResult out;
  RunSummary& sum = out.sum;
  std::vector<Clock::time_point> last_push(size_t(world), t_start);
  std::vector<double> iteration_ms;
  iteration_ms.reserve(size_t(total));
  double stale_sum = 0;
  auto last_progress = Clock::now();

  auto evaluate = [&](int64_t update) {
    EvalResult e = core.evaluate_test();
    const double acc = e.count ? double(e.correct) / double(e.count) : 0;
    const double loss = e.count ? e.loss_sum / double(e.count) : 0;
    const double wall = seconds_since(t_start);
    sum.test_accuracy = acc;
    sum.test_loss = loss;
    sum.best_test_accuracy = std::max(sum.best_test_accuracy, acc);
    if (cfg.train.target_accuracy > 0 && !sum.time_to_target_s && acc >= cfg.train.target_accuracy)
      sum.time_to_target_s = wall;
    metrics << nlohmann::json{{"type", "eval"},
                              {"step", update},
                              {"epoch", update / (spe * world)},
                              {"wall_s", wall},
                              {"test_accuracy", acc},
                              {"test_loss", loss}}
                   .dump()
            << '\n'
            << std::flush;
    spdlog::info("eval at update {}: test accuracy {:.4f}, loss {:.4f}", update, acc, loss);
  };

  for (int64_t u = 0; u < total; ++u) {
    const auto w0 = Clock::now();
    std::optional<collectives::ParamServer::Push> p = ps.next_push();
    if (!p)
      throw UsageError(fmt::format("async SGD server: the workers stopped after {} of {} updates",
                                   u, total));
    const auto got = Clock::now();
    const double wait_ms = std::chrono::duration<double, std::milli>(got - w0).count();
    const int64_t stale = u - int64_t(p->version);
    const double scale = staleness_lr_scale(cfg.train.async_staleness == "divide", stale);
    const double lr = core.lr() * scale;
    const double loss = double(p->data[P]);
    apply_push(cfg, core, *p, scale, u, sum);
    ps.reply(*p, core.params(), uint64_t(u + 1));
    const double it_ms =
        std::chrono::duration<double, std::milli>(got - last_push[size_t(p->rank)]).count();
    last_push[size_t(p->rank)] = got;
    iteration_ms.push_back(it_ms);
    if (size_t(stale) >= out.staleness_hist.size()) out.staleness_hist.resize(size_t(stale) + 1);
    ++out.staleness_hist[size_t(stale)];
    out.staleness_max = std::max(out.staleness_max, stale);
    stale_sum += double(stale);
    metrics << nlohmann::json{{"type", "step"},
                              {"step", u},
                              {"epoch", u / (spe * world)},
                              {"wall_s", seconds_since(t_start)},
                              {"loss", loss},
                              {"lr", lr},
                              {"contributors", 1},
                              {"worker", p->rank},
                              {"push", p->index},
                              {"staleness", stale},
                              {"iteration_ms", it_ms},
                              {"server_wait_ms", wait_ms}}
                   .dump()
            << '\n';
    const int64_t done = u + 1;
    if (cfg.log.progress && (seconds_since(last_progress) > 10 || done == total)) {
      last_progress = Clock::now();
      spdlog::info("update {}/{} loss {:.4f} staleness mean {:.2f}", done, total, loss,
                   stale_sum / double(done));
    }
    if (done % eval_every == 0 && done < total) evaluate(done);
  }
  metrics.flush();
  evaluate(total);
  out.updates = total;
  out.staleness_mean = total ? stale_sum / double(total) : 0;
  out.iteration_p50_ms = quantile(iteration_ms, 0.5);
  out.iteration_p90_ms = quantile(iteration_ms, 0.9);
  sum.params_checksum = checksum(core.params(), P);
  return out;
}

// What the synchronous trainer has and the asynchronous one does not.
void check_async_options(const TrainConfig& cfg, const TrainerOptions& opts) {
  if (opts.resume)
    throw ConfigError("train.mode = \"async\": --resume is not supported (no checkpoints)");
  if (cfg.train.checkpoint_every > 0)
    throw ConfigError("train.checkpoint_every: checkpoints need train.mode = \"sync\"");
  if (!opts.faults.empty())
    throw ConfigError("QRING_FAULT: fault injection needs train.mode = \"sync\"");
}

// This rank's worker: K gradients, each pushed to the server, then the parameters pulled
// back. Returns what failed, if anything.
std::exception_ptr run_worker(TrainerCore& core, size_t P, collectives::ParamServer& ps,
                              const collectives::StragglerModel& straggler, uint64_t seed,
                              int rank, int64_t K) {
  float* const grad = core.gradient();
  std::exception_ptr worker_error;
  try {
    uint64_t version = 0;
    for (int64_t k = 0; k < K; ++k) {
      collectives::sleep_unless(straggler.delay(seed, rank, uint64_t(k)));
      grad[P] = float(core.compute_gradient());
      ps.push(grad, version);
      version = ps.pull(core.params());
    }
  } catch (...) {
    worker_error = std::current_exception();
    if (rank == 0) ps.fail(worker_error);  // nor the server's wait for this worker
  }
  return worker_error;
}

// summary.json of an asynchronous run.
nlohmann::json summary_json(const RunSummary& sum, const ServerResult& served, int world,
                            int64_t K, const std::string& provider,
                            const collectives::StragglerModel& straggler) {
  nlohmann::json j = sum.to_json();
  j["mode"] = "async";
  j["world"] = world;
  j["quorum"] = 1;
  j["provider"] = provider;
  j["straggler"] = straggler.spec();
  j["finished"] = true;
  j["updates"] = served.updates;
  j["gradients_per_worker"] = K;
  j["staleness_mean"] = served.staleness_mean;
  j["staleness_max"] = served.staleness_max;
  j["staleness_hist"] = served.staleness_hist;
  j["iteration_p50_ms"] = served.iteration_p50_ms;
  j["iteration_p90_ms"] = served.iteration_p90_ms;
  return j;
}

}  // namespace

RunSummary train_async(const TrainConfig& cfg, collectives::Communicator& comm,
                       const TrainerOptions& opts) {
  const int rank = comm.rank(), world = comm.size();
  check_async_options(cfg, opts);
  const uint64_t seed = uint64_t(cfg.run.seed);
  const fs::path run_dir = fs::path(cfg.run.out_dir) / cfg.run.name;
  DatasetPair data = load_datasets(cfg.data, seed, opts.local_ranks);
  if (world > 1) check_data_agrees(cfg, data, comm);
  TrainerCore core(cfg, data, rank, world, 1);
  const size_t P = core.num_params();
  const int64_t spe = core.steps_per_epoch();
  if (spe < 1)
    throw ConfigError(fmt::format("train.batch_per_rank: {} samples over {} ranks leave no full "
                                  "batch of {} per rank",
                                  data.train.size(), world, cfg.train.batch_per_rank));
  const int64_t K = core.total_steps();
  const auto straggler = collectives::StragglerModel::parse(cfg.straggler.model);

  collectives::ParamServerOptions po;
  po.server = 0;
  po.pushes_per_worker = K;
  po.deadline = std::chrono::milliseconds(cfg.quorum.deadline_ms);
  // The gradient and, after it, the batch loss (the slot Network::grads() leaves spare).
  collectives::ParamServer ps(comm, P + 1, P, po);

  std::ofstream metrics;
  if (rank == 0) {
    fs::create_directories(run_dir);
    std::ofstream(run_dir / "config.toml") << cfg.to_toml();
    metrics.open(run_dir / "metrics.jsonl", std::ios::trunc);
    if (!metrics) throw DataError(fmt::format("cannot write {}", (run_dir / "metrics.jsonl").string()));
    spdlog::info(
        "async SGD: {} ({} parameters) on {} workers, server on rank 0, {} gradients per worker "
        "({} updates), provider {}, straggler {}",
        cfg.model.type, P, world, K, K * world, comm.provider(), straggler.spec());
  }
  comm.barrier();
  const auto t_start = Clock::now();

  std::thread server;
  ServerResult served;
  std::exception_ptr server_error;
  if (rank == 0) {
    server = std::thread([&] {
      try {
        served = serve(cfg, data, ps, world, K, spe, metrics, t_start);
      } catch (...) {
        server_error = std::current_exception();
        ps.fail(server_error);  // the local worker's pull must not wait for its deadline
      }
    });
  }
  std::exception_ptr worker_error = run_worker(core, P, ps, straggler, seed, rank, K);
  if (server.joinable()) server.join();
  if (server_error) std::rethrow_exception(server_error);
  if (worker_error) std::rethrow_exception(worker_error);

  RunSummary sum;
  sum.params_checksum = checksum(core.params(), P);
  if (rank != 0) return sum;
  sum = served.sum;
  const double loop_s = seconds_since(t_start);
  sum.wall_s = loop_s;
  sum.steps = served.updates;
  sum.samples_per_s = loop_s > 0 ? double(served.updates * cfg.train.batch_per_rank) / loop_s : 0;
  sum.computed_samples_per_s = sum.samples_per_s;
  sum.mean_contributors = 1;
  metrics.close();
  std::ofstream(run_dir / "summary.json")
      << summary_json(sum, served, world, K, comm.provider(), straggler).dump(2) << '\n';
  return sum;
}

}  // namespace qring::train
