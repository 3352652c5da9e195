// qring-launch -n N [--provider P] [--port PORT] [--timeout-s S] [--bind cores|none]
//              [--tolerate-failures K] [--max-restarts N] [--prefix all|others|none]
//              [--stop-grace-s S] [--finish-grace-s S] -- CMD ARGS...
// qring-launch --nnodes H --node-rank I --master HOST:PORT -n N [...] -- CMD ARGS...
//   (on each of H hosts, torchrun's shape: ranks I*N .. I*N+N-1 run on host I; node 0 serves
//   the store on HOST:PORT; every launcher needs the same QRING_JOB_SECRET)
//
// The launcher serves the job's rendezvous store itself (QRING_STORE_HOSTED=1), so that it
// outlives every rank: a rank that died can be started again (--max-restarts) and rejoins the
// running job, rank 0 included (docs/design.md, "Rejoin").
//
// Starts N local ranks of CMD with the QRING_* bootstrap environment, binds each to its share
// of the launcher's CPUs (QRING_CPUS lists them; --bind none leaves them unbound), prefixes
// their output with "[rank R] ", forwards SIGINT/SIGTERM/SIGHUP, and stops everything when
// one rank fails -- or, with --tolerate-failures K, when more than K ranks have failed (a rank
// exiting non-zero, 75 = evicted, or killed by a signal is "lost"; the others keep running).
// --max-restarts N starts a failed rank again, until a rank exits 74 (qring-train: the job is
// lost): nothing can rejoin a lost job, so no rank is restarted after that.
// The end of a job: once a rank of this host exited 0 (the job finished), a rank that stays
// stopped (SIGSTOP, no CPU time) for 2 s, or that still runs --finish-grace-s later (default
// 30), can no longer take part: it is killed (SIGKILL), reported (which rank, stopped or hung,
// since when) and counted lost, never restarted, so that the launcher ends with the survivors.
// Exit status: 0 when every rank exits 0; 100 + k when k ranks were lost (k <= K, or killed
// at the end as above) and every other rank exited 0; the status of the failing rank that
// stopped the job (128 + signal when it was killed by a signal); 128 + signal when the
// launcher itself was signalled, except 76 when it forwarded SIGTERM/SIGUSR1 and the ranks
// answered with 76 (qring-train: checkpointed and stopped; rerun with --resume); 124 on
// --timeout-s; 2 on a usage error. Across hosts each launcher reports its own ranks; K and
// restarts count this host's ranks, and the launcher of node 0 serves the store until the
// other hosts' ranks have closed their connections (at most 60 s after its own ranks ended).
// See docs/bootstrap.md. Deaths are recorded as (rank, incarnation) as the launcher reaps them;
// node 0's launcher records the other hosts' ranks' deaths when their store connections close.
// Each rank runs under a supervisor (a fork of the launcher, see supervise()) that leads the
// rank's process group, kills that group if the launcher dies (even by SIGKILL), and removes
// the shm regions a rank killed by SIGKILL leaves in /dev/shm (see remove_shm_regions_of()).
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "net/base/cli.h"
#include "net/rendezvous/bootstrap.h"  // store_bind_address: --master's address on node 0
#include "net/rendezvous/store.h"  // the rendezvous store it serves; random_hex: the job id and secret
#include "net/transport/shm_region.h"

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr auto kKillGrace = std::chrono::seconds(3);   // SIGTERM, then SIGKILL after this
constexpr auto kDrainLimit = std::chrono::seconds(1);  // output still read after the last exit
constexpr int kMaxRanks = 4096;
// 100 + lost ranks must stay below 124 (timeout), 127 (cannot execute) and 128 + signal.
constexpr int kMaxTolerated = 23;
constexpr int kDegradedBase = 100;
// qring-train: "the job is lost" (too few live ranks, a step or collective given up at its
// deadline).
constexpr int kJobLostStatus = 74;
constexpr int kEvictedStatus = 75;  // qring-train: "this rank was evicted from the job"
// qring-train: "stopped by SIGTERM/SIGUSR1 after checkpointing the agreed step". When the
// launcher forwarded such a signal and every rank ended so, the launcher exits with it too.
constexpr int kPreemptedStatus = 76;
// How long the launcher of node 0 keeps serving the store after its own ranks ended, while
// ranks of other hosts still hold connections to it.
constexpr auto kStoreLinger = std::chrono::seconds(60);
// The signal a rank's supervisor gets when the launcher dies (PR_SET_PDEATHSIG); it blocks it
// and only acts when its parent is really gone, so a stray SIGUSR2 changes nothing.
constexpr int kLauncherGone = SIGUSR2;
constexpr auto kOrphanKillLimit = std::chrono::seconds(2);  // supervisor: rank after SIGKILL
// After the job finished (a rank exited 0): how long a rank may stay stopped before it is killed.
constexpr auto kStoppedAtEndLimit = std::chrono::seconds(2);

struct Options {
  int n = 0;  // ranks on this host
  // Across hosts (torchrun's shape): one launcher per host, node_rank in [0, nnodes); node 0
  // serves the store on `master` (HOST:PORT), which every rank connects to.
  int nnodes = 1;
  int node_rank = 0;
  std::string master_host;
  int master_port = 0;
  std::string job_id;        // --job-id (default: derived from the secret and --master)
  double stop_grace_s = 30;  // a forwarded signal: time for the ranks to end before SIGKILL
  double finish_grace_s = 30;  // after a rank exited 0: time for the others to end
  std::string provider;
  int port = 0;
  double timeout_s = 0;
  bool bind = true;
  int tolerate = 0;
  int max_restarts = 0;
  // --prefix: which ranks' output lines get "[rank R] " (all, others = every rank but 0, none).
  std::string prefix = "all";
  std::vector<std::string> cmd;
};

