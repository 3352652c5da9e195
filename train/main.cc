// qring-train: synchronous data-parallel SGD with backup workers.
//
//   qring-launch -n 4 -- qring-train --config configs/fmnist-mlp.toml [key=value ...]
//   srun qring-train --config configs/fmnist-mlp.toml quorum.quorum=3
//
// Exit status: 0 done, 1 runtime failure (a deadline passed, drift, a diverged run, out of
// memory...), 2 bad command line, configuration or data (a fresh run into a run directory
// that holds checkpoints included), 74 the job is lost (fewer live ranks than its quorum
// allows, its coordinator silent without a successor, a step that no coordinator decided or
// a collective that did not complete by its deadline: qring-launch restarts no rank after
// it), 75 this rank was evicted while alive (paused or too slow; the others went on without
// it), 76 stopped by SIGTERM/SIGUSR1 after writing the checkpoint of the step every rank stopped
// after (train/stop_signals.h; go on with --resume).
#include <fmt/format.h>
#include <omp.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/quorum/quorum.h"
#include "collectives/session.h"
#include "net/rendezvous/bootstrap.h"
#include "net/base/build_info.h"
#include "net/base/cli.h"
#include "net/base/error.h"
#include "net/base/out_of_memory.h"
#include "train/config.h"
#include "train/stop_signals.h"
#include "train/trainer.h"

// Every allocation of this program that fails says how much it asked for and for what
// (AllocationFailed, net/base/out_of_memory.h), instead of a bare std::bad_alloc. The
// library's operator delete frees with free(), which pairs with the malloc here.
void* operator new(std::size_t n) {
  while (true) {
    if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
    std::new_handler h = std::get_new_handler();
    if (h == nullptr) throw qring::AllocationFailed(n);
    h();
  }
}
void* operator new[](std::size_t n) {
  return ::operator new(n);
}

