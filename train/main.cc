// qring-train: synchronous data-parallel SGD with backup workers.
//
//   qring-launch -n 4 -- qring-train --config configs/fmnist-mlp.toml [key=value ...]
//   srun qring-train --config configs/fmnist-mlp.toml quorum.quorum=3
//
// Exit status: 0 done, 1 runtime failure (the job lost more ranks than its quorum allows, a
// deadline passed, drift...), 2 bad command line, configuration or data, 75 this rank was
// evicted while alive (paused or too slow; the others went on without it).
#include <fmt/format.h>
#include <omp.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/quorum/quorum.h"
#include "net/rendezvous/bootstrap.h"
#include "net/base/cli.h"
#include "net/base/error.h"
#include "net/transport/fabric_endpoint.h"
#include "train/config.h"
#include "train/trainer.h"

namespace {

constexpr int kExitEvicted = 75;  // qring-launch --tolerate-failures counts it as a lost rank

struct Args {
  std::string config_path;
  bool resume = false;
  std::vector<std::string> overrides;
};

// The command line, or the exit status of --help (0) or of a usage error (2).
std::variant<Args, int> parse_args(int argc, char** argv) {
  Args a;
  CLI::App app{
      "Synchronous data-parallel SGD with backup workers (usage: qring-train --config FILE "
      "[--resume] [section.key=value ...]).",
      "qring-train"};
  qring::cli::init(app);
  app.add_option("--config", a.config_path,
                 "TOML run configuration (see configs/ and docs/training.md); required");
  app.add_flag("--resume", a.resume, "continue from the newest checkpoint every rank has");
  qring::cli::add_overrides(app, a.overrides,
                            "quorum.quorum=3 straggler.model=fixed:2:200 train.epochs=1 "
                            "net.provider=tcp");
  app.footer(
      "Rank and world come from qring-launch, Slurm (srun), mpirun/PMI or QRING_RANK,\n"
      "QRING_WORLD_SIZE and QRING_STORE; without them it runs as a single process.\n"
      "QRING_FAULT=kill:RANK:STEP[:PHASE] | kill-locked:RANK:STEP[:PHASE] |\n"
      "stop:RANK:STEP:MS[:PHASE] injects a real fault\n"
      "(fault tests; collectives/fault_inject.h).");
  if (int rc = qring::cli::parse(app, qring::cli::args_of(argc, argv)); rc >= 0) return rc;
  for (const std::string& o : a.overrides) {
    if (o.find('=') == std::string::npos) {
      fmt::print(stderr,
                 "qring-train: unknown argument '{}' (overrides are key=value; see "
                 "--help)\n",
                 o);
      return 2;
    }
  }
  if (a.config_path.empty()) {
    fmt::print(stderr, "qring-train: --config FILE is required (see --help)\n");
    return 2;
  }
  return a;
}

// One incarnation of this rank: rendezvous, connect, train, and state the result.
void run_incarnation(const qring::net::BootstrapInfo& info, const qring::train::TrainConfig& cfg,
                     bool resume, std::chrono::steady_clock::time_point process_start) {
  auto deadline = qring::net::deadline_in(
      std::chrono::milliseconds(std::max<int64_t>(30000, cfg.quorum.deadline_ms)));
  qring::net::Rendezvous rdv(info, deadline);
  qring::net::FabricOptions fo;
  fo.provider = cfg.net.provider;
  fo.incarnation = rdv.incarnation();
  fo.join = rdv.incarnation() > 0;
  auto ep = qring::net::make_fabric_endpoint(fo, info.rank, info.world_size, rdv.store(),
                                             rdv.single_host(), deadline);
  qring::collectives::CommOptions co;
  co.local_size = info.local_size;
  co.timeout = std::chrono::milliseconds(std::max<int64_t>(60000, cfg.quorum.deadline_ms));
  qring::collectives::Communicator comm(std::move(ep), co);
  qring::train::TrainerOptions topts;
  topts.resume = resume;
  topts.store = info.world_size > 1 ? &rdv.store() : nullptr;
  topts.incarnation = rdv.incarnation();
  topts.process_start = process_start;
  if (const char* f = std::getenv("QRING_FAULT"); f && rdv.incarnation() == 0)
    topts.faults = qring::collectives::FaultSpec::parse_list(f);
  auto s = qring::train::train(cfg, comm, topts);
  rdv.lost(s.evicted_ranks);
  if (info.rank == 0 && rdv.incarnation() == 0) {
    fmt::print(
        "test_accuracy {:.4f} best {:.4f} wall_s {:.1f} steps {} samples_per_s {:.0f} "
        "mean_contributors {:.2f} dropped_gradients {} backup_saved_s {:.1f} "
        "params_checksum {:016x}\n",
        s.test_accuracy, s.best_test_accuracy, s.wall_s, s.steps, s.samples_per_s,
        s.mean_contributors, s.dropped_gradients, s.backup_saved_s, s.params_checksum);
  } else {
    // Every rank states its final parameters so logs show the replicas agree.
    fmt::print("rank {} params_checksum {:016x}\n", info.rank, s.params_checksum);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  auto parsed = parse_args(argc, argv);
  if (const int* rc = std::get_if<int>(&parsed)) return *rc;
  const std::string config_path = std::get<Args>(parsed).config_path;
  bool resume = std::get<Args>(parsed).resume;
  const std::vector<std::string> overrides = std::get<Args>(parsed).overrides;

  qring::net::BootstrapInfo info;
  qring::train::TrainConfig cfg;
  try {
    info = qring::net::detect_bootstrap();
    cfg = qring::train::TrainConfig::from_file(config_path, overrides);
    if (const char* p = std::getenv("QRING_PROVIDER"); p && cfg.net.provider == "auto")
      cfg.net.provider = p;
    cfg.validate(info.world_size);
  } catch (const qring::Error& e) {
    fmt::print(stderr, "qring-train: rank {}: {}\n", info.rank, e.what());
    return 2;
  }

  auto level = spdlog::level::from_str(cfg.log.level);
  spdlog::set_level(info.rank == 0 ? level : std::max(level, spdlog::level::warn));
  spdlog::set_pattern(fmt::format("[%H:%M:%S.%e] [%^%l%$] [rank {}] %v", info.rank));

  // Compute threads: the cores of this host shared among its ranks, unless OMP_NUM_THREADS.
  if (!std::getenv("OMP_NUM_THREADS")) {
    int hw = static_cast<int>(std::thread::hardware_concurrency());
    omp_set_num_threads(std::max(1, hw / std::max(1, info.local_size)));
  }

  const auto process_start = std::chrono::steady_clock::now();
  // A rank evicted while alive (paused longer than quorum.evict_ms) comes back as a new
  // incarnation when the store outlives the ranks (QRING_STORE_HOSTED: qring-launch, or
  // qring-store under Slurm), at most kMaxRejoins times; otherwise it leaves with status 75.
  constexpr int kMaxRejoins = 8;
  for (int attempt = 0;; ++attempt) {
    try {
      run_incarnation(info, cfg, resume, process_start);
    } catch (const qring::collectives::Evicted& e) {
      // Alive, but the others went on without this rank: come back, or leave with the status
      // qring-launch counts as a lost rank (--tolerate-failures).
      spdlog::error("{}", e.what());
      if (info.store_hosted && info.world_size > 1 && attempt < kMaxRejoins) {
        spdlog::warn("rank {}: rejoining the job as a new incarnation", info.rank);
        resume = false;
        continue;
      }
      return kExitEvicted;
    } catch (const qring::collectives::JobOver& e) {
      // Came back after the others had finished: the job is done, without this rank.
      spdlog::warn("{}", e.what());
      return 0;
    } catch (const qring::ConfigError& e) {
      spdlog::error("{}", e.what());
      return 2;
    } catch (const qring::DataError& e) {
      spdlog::error("{}", e.what());
      return 2;
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
      return 1;
    }
    break;
  }
  return 0;
}