// The flags of a job across hosts (torchrun's shape) and of stopping.
void add_host_flags(CLI::App& app, Options& o) {
  using qring::cli::to_int;
  qring::cli::add_value(app, "--nnodes",
                        "hosts of the job, one launcher on each (default 1); the ranks of host R "
                        "are R*n .. R*n+n-1")
      ->each([&](const std::string& v) { o.nnodes = int(to_int("--nnodes", v, 1, kMaxRanks)); });
  qring::cli::add_value(app, "--node-rank", "this host's index, 0 .. nnodes-1 (default 0)")
      ->each([&](const std::string& v) {
        o.node_rank = int(to_int("--node-rank", v, 0, kMaxRanks - 1));
      });
  qring::cli::add_value(app, "--master",
                        "HOST:PORT where the launcher of node 0 serves the job's rendezvous store "
                        "(an address of node 0 every host reaches); required with --nnodes > 1. "
                        "Every launcher needs the same QRING_JOB_SECRET in its environment")
      ->each([&](const std::string& v) {
        const size_t colon = v.rfind(':');
        if (colon == std::string::npos || colon == 0)
          throw qring::ConfigError(fmt::format("--master expects HOST:PORT, got '{}'", v));
        o.master_host = v.substr(0, colon);
        o.master_port = int(to_int("--master (port)", v.substr(colon + 1), 1, 65535));
      });
  qring::cli::add_value(app, "--job-id",
                        "the job's id, the same on every host (default: derived from "
                        "QRING_JOB_SECRET and --master)")
      ->each([&](const std::string& v) {
        if (v.empty()) throw qring::ConfigError("--job-id needs a value");
        o.job_id = v;
      });
  qring::cli::add_value(app, "--stop-grace-s",
                        "after a signal it forwards (SIGTERM, SIGUSR1, SIGINT, SIGHUP), wait S "
                        "seconds for the ranks to end before SIGKILL (default 30: qring-train "
                        "finishes its step and writes a checkpoint); a second signal kills at once")
      ->each([&](const std::string& v) {
        o.stop_grace_s = qring::cli::to_seconds("--stop-grace-s", v, 86400, /*zero_ok=*/true);
      });
  qring::cli::add_value(app, "--finish-grace-s",
                        "once a rank exited 0 (the job finished), kill a rank still running S "
                        "seconds later (default 30), or one stopped (SIGSTOP) for 2 s or S if "
                        "less, and count it lost")
      ->each([&](const std::string& v) {
        o.finish_grace_s = qring::cli::to_seconds("--finish-grace-s", v, 86400, /*zero_ok=*/true);
      });
}

// What is wrong with a combination of flags ("" when nothing is).
std::string check_options(const Options& o) {
  const long world = long(o.n) * o.nnodes;
  if (world > kMaxRanks)
    return fmt::format("-n {} x --nnodes {} = {} ranks, more than {}", o.n, o.nnodes, world,
                       kMaxRanks);
  if (o.tolerate >= world)
    return o.nnodes == 1
               ? fmt::format("--tolerate-failures {} must be below -n {} (one rank must survive)",
                             o.tolerate, o.n)
               : fmt::format(
                     "--tolerate-failures {} must be below the {} ranks of the job (one "
                     "rank must survive)",
                     o.tolerate, world);
  if (o.node_rank >= o.nnodes)
    return fmt::format("--node-rank {} is not below --nnodes {}", o.node_rank, o.nnodes);
  if (o.nnodes > 1 && o.master_host.empty())
    return fmt::format(
        "--nnodes {} needs --master HOST:PORT (node 0's address, where "
        "it serves the rendezvous store)",
        o.nnodes);
  if (!o.master_host.empty() && o.port != 0)
    return "--port and --master exclude each other (--master carries the port)";
  const char* secret = std::getenv("QRING_JOB_SECRET");
  if (!o.master_host.empty() && !qring::net::is_loopback_host(o.master_host) &&
      (secret == nullptr || std::strlen(secret) < 16))
    return "--master on a network address needs the job secret: export QRING_JOB_SECRET=<the same "
           "random string of 16+ characters on every host>, e.g. $(od -An -N16 -tx1 /dev/urandom "
           "| tr -d ' \\n')";
  return "";
}

// The launcher's own flags come before "--", the command after it. Returns the options, or
// the exit status of a usage error or of --help.
std::variant<Options, int> parse_args(int argc, char** argv) {
  using qring::cli::to_int;
  Options o;
  std::vector<std::string> args = qring::cli::args_of(argc, argv);
  const auto dashes = std::find(args.begin(), args.end(), "--");
  if (dashes != args.end()) o.cmd.assign(dashes + 1, args.end());
  const bool have_cmd = dashes != args.end();
  args.erase(dashes, args.end());

  CLI::App app{
      "Starts N local ranks of CMD (usage: qring-launch -n N [flags] -- CMD [ARGS...]) with "
      "the QRING_* bootstrap environment and serves their rendezvous store; across hosts, one "
      "launcher per host: qring-launch --nnodes H --node-rank I --master HOST:PORT -n N -- CMD.",
      "qring-launch"};
  qring::cli::init(app);
  qring::cli::add_value(app, "-n,--nproc-per-node", "number of ranks to start on this host")
      ->each([&](const std::string& v) { o.n = int(to_int("-n", v, 1, kMaxRanks)); });
  add_host_flags(app, o);
  qring::cli::add_value(app, "--provider", "sets QRING_PROVIDER=P for every rank")
      ->each([&](const std::string& v) {
        if (v.empty()) throw qring::ConfigError("--provider needs a value");
        o.provider = v;
      });
  qring::cli::add_value(app, "--port", "rendezvous store port (default: a free port)")
      ->each([&](const std::string& v) { o.port = int(to_int("--port", v, 1, 65535)); });
  qring::cli::add_value(app, "--timeout-s", "kill all ranks and exit 124 after S seconds")
      ->each([&](const std::string& v) {
        o.timeout_s = qring::cli::to_seconds("--timeout-s", v, 1e7);
      });
  qring::cli::add_value(
      app, "--bind",
      "cores (default): each rank gets its share of the CPUs this launcher may use, "
      "contiguous blocks when N <= CPUs, else CPU (rank mod CPUs), so ring neighbours "
      "run on different CPUs; none: ranks are not bound")
      ->each([&](const std::string& v) {
        if (v != "cores" && v != "none")
          throw qring::ConfigError(fmt::format("--bind expects 'cores' or 'none', got '{}'", v));
        o.bind = v == "cores";
      });
  qring::cli::add_value(
      app, "--tolerate-failures",
      "keep the other ranks running while at most K ranks (K < N, K <= 23) have "
      "failed (exited non-zero, 75 = evicted, or killed by a signal); exit 100 + lost "
      "ranks if all others exit 0. Default 0: fail-fast")
      ->each([&](const std::string& v) {
        o.tolerate = int(to_int("--tolerate-failures", v, 0, kMaxTolerated));
      });
  qring::cli::add_value(app, "--max-restarts",
                        "start a rank that failed again, up to N times per rank (N <= 1000); it "
                        "rejoins the running job. A rank lost beyond N restarts counts as above; "
                        "none is restarted once a rank exited 74 (the job is lost)")
      ->each([&](const std::string& v) {
        o.max_restarts = int(to_int("--max-restarts", v, 0, 1000));
      });
  qring::cli::add_value(app, "--prefix",
                        "all (default): every output line starts with \"[rank R] \"; others: rank "
                        "0's lines are passed through as they are (a single rank's table or log "
                        "reads as if run alone); none: no line is prefixed")
      ->each([&](const std::string& v) {
        if (v != "all" && v != "others" && v != "none")
          throw qring::ConfigError(
              fmt::format("--prefix expects 'all', 'others' or 'none', got '{}'", v));
        o.prefix = v;
      });
  app.footer(
      "Exit status: 0 every rank exited 0; 100+k k ranks lost within --tolerate-failures, the\n"
      "others exited 0; 76 a forwarded SIGTERM/SIGUSR1 made every rank checkpoint and stop\n"
      "(qring-train; go on with --resume); the failing rank's status when one stopped the job\n"
      "(128+signal when it was killed); 100+k also when k ranks stopped (SIGSTOP) or hung after\n"
      "another exited 0 were killed (--finish-grace-s); 128+signal when the launcher was\n"
      "signalled; 124 the --timeout-s expired; 127 the command cannot be executed; 2 bad\n"
      "command line.");
  qring::cli::ParseOptions po;
  po.unknown_hint = "(the command follows '--')";
  if (int rc = qring::cli::parse(app, args, po); rc >= 0) return rc;
  auto usage_error = [](const std::string& msg) {
    fmt::print(stderr, "qring-launch: {} (see --help)\n", msg);
    return 2;
  };
  if (o.n == 0) return usage_error("-n N is required");
  if (!have_cmd || o.cmd.empty()) return usage_error("no command given after '--'");
  if (std::string why = check_options(o); !why.empty()) return usage_error(why);
  return o;
}