namespace {

constexpr int kExitJobLost = 74;  // QuorumLost: qring-launch stops restarting ranks
constexpr int kExitEvicted = 75;  // qring-launch --tolerate-failures counts it as a lost rank

struct Args {
  std::string config_path;
  bool resume = false;
  bool force = false;
  bool print_config = false;
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
  app.add_flag("--force", a.force,
               "a fresh run deletes the checkpoints an earlier run left under its run directory "
               "(without it, it refuses to start)");
  app.add_flag("--print-config", a.print_config,
               "print the resolved configuration (file, overrides, defaults) as TOML and exit");
  qring::cli::add_overrides(app, a.overrides,
                            "quorum.quorum=3 straggler.model=fixed:2:200 train.epochs=1 "
                            "net.provider=tcp");
  app.footer(
      "Rank and world come from qring-launch, Slurm (srun), mpirun/PMI or QRING_RANK,\n"
      "QRING_WORLD_SIZE and QRING_STORE; without them it runs as a single process.\n"
      "SIGTERM or SIGUSR1: every rank finishes the same step, writes its checkpoint and exits\n"
      "76 (a second signal ends it at once); go on with --resume. Exit status: 0 done; 1 a\n"
      "runtime failure; 2 bad command line, configuration or data, or a run directory with an\n"
      "earlier run's checkpoints (--resume or --force); 74 the job is lost (too few live\n"
      "ranks, or no successor to a silent coordinator); 75 this rank was evicted; 76 stopped\n"
      "by SIGTERM/SIGUSR1 after checkpointing.\n"
      "QRING_FAULT=kill:RANK:STEP[:PHASE] | kill-locked:RANK:STEP[:PHASE] |\n"
      "kill-posting:RANK:STEP[:PHASE] | stop:RANK:STEP:MS[:PHASE] |\n"
      "stop-locked:RANK:STEP:MS[:PHASE] injects a real fault\n"
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
  if (a.resume && a.force) {
    fmt::print(stderr, "qring-train: --resume and --force exclude each other (see --help)\n");
    return 2;
  }
  if (a.config_path.empty()) {
    fmt::print(stderr, "qring-train: --config FILE is required (see --help)\n");
    return 2;
  }
  return a;
}

// "qhost1 (2 ranks), qhost2 (2 ranks)": the hosts of the job in rank order.
std::string hosts_text(const std::vector<std::string>& hosts) {
  std::vector<std::pair<std::string, int>> runs;
  for (const auto& h : hosts) {
    auto it = std::find_if(runs.begin(), runs.end(), [&](const auto& r) { return r.first == h; });
    if (it == runs.end())
      runs.emplace_back(h, 1);
    else
      ++it->second;
  }
  std::string s;
  for (const auto& [h, n] : runs)
    s += fmt::format("{}{} ({} rank{})", s.empty() ? "" : ", ", h, n, n == 1 ? "" : "s");
  return s;
}

// One incarnation of this rank: rendezvous, connect, train (its summary into `s`), and state
// the result.
void run_incarnation(const qring::net::BootstrapInfo& info, const qring::train::TrainConfig& cfg,
                     const Args& args, const std::atomic<int>* stop,
                     std::chrono::steady_clock::time_point process_start,
                     qring::train::RunSummary& s) {
  qring::collectives::SessionOptions so;
  so.provider = cfg.net.provider;
  so.setup_timeout = std::chrono::milliseconds(std::max<int64_t>(30000, cfg.quorum.deadline_ms));
  so.comm.timeout = std::chrono::milliseconds(std::max<int64_t>(60000, cfg.quorum.deadline_ms));
  qring::collectives::Session session(info, so);
  qring::collectives::Communicator& comm = session.comm();
  const std::vector<std::string>& hosts = session.rendezvous().hostnames();
  // The first line of rank 0's log: what runs, where, over what.
  if (info.rank == 0 && session.incarnation() == 0)
    spdlog::info("{}; {} rank{} on {}; provider {}", qring::build::version_text("qring-train"),
                 info.world_size, info.world_size == 1 ? "" : "s", hosts_text(hosts),
                 comm.provider());
  qring::train::TrainerOptions topts;
  topts.resume = args.resume && session.incarnation() == 0;
  topts.force = args.force;
  topts.stop = stop;
  topts.hosts = hosts;
  topts.store = session.store();
  topts.incarnation = session.incarnation();
  topts.local_ranks = info.local_size;
  topts.process_start = process_start;
  if (const char* f = std::getenv("QRING_FAULT"); f && session.incarnation() == 0)
    topts.faults = qring::collectives::FaultSpec::parse_list(f);
  s = qring::train::train(cfg, comm, topts);
  session.lost(s.evicted_ranks);
  if (s.preempted) {
    // Every rank stopped after the same step and checkpointed it.
    fmt::print("rank {} stopped after step {} params_checksum {:016x}\n", info.rank, s.steps,
               s.params_checksum);
  } else if (info.rank == 0 && session.incarnation() == 0) {
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
  Args args = std::get<Args>(parsed);
  const std::string& config_path = args.config_path;
  const std::vector<std::string>& overrides = args.overrides;
  // Set by SIGTERM/SIGUSR1 once the configuration is read, before anything that takes time
  // (sync mode; async mode has no checkpoints, so there the signals keep their default action).
  const std::atomic<int>* stop = nullptr;

  qring::net::BootstrapInfo info;
  qring::train::TrainConfig cfg;
  try {
    cfg = qring::train::TrainConfig::from_file(config_path, overrides);
    cfg.net.provider = qring::collectives::provider_setting(cfg.net.provider);
    if (args.print_config) {
      fmt::print("{}", cfg.to_toml());
      return 0;
    }
    info = qring::net::detect_bootstrap();
    cfg.validate(info.world_size);
  } catch (const qring::Error& e) {
    fmt::print(stderr, "qring-train: rank {}: {}\n", info.rank, e.what());
    return 2;
  }
  if (cfg.train.mode == "sync") stop = &qring::train::install_stop_signals();

  // The run's outputs (checkpoints, metrics) are its owner's unless run.umask says otherwise.
  ::umask(static_cast<mode_t>(std::stoi(cfg.run.umask, nullptr, 8)));

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
  // A rank that left because it fell behind (quorum.max_lag: stopped again and again, alive
  // and heard) rejoins without counting: each time it was admitted and took a step first.
  constexpr int kMaxRejoins = 8;
  qring::train::RunSummary summary;
  int rejoins = 0;  // after evictions that were not for lag
  for (;;) {
    try {
      run_incarnation(info, cfg, args, stop, process_start, summary);
    } catch (const qring::collectives::Evicted& e) {
      // Alive, but the others went on without this rank: come back, or leave with the status
      // qring-launch counts as a lost rank (--tolerate-failures).
      const bool behind = dynamic_cast<const qring::collectives::Behind*>(&e) != nullptr;
      spdlog::log(behind ? spdlog::level::warn : spdlog::level::err, "{}", e.what());
      if (info.store_hosted && info.world_size > 1 && (behind || rejoins++ < kMaxRejoins)) {
        spdlog::warn("rank {}: rejoining the job as a new incarnation", info.rank);
        continue;
      }
      return kExitEvicted;
    } catch (const qring::collectives::CollectiveTimeout& e) {
      // QuorumLost (too few live ranks, no successor to a silent coordinator), a step no
      // coordinator decided in time, a collective given up at its deadline: no step
      // completes any more, and a new incarnation could not rejoin either.
      spdlog::error("{}", e.what());
      return kExitJobLost;
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
    } catch (const std::bad_alloc& e) {
      spdlog::error("rank {}: {}", info.rank, qring::out_of_memory_message(e));
      return 1;
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
      return 1;
    }
    break;
  }
  return summary.preempted ? qring::train::kExitPreempted : 0;
}