// The CPUs of each rank under --bind cores, from the CPUs this process may run on. N <= CPUs:
// contiguous blocks whose sizes differ by at most one (a rank's OpenMP threads share a
// block). N > CPUs: rank r gets CPU r mod CPUs, so consecutive ranks (ring neighbours) sit on
// different CPUs and can run at the same time instead of being moved between CPUs by the
// scheduler (measurements: docs/benchmarks.md, "The numbers behind the defaults").
std::vector<std::vector<int>> plan_cpus(int n) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  std::vector<std::vector<int>> plan{size_t(n)};
  if (cpus.empty()) return plan;  // unknown: leave every rank unbound
  const int m = static_cast<int>(cpus.size());
  for (int r = 0; r < n; ++r) {
    if (n > m) {
      plan[size_t(r)] = {cpus[size_t(r % m)]};
    } else {
      int base = m / n, extra = m % n;
      int begin = r * base + std::min(r, extra), len = base + (r < extra ? 1 : 0);
      plan[size_t(r)].assign(cpus.begin() + begin, cpus.begin() + begin + len);
    }
  }
  return plan;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t w = write(fd, s.data() + off, s.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // our own output is gone (EPIPE): keep supervising
    off += static_cast<size_t>(w);
  }
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

struct Stream {
  int fd = -1;
  int rank = 0;
  int out_fd = 1;  // where the prefixed lines go
  std::string partial;
  std::string prefix;  // "[rank R] ", or empty (--prefix)
};

// How a rank ended, for the messages: "exited with status 3", "was evicted (exit status 75)",
// "was killed by signal 9 (SIGKILL)".
std::string describe_end(int status) {
  if (WIFEXITED(status)) {
    int code = WEXITSTATUS(status);
    if (code == kEvictedStatus) return fmt::format("was evicted (exit status {})", code);
    return fmt::format("exited with status {}", code);
  }
  int sig = WTERMSIG(status);
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("was killed by signal {} (SIG{})", sig, abbrev)
                : fmt::format("was killed by signal {}", sig);
}

// libfabric 1.17's shm provider names each endpoint's region /dev/shm/<pid>:<n>:<m> after the
// process that opened it (16 MiB each; a qring rank opens one per peer, see
// net/transport/fabric_endpoint.cc) and unlinks it when the endpoint closes, or on SIGINT/SIGTERM.
// A process killed by SIGKILL leaves its regions until a later process with the same pid starts
// shm. Whoever reaps a process of this job (a rank's supervisor its rank, the launcher the
// orphans it adopts) removes them while the zombie still holds the pid: no live process can
// own a region named after it, so only what this dead process left goes (and only our own
// files). First it releases a region lock the process died holding (net/transport/shm_region.h):
// otherwise every rank that sends to it spins inside the provider forever, whose mappings
// outlive the file. Returns how many regions were removed; `released` gets the names of the
// regions whose lock was released.
int remove_shm_regions_of(pid_t dead, std::vector<std::string>& released) {
  int removed = 0;
  for (const std::string& name : qring::net::shm_regions_of(dead)) {
    if (qring::net::release_dead_shm_lock(name, dead, std::chrono::milliseconds(50)))
      released.push_back(name);
    if (unlink(("/dev/shm/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

// Removes what the exited but unreaped process `pid` left in /dev/shm, then reaps it; returns
// its wait status. `who` names it in the message ("rank 2 (pid 123)").
int reap_and_clean(pid_t pid, const std::string& who) {
  std::vector<std::string> released;
  const int n = remove_shm_regions_of(pid, released);
  if (!released.empty())
    write_all(2, fmt::format("qring-launch: {} died holding the lock of its shared-memory "
                             "region{} /dev/shm/{}; released {} (every rank that sends to it "
                             "would wait inside the shm provider for good)\n",
                             who, released.size() == 1 ? "" : "s", fmt::join(released, ", "),
                             released.size() == 1 ? "it" : "them"));
  if (n > 0)
    write_all(2, fmt::format("qring-launch: removed {} shared-memory region{} that {} left in "
                             "/dev/shm ({}:*)\n",
                             n, n == 1 ? "" : "s", who, pid));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  // Killed, it may have been posting to a live rank, holding that rank's own region lock.
  using qring::net::kLiveLockConfirm;
  if (WIFSIGNALED(status))
    for (const std::string& name : qring::net::release_locks_held_by_the_dead(kLiveLockConfirm))
      write_all(2, fmt::format("qring-launch: the shared-memory region /dev/shm/{} of a live "
                               "process stayed locked after {} died, by no live process; "
                               "released it (its owner waited inside the shm provider)\n",
                               name, who));
  return status;
}

// Ends this process the way a rank ended: the same exit status, or the same signal (without
// a core dump: the rank's own core, if any, is the one that matters).
[[noreturn]] void exit_like(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    signal(sig, SIG_DFL);
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, sig);
    sigprocmask(SIG_UNBLOCK, &s, nullptr);
    kill(getpid(), sig);
    _exit(128 + sig);  // a signal whose default action is not to terminate
  }
  _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}

// A rank's supervisor: the parent of the rank and the leader of its process group (the
// launcher's handle on the rank: its pid is the group's id, and it outlives the rank, so that
// id cannot be reused while the group's processes may still be signalled). It ignores the
// signals the launcher forwards to the group, waits for the rank, removes the rank's shm
// regions and exits as the rank did. If the launcher dies (even by SIGKILL, which the rank's
// wrapper scripts and their children would survive: a parent-death signal reaches only the
// direct child), it kills the rank and then the whole group, itself included.
[[noreturn]] void supervise(pid_t rank_pid, pid_t launcher, int r) {
  if (rank_pid < 0) {
    write_all(2, fmt::format("qring-launch: rank {}: fork(): {}\n", r, std::strerror(errno)));
    _exit(1);
  }
  const std::string who = fmt::format("rank {} (pid {})", r, rank_pid);
  sigset_t wait_set;
  sigemptyset(&wait_set);
  sigaddset(&wait_set, SIGCHLD);
  sigaddset(&wait_set, kLauncherGone);
  std::optional<Clock::time_point> orphaned_at;
  while (true) {
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(rank_pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == rank_pid) {
      int status = reap_and_clean(rank_pid, who);
      if (orphaned_at) kill(0, SIGKILL);  // the rest of the group, and this process
      exit_like(status);
    }
    if (!orphaned_at && getppid() != launcher) {
      orphaned_at = Clock::now();
      kill(rank_pid, SIGKILL);
    }
    if (orphaned_at && Clock::now() >= *orphaned_at + kOrphanKillLimit) kill(0, SIGKILL);
    timespec tick{0, 200'000'000};
    sigtimedwait(&wait_set, nullptr, &tick);
  }
}

struct Rank {
  pid_t pid = -1;  // the rank's supervisor, leader of its process group
  bool running = false;
  int restarts = 0;  // --max-restarts: times it was started again (its incarnation)
  // After the job finished: why the launcher killed it (stopped or hung; empty: it did not).
  std::string abandoned;
  // Since when it has been seen stopped, using no CPU time (cpu_ticks), after the job finished.
  std::optional<Clock::time_point> stopped_since;
  unsigned long long cpu_ticks = 0;
};

// A death the launcher saw for certain (it reaped the process): which rank, which of its
// incarnations (0: the first process, k: the k-th restart), and how it ended.
struct LostRank {
  int rank = 0;
  int incarnation = 0;
  pid_t pid = -1;
  std::string how;  // describe_end(), or why the launcher killed it at the end
};

class Launcher {
 public:
  explicit Launcher(Options o) : opts_(std::move(o)) {}
  int run();

 private:
  void start_rank(int r, const sigset_t& child_mask, const std::vector<int>& cpus);
  void on_output(Stream& s);
  void flush_partial(Stream& s);
  void reap();
  // A death seen for certain, recorded in the store this launcher serves (store.h dead_key).
  void witness(int r, int incarnation, const std::string& how);
  void begin_stop(int sig, const std::string& why, int code, bool forwarded = false);
  void signal_all(int sig);
  bool any_child_left();
  // run()'s steps.
  std::unique_ptr<qring::net::TcpStoreServer> serve_store();
  void event_loop(int sfd);
  int poll_timeout_ms(Clock::time_point now, const std::optional<Clock::time_point>& timeout_at,
                      const std::optional<Clock::time_point>& drain_until) const;
  void wait_for_input(int sfd, std::vector<pollfd>& pfds, int wait_ms);
  void read_signals(int sfd);
  void report_lost_ranks();
  void end_unfinished_ranks(Clock::time_point now);
  bool waiting_for_end() const;
  void choose_identity();
  void linger_for_other_hosts(int sfd, const qring::net::TcpStoreServer& store);
  // This host's rank `local` in the job.
  int global_rank(int local) const { return opts_.node_rank * opts_.n + local; }
  int world() const { return opts_.n * opts_.nnodes; }

  Options opts_;
  // One identity per launch, the same for every rank: a unique job id, and the secret each
  // rank proves to the rendezvous store (docs/bootstrap.md).
  std::string job_id_;
  std::string job_secret_;
  int port_ = 0;
  std::string store_address_;  // HOST:PORT the ranks connect to
  int preempted_ = 0;          // ranks that ended with kPreemptedStatus while stopping
  int stopped_otherwise_ = 0;  // ranks that ended with another failure while stopping
  sigset_t child_mask_{};
  std::vector<std::vector<int>> cpus_;
  std::vector<Rank> ranks_;
  std::vector<Stream> streams_;
  std::vector<LostRank> lost_;  // --tolerate-failures: ranks lost so far, in order
  qring::net::TcpStoreServer* store_ = nullptr;  // node 0: the store it serves
  // The job finished: when the first rank of this host exited 0, and which.
  std::optional<Clock::time_point> finished_at_;
  int finished_rank_ = -1;
  // Why the job is known lost (a rank exited kJobLostStatus); no rank is restarted after it.
  std::string job_lost_;
  bool stopping_ = false;
  bool killed_ = false;
  int signals_received_ = 0;
  Clock::time_point kill_at_;
  int exit_code_ = 0;
};

void Launcher::start_rank(int r, const sigset_t& child_mask, const std::vector<int>& cpus) {
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
    fmt::print(stderr, "qring-launch: pipe(): {}\n", std::strerror(errno));
    begin_stop(SIGTERM, "", 1);
    return;
  }
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    fmt::print(stderr, "qring-launch: fork(): {}\n", std::strerror(errno));
    for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
    begin_stop(SIGTERM, "", 1);
    return;
  }
  if (pid == 0) {
    // The rank's supervisor (see supervise()): leads a new process group (so a group kill
    // reaches the rank's whole tree), notices the launcher's death, ignores the signals
    // forwarded to the group. kLauncherGone is blocked before it can arrive.
    setpgid(0, 0);
    sigset_t gone;
    sigemptyset(&gone);
    sigaddset(&gone, kLauncherGone);
    sigprocmask(SIG_BLOCK, &gone, nullptr);
    prctl(PR_SET_PDEATHSIG, kLauncherGone);
    if (getppid() != parent) _exit(1);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1}) signal(sig, SIG_IGN);
    dup2(out[1], 1);
    dup2(err[1], 2);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    const pid_t supervisor = getpid();
    if (pid_t rank_pid = fork(); rank_pid != 0) supervise(rank_pid, parent, global_rank(r));
    // The rank: in the supervisor's group, dies with the supervisor, default signal state,
    // stdin from /dev/null.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != supervisor) _exit(1);
    for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1}) signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &child_mask, nullptr);
    setenv("QRING_RANK", std::to_string(global_rank(r)).c_str(), 1);
    setenv("QRING_WORLD_SIZE", std::to_string(world()).c_str(), 1);
    setenv("QRING_LOCAL_RANK", std::to_string(r).c_str(), 1);
    setenv("QRING_LOCAL_SIZE", std::to_string(opts_.n).c_str(), 1);
    setenv("QRING_NODE_RANK", std::to_string(opts_.node_rank).c_str(), 1);
    setenv("QRING_NNODES", std::to_string(opts_.nnodes).c_str(), 1);
    setenv("QRING_STORE", store_address_.c_str(), 1);
    setenv("QRING_JOB_ID", job_id_.c_str(), 1);
    setenv("QRING_JOB_SECRET", job_secret_.c_str(), 1);
    setenv("QRING_STORE_HOSTED", "1", 1);
    setenv("QRING_RESTART", std::to_string(ranks_[size_t(r)].restarts).c_str(), 1);
    setenv("QRING_TOLERATE_FAILURES", std::to_string(opts_.tolerate).c_str(), 1);
    if (!opts_.provider.empty()) setenv("QRING_PROVIDER", opts_.provider.c_str(), 1);
    unsetenv("QRING_CPUS");  // set below only when this rank is bound
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cpus) CPU_SET(c, &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) {
        setenv("QRING_CPUS", fmt::format("{}", fmt::join(cpus, ",")).c_str(), 1);
      } else {
        write_all(2, fmt::format("qring-launch: rank {}: cannot bind to CPUs {}: {}; running "
                                 "unbound\n",
                                 r, fmt::join(cpus, ","), std::strerror(errno)));
      }
    }
    std::vector<char*> argv;
    for (auto& a : opts_.cmd) argv.push_back(a.data());
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    std::string msg =
        fmt::format("qring-launch: cannot execute '{}': {}\n", opts_.cmd[0], std::strerror(errno));
    write_all(2, msg);
    _exit(127);
  }
  setpgid(pid, pid);  // also here, so that no kill(-pid) can precede the child's own call
  close(out[1]);
  close(err[1]);
  for (int fd : {out[0], err[0]}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  ranks_[r].pid = pid;
  ranks_[r].running = true;
  const int g = global_rank(r);
  const bool bare = opts_.prefix == "none" || (opts_.prefix == "others" && g == 0);
  const std::string prefix = bare ? std::string() : fmt::format("[rank {}] ", g);
  streams_.push_back({out[0], r, 1, {}, prefix});
  streams_.push_back({err[0], r, 2, {}, prefix});
}

void Launcher::on_output(Stream& s) {
  char buf[65536];
  while (true) {
    ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // EOF or error: flush what is left
      flush_partial(s);
      close(s.fd);
      s.fd = -1;
      return;
    }
    s.partial.append(buf, static_cast<size_t>(n));
    std::string lines;
    size_t start = 0, nl;
    while ((nl = s.partial.find('\n', start)) != std::string::npos) {
      lines += s.prefix;
      lines.append(s.partial, start, nl + 1 - start);
      start = nl + 1;
    }
    s.partial.erase(0, start);
    if (!lines.empty()) write_all(s.out_fd, lines);
  }
}

void Launcher::flush_partial(Stream& s) {
  if (s.partial.empty()) return;
  write_all(s.out_fd, fmt::format("{}{}\n", s.prefix, s.partial));
  s.partial.clear();
}

// What /proc/<pid>/stat says about a process (also a zombie).
struct ProcStat {
  char state = 0;  // R, S, D, T (stopped by a signal), t (traced), Z ...
  pid_t ppid = 0;
  pid_t pgrp = -1;
  unsigned long long cpu_ticks = 0;  // user + system time
};
std::optional<ProcStat> read_proc_stat(pid_t pid) {
  char buf[1024];
  size_t n = 0;
  if (FILE* f = std::fopen(fmt::format("/proc/{}/stat", pid).c_str(), "r")) {
    n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
  }
  // "pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
  // stime ...": comm may contain spaces, so parse after the last ')'.
  std::string stat(buf, n);
  auto close_paren = stat.rfind(')');
  ProcStat s;
  unsigned long long utime = 0, stime = 0;
  if (close_paren == std::string::npos ||
      std::sscanf(stat.c_str() + close_paren + 1,
                  " %c %d %d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &s.state, &s.ppid,
                  &s.pgrp, &utime, &stime) != 5)
    return std::nullopt;
  s.cpu_ticks = utime + stime;
  return s;
}

std::vector<pid_t> all_pids() {
  std::vector<pid_t> out;
  DIR* d = opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    pid_t pid = 0;
    auto [p, ec] = std::from_chars(e->d_name, e->d_name + std::strlen(e->d_name), pid);
    if (ec == std::errc() && *p == '\0') out.push_back(pid);
  }
  closedir(d);
  return out;
}

// Our direct children, from /proc: the ranks, and (as a subreaper) orphaned descendants.
std::vector<pid_t> child_pids() {
  std::vector<pid_t> out;
  const pid_t self = getpid();
  for (pid_t pid : all_pids())
    if (auto st = read_proc_stat(pid); st && st->ppid == self) out.push_back(pid);
  return out;
}

// The process group of `pid` (also of a zombie), or -1.
pid_t process_group_of(pid_t pid) {
  const auto st = read_proc_stat(pid);
  return st ? st->pgrp : -1;
}

// A rank's processes (its supervisor's group, the supervisor left out): whether one of them
// is stopped by a signal, and the CPU time they have used (unchanged: none of them ran).
struct RankProcesses {
  std::vector<pid_t> pids;
  bool stopped = false;
  unsigned long long cpu_ticks = 0;
};
RankProcesses rank_processes(pid_t supervisor) {
  RankProcesses r;
  for (pid_t pid : all_pids()) {
    const auto st = read_proc_stat(pid);
    if (!st || st->pgrp != supervisor || pid == supervisor) continue;
    r.pids.push_back(pid);
    r.stopped |= st->state == 'T';
    r.cpu_ticks += st->cpu_ticks;
  }
  return r;
}

Clock::duration seconds_of(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

void Launcher::signal_all(int sig) {
  for (const auto& r : ranks_)
    if (r.pid > 0) kill(-r.pid, sig);  // the rank's process group, grandchildren included
  // Descendants that left their group (setsid) and were orphaned are our children now.
  for (pid_t p : child_pids()) kill(p, sig);
}

bool Launcher::any_child_left() {
  siginfo_t info{};
  return waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) == 0;
}

// `forwarded`: a signal the launcher received goes to the ranks, which get --stop-grace-s to
// end (qring-train checkpoints); otherwise a rank failed and the others get kKillGrace.
void Launcher::begin_stop(int sig, const std::string& why, int code, bool forwarded) {
  if (!why.empty()) write_all(2, "qring-launch: " + why + "\n");
  if (!stopping_) {
    stopping_ = true;
    exit_code_ = code;
    kill_at_ = Clock::now() +
               (forwarded ? seconds_of(opts_.stop_grace_s) : Clock::duration(kKillGrace));
  }
  signal_all(sig);
}

void Launcher::reap() {
  while (true) {
    siginfo_t info{};
    if (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid <= 0) return;
    const pid_t p = info.si_pid;
    auto it = std::find_if(ranks_.begin(), ranks_.end(), [&](const Rank& r) { return r.pid == p; });
    if (it == ranks_.end()) {
      // An orphan we adopted as subreaper: a rank's descendant, or a rank whose supervisor
      // was killed first. Its shm regions go with it.
      const pid_t group = process_group_of(p);
      auto owner = std::find_if(ranks_.begin(), ranks_.end(),
                                [&](const Rank& r) { return group > 0 && r.pid == group; });
      reap_and_clean(p, owner == ranks_.end()
                            ? fmt::format("process {}", p)
                            : fmt::format("a process of rank {} (pid {})",
                                          global_rank(int(owner - ranks_.begin())), p));
      continue;
    }
    int status = 0;
    if (waitpid(p, &status, 0) != p) continue;
    it->running = false;
    const int local = static_cast<int>(it - ranks_.begin());
    const int r = global_rank(local);
    bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    if (stopping_ && WIFEXITED(status) && WEXITSTATUS(status) == kPreemptedStatus)
      ++preempted_;
    else if (stopping_ && failed)
      ++stopped_otherwise_;
    if (!failed && !stopping_ && !finished_at_) {
      finished_at_ = Clock::now();
      finished_rank_ = r;
    }
    if (failed) witness(r, it->restarts, describe_end(status));
    if (!failed || stopping_) continue;
    if (!it->abandoned.empty()) {  // killed at the end of the job (end_unfinished_ranks)
      lost_.push_back({r, it->restarts, p, it->abandoned + "; killed by the launcher"});
      continue;
    }
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code == kJobLostStatus && job_lost_.empty()) {
      job_lost_ = fmt::format("rank {} exited with status {}: the job is lost", r, code);
      if (opts_.max_restarts > 0)
        write_all(2,
                  fmt::format("qring-launch: {}; no rank is restarted from now on\n", job_lost_));
    }
    if (it->restarts < opts_.max_restarts && !job_lost_.empty())
      write_all(2, fmt::format("qring-launch: rank {} (pid {}) {}; not restarting it ({})\n", r, p,
                               describe_end(status), job_lost_));
    if (it->restarts < opts_.max_restarts && job_lost_.empty()) {
      // What the failed rank left in its process group goes; a new process of the rank
      // rejoins the running job (docs/design.md, "Rejoin").
      kill(-p, SIGKILL);
      ++it->restarts;
      write_all(2, fmt::format("qring-launch: rank {} (pid {}) {}; restarting it (restart {} of "
                               "{})\n",
                               r, p, describe_end(status), it->restarts, opts_.max_restarts));
      start_rank(local, child_mask_, cpus_[size_t(local)]);
      write_all(2, fmt::format("qring-launch: rank {} restarted (pid {})\n", r,
                               ranks_[size_t(local)].pid));
      continue;
    }
    if (opts_.tolerate > 0) {
      lost_.push_back({r, it->restarts, p, describe_end(status)});
      const int lost = static_cast<int>(lost_.size());
      std::string what =
          fmt::format("rank {} (pid {}) {}; {} of {} ranks{} lost", r, p, lost_.back().how, lost,
                      opts_.n, opts_.nnodes > 1 ? " on this host" : "");
      if (lost <= opts_.tolerate) {
        write_all(2, fmt::format("qring-launch: {}, tolerating up to {}\n", what, opts_.tolerate));
        // What the lost rank left behind in its process group has no use any more.
        kill(-p, SIGKILL);
        continue;
      }
      // Fail-fast from here on. A status in the degraded-success range would read as success.
      if (code > kDegradedBase && code <= kDegradedBase + opts_.tolerate) code = 1;
      begin_stop(SIGTERM,
                 fmt::format("{}, more than the {} tolerated; stopping the other ranks", what,
                             opts_.tolerate),
                 code);
      continue;
    }
    if (WIFEXITED(status)) {
      begin_stop(SIGTERM,
                 fmt::format("rank {} exited with status {}; stopping the other ranks", r,
                             WEXITSTATUS(status)),
                 WEXITSTATUS(status));
    } else {
      int sig = WTERMSIG(status);
      begin_stop(
          SIGTERM,
          fmt::format("rank {} killed by signal {}; stopping the other ranks", r, signal_name(sig)),
          128 + sig);
    }
  }
}

void Launcher::witness(int r, int incarnation, const std::string& how) {
  if (store_) store_->record(qring::net::dead_key(r, uint32_t(incarnation)), how);
}

// The job's identity: one launcher makes its own; launchers on several hosts share the secret
// from their environment (QRING_JOB_SECRET; a loopback store may do without) and derive the
// same job id from it and --master, unless --job-id names one.
void Launcher::choose_identity() {
  const char* env_secret = std::getenv("QRING_JOB_SECRET");
  if (opts_.nnodes == 1 && opts_.master_host.empty()) {
    job_id_ = opts_.job_id.empty()
                  ? fmt::format("launch-{}-{}", getpid(), qring::net::random_hex(4))
                  : opts_.job_id;
    job_secret_ = qring::net::random_hex(32);
    return;
  }
  job_secret_ = env_secret ? env_secret : "";
  if (job_secret_.empty() && opts_.nnodes == 1) job_secret_ = qring::net::random_hex(32);
  job_id_ = opts_.job_id;
  if (job_id_.empty()) {
    const std::string mac = qring::net::hmac_sha256(
        job_secret_, fmt::format("qring-launch-job|{}:{}", opts_.master_host, opts_.master_port));
    std::string hex;
    for (size_t i = 0; i < 8; ++i) hex += fmt::format("{:02x}", uint8_t(mac[i]));
    job_id_ = "launch-" + hex;
  }
}

int Launcher::run() {
  choose_identity();
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  signal(SIGPIPE, SIG_IGN);
  sigset_t mask, old_mask;
  sigemptyset(&mask);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1}) sigaddset(&mask, sig);
  sigprocmask(SIG_BLOCK, &mask, &old_mask);
  child_mask_ = old_mask;
  // Node 0 serves the store (on loopback, or on --master); the others use node 0's.
  std::unique_ptr<qring::net::TcpStoreServer> store;
  if (opts_.node_rank == 0) {
    store = serve_store();
    if (!store) return 1;
    store_ = store.get();
    port_ = store->port();
    store_address_ =
        fmt::format("{}:{}", opts_.master_host.empty() ? "127.0.0.1" : opts_.master_host, port_);
  } else {
    port_ = opts_.master_port;
    store_address_ = fmt::format("{}:{}", opts_.master_host, port_);
  }

  int sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
  if (sfd < 0) {
    fmt::print(stderr, "qring-launch: signalfd(): {}\n", std::strerror(errno));
    return 1;
  }
  ranks_.resize(opts_.n);
  cpus_ = opts_.bind ? plan_cpus(opts_.n) : std::vector<std::vector<int>>(size_t(opts_.n));
  for (int r = 0; r < opts_.n && !stopping_; ++r) start_rank(r, old_mask, cpus_[size_t(r)]);

  event_loop(sfd);
  for (auto& s : streams_) {
    flush_partial(s);
    if (s.fd >= 0) close(s.fd);
  }
  if (store && opts_.nnodes > 1 && signals_received_ == 0 && exit_code_ == 0)
    linger_for_other_hosts(sfd, *store);
  close(sfd);
  report_lost_ranks();
  if (signals_received_ > 0 && preempted_ > 0 && stopped_otherwise_ == 0) {
    // A forwarded SIGTERM/SIGUSR1 that every rank answered by checkpointing and stopping.
    exit_code_ = kPreemptedStatus;
    write_all(2, fmt::format("qring-launch: the ranks stopped after checkpointing (exit status "
                             "{}); run the same command with --resume to go on\n",
                             kPreemptedStatus));
  }
  return exit_code_;
}

// Node 0's ranks have ended, but ranks of other hosts may still use the store (their last
// steps, a rank that restarts): it is served until every rank has closed its connection, a
// signal arrives, or kStoreLinger has passed.
void Launcher::linger_for_other_hosts(int sfd, const qring::net::TcpStoreServer& store) {
  const auto until = Clock::now() + kStoreLinger;
  bool said = false;
  while (store.connected_ranks() > 0 && Clock::now() < until) {
    if (!said) {
      write_all(2, fmt::format("qring-launch: this host's ranks are done; serving the store until "
                               "the other hosts' ranks end (at most {} s)\n",
                               kStoreLinger.count()));
      said = true;
    }
    pollfd p{sfd, POLLIN, 0};
    if (poll(&p, 1, 200) > 0) {
      signalfd_siginfo si;
      while (read(sfd, &si, sizeof(si)) == static_cast<ssize_t>(sizeof(si)))
        if (si.ssi_signo != SIGCHLD) return;
    }
  }
}

// The job's rendezvous store, on loopback (the ranks are on this host) or on --master's
// address, for as long as the launcher runs: ranks that come back find it there. Its thread
// starts after the signals are blocked, so that they all reach the signalfd. Null (reported)
// when it cannot start.
std::unique_ptr<qring::net::TcpStoreServer> Launcher::serve_store() {
  spdlog::set_pattern("qring-launch: store: %v");
  spdlog::set_level(spdlog::level::warn);
  std::unique_ptr<qring::net::TcpStoreServer> store;
  std::string bind = "127.0.0.1";
  const int port = opts_.master_host.empty() ? opts_.port : opts_.master_port;
  try {
    if (!opts_.master_host.empty()) bind = qring::net::store_bind_address(opts_.master_host);
    qring::net::StoreServerOptions so;
    so.secret = job_secret_;
    // The other hosts' ranks are not this launcher's to reap: their store connections closing
    // are their deaths, witnessed (a killed process's socket closes; a host that vanishes
    // without closing them leaves the majority rule).
    so.witness_deaths = opts_.nnodes > 1;
    so.witness_first_rank = opts_.n;
    store = std::make_unique<qring::net::TcpStoreServer>(bind, port, world(), job_id_, so);
  } catch (const std::exception& e) {
    fmt::print(stderr, "qring-launch: cannot serve the rendezvous store on {}:{}: {}\n", bind, port,
               e.what());
    return nullptr;
  }
  return store;
}

// Runs until every rank and what it left behind are gone and their output is drained (or the
// processes outlive SIGKILL): reaps, enforces the timeout, forwards signals, relays output.
void Launcher::event_loop(int sfd) {
  std::optional<Clock::time_point> timeout_at;
  if (opts_.timeout_s > 0)
    timeout_at = Clock::now() + seconds_of(opts_.timeout_s);
  std::optional<Clock::time_point> drain_until;
  std::vector<pollfd> pfds;
  while (true) {
    reap();
    bool ranks_done = std::none_of(ranks_.begin(), ranks_.end(), [](auto& r) { return r.running; });
    bool children_left = any_child_left();
    bool output_open =
        std::any_of(streams_.begin(), streams_.end(), [](auto& s) { return s.fd >= 0; });
    auto now = Clock::now();
    if (ranks_done && children_left && !stopping_) {
      // Every rank exited 0 but left processes behind: stop them too.
      begin_stop(SIGTERM, "", 0);
    }
    if (ranks_done && !children_left) {
      if (!output_open) break;
      if (!drain_until) drain_until = now + kDrainLimit;
      if (now >= *drain_until) break;
    }
    end_unfinished_ranks(now);
    if (timeout_at && now >= *timeout_at && !stopping_) {
      begin_stop(SIGTERM,
                 fmt::format("timeout of {} s expired; killing all ranks", opts_.timeout_s), 124);
    }
    if (stopping_ && now >= kill_at_ && children_left) {
      if (!killed_) write_all(2, "qring-launch: processes left after SIGTERM; sending SIGKILL\n");
      killed_ = true;
      signal_all(SIGKILL);  // repeated: orphans reparented to us since the last pass
      if (now >= kill_at_ + kKillGrace) {
        write_all(2, "qring-launch: processes survive SIGKILL (uninterruptible?); giving up\n");
        break;
      }
    }
    const int wait_ms = poll_timeout_ms(now, timeout_at, drain_until);
    wait_for_input(sfd, pfds, wait_ms);
    read_signals(sfd);
    for (auto& s : streams_)
      if (s.fd >= 0) on_output(s);
  }
}

int Launcher::poll_timeout_ms(Clock::time_point now,
                              const std::optional<Clock::time_point>& timeout_at,
                              const std::optional<Clock::time_point>& drain_until) const {
  Clock::time_point wake = now + std::chrono::seconds(1);
  if (timeout_at && !stopping_) wake = std::min(wake, *timeout_at);
  if (stopping_ && !killed_) wake = std::min(wake, kill_at_);
  if (killed_) wake = std::min(wake, now + milliseconds(50));
  if (drain_until) wake = std::min(wake, *drain_until);
  if (waiting_for_end()) wake = std::min(wake, now + milliseconds(100));
  return static_cast<int>(
      std::max<int64_t>(0, std::chrono::duration_cast<milliseconds>(wake - now).count() + 1));
}

void Launcher::wait_for_input(int sfd, std::vector<pollfd>& pfds, int wait_ms) {
  pfds.clear();
  pfds.push_back({sfd, POLLIN, 0});
  for (auto& s : streams_)
    if (s.fd >= 0) pfds.push_back({s.fd, POLLIN, 0});
  if (poll(pfds.data(), pfds.size(), wait_ms) < 0 && errno != EINTR) {
    fmt::print(stderr, "qring-launch: poll(): {}\n", std::strerror(errno));
    begin_stop(SIGKILL, "", 1);
    killed_ = true;
  }
}

// Signals to the launcher go to every rank; a second one kills them all.
void Launcher::read_signals(int sfd) {
  signalfd_siginfo si;
  while (read(sfd, &si, sizeof(si)) == static_cast<ssize_t>(sizeof(si))) {
    int sig = static_cast<int>(si.ssi_signo);
    if (sig == SIGCHLD) continue;  // reap() runs at the top of the loop
    if (signals_received_++ > 0) {
      write_all(2, fmt::format("qring-launch: {} again; killing all ranks\n", signal_name(sig)));
      killed_ = true;
      signal_all(SIGKILL);
    } else {
      begin_stop(sig, fmt::format("received {}; forwarding it to all ranks", signal_name(sig)),
                 stopping_ ? exit_code_ : 128 + sig, /*forwarded=*/true);
    }
  }
}

// The end of the job (see the header): once a rank of this host exited 0, a rank that stays
// stopped for kStoppedAtEndLimit (or --finish-grace-s if less), or still runs
// --finish-grace-s later, is killed (its supervisor reaps it and cleans up) and counted lost.
void Launcher::end_unfinished_ranks(Clock::time_point now) {
  if (!waiting_for_end()) return;
  const Clock::duration grace = seconds_of(opts_.finish_grace_s);
  const Clock::duration stopped_limit = std::min<Clock::duration>(kStoppedAtEndLimit, grace);
  const double since_finish = std::chrono::duration<double>(now - *finished_at_).count();
  for (size_t i = 0; i < ranks_.size(); ++i) {
    Rank& rank = ranks_[i];
    if (!rank.running || !rank.abandoned.empty()) continue;
    const RankProcesses procs = rank_processes(rank.pid);
    if (!procs.stopped || (rank.stopped_since && procs.cpu_ticks != rank.cpu_ticks))
      rank.stopped_since.reset();  // running, or it ran since it was last seen stopped
    if (procs.stopped && !rank.stopped_since) {
      rank.stopped_since = now;
      rank.cpu_ticks = procs.cpu_ticks;
    }
    if (rank.stopped_since && now - *rank.stopped_since >= stopped_limit)
      rank.abandoned = fmt::format(
          "was stopped (SIGSTOP) for {:.1f} s after rank {} finished the job",
          std::chrono::duration<double>(now - *rank.stopped_since).count(), finished_rank_);
    else if (now - *finished_at_ >= grace)
      rank.abandoned = fmt::format(
          "was still running (hung) {:.1f} s after rank {} finished the job (--finish-grace-s)",
          since_finish, finished_rank_);
    if (rank.abandoned.empty()) continue;
    write_all(2, fmt::format("qring-launch: rank {} (pid {}) {}; killing it\n",
                             global_rank(int(i)), rank.pid, rank.abandoned));
    for (pid_t p : procs.pids) kill(p, SIGKILL);
  }
}

bool Launcher::waiting_for_end() const {
  return finished_at_ && !stopping_ &&
         std::any_of(ranks_.begin(), ranks_.end(),
                     [](const Rank& r) { return r.running && r.abandoned.empty(); });
}

void Launcher::report_lost_ranks() {
  if (exit_code_ == 0 && !lost_.empty()) {
    // Degraded success: every rank that was not lost exited 0.
    std::vector<std::string> list;
    for (const auto& l : lost_)
      list.push_back(fmt::format("rank {}{} (pid {}) {}", l.rank,
                                 l.incarnation > 0 ? fmt::format(" incarnation {}", l.incarnation)
                                                   : std::string(),
                                 l.pid, l.how));
    exit_code_ = kDegradedBase + std::min(kMaxTolerated, static_cast<int>(lost_.size()));
    write_all(
        2, fmt::format("qring-launch: finished with {} of {} ranks lost{}: {}; exit status {}\n",
                       lost_.size(), opts_.n,
                       opts_.tolerate > 0
                           ? fmt::format(" (tolerating up to {})", opts_.tolerate)
                           : std::string(),
                       fmt::join(list, "; "), exit_code_));
  }
}

}  // namespace

int main(int argc, char** argv) {
  auto parsed = parse_args(argc, argv);
  if (const int* rc = std::get_if<int>(&parsed)) return *rc;
  Options opts = std::get<Options>(std::move(parsed));
  Launcher launcher(std::move(opts));
  return launcher.run();
}
