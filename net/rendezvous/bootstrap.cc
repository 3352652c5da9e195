// Launch detection and rendezvous (net/rendezvous/bootstrap.h); documented in docs/bootstrap.md.
#include "net/rendezvous/bootstrap.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <charconv>
#include <climits>
#include <cstdlib>

#include "net/base/error.h"
#include "net/rendezvous/hostlist.h"

namespace qring::net {

std::optional<std::string> process_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

namespace {

constexpr auto kExitBarrierTimeout = std::chrono::seconds(10);

int64_t parse_int(const std::string& name, const std::string& value, int64_t min, int64_t max) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || p != value.data() + value.size())
    throw ConfigError(fmt::format("{}='{}' is not an integer", name, value));
  if (v < min || v > max)
    throw ConfigError(fmt::format("{}={} is out of range [{}, {}]", name, v, min, max));
  return v;
}

class Env {
 public:
  explicit Env(const EnvLookup& env) : env_(env) {}
  std::optional<std::string> str(const std::string& name) const {
    auto v = env_(name);
    if (v && v->empty()) return std::nullopt;  // an empty variable counts as unset
    return v;
  }
  bool has(const std::string& name) const { return str(name).has_value(); }
  std::optional<int> integer(const std::string& name, int min, int max = INT_MAX) const {
    auto v = str(name);
    if (!v) return std::nullopt;
    return static_cast<int>(parse_int(name, *v, min, max));
  }
  int required(const std::string& name, int min, const std::string& why) const {
    auto v = integer(name, min);
    if (!v) throw ConfigError(fmt::format("{} is not set ({})", name, why));
    return *v;
  }

 private:
  const EnvLookup& env_;
};

// "host:port" -> (host, port)
std::pair<std::string, int> parse_store(const std::string& name, const std::string& value) {
  auto colon = value.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == value.size())
    throw ConfigError(fmt::format("{}='{}' is not host:port", name, value));
  int port = static_cast<int>(parse_int(name + " port", value.substr(colon + 1), 1, 65535));
  return {value.substr(0, colon), port};
}

void check_rank(const BootstrapInfo& b, const std::string& rank_var, const std::string& size_var) {
  if (b.rank >= b.world_size)
    throw ConfigError(
        fmt::format("{}={} is not below {}={}", rank_var, b.rank, size_var, b.world_size));
}

void check_local(const BootstrapInfo& b, const std::string& rank_var, const std::string& size_var) {
  if (b.local_rank >= b.local_size)
    throw ConfigError(
        fmt::format("{}={} is not below {}={}", rank_var, b.local_rank, size_var, b.local_size));
  if (b.local_size > b.world_size)
    throw ConfigError(
        fmt::format("{}={} exceeds the world size {}", size_var, b.local_size, b.world_size));
}

// A launcher sets its variables in pairs: one without the other is a partial environment.
void require_both(const Env& env, const std::string& a, const std::string& b) {
  for (const auto& [set, unset] : {std::pair{a, b}, std::pair{b, a}})
    if (env.has(set) && !env.has(unset))
      throw ConfigError(fmt::format("{} is set but {} is not; set both (a partial environment)",
                                    set, unset));
}

// With every rank on one host (local size = world size), the local rank is the rank.
void check_one_host(const BootstrapInfo& b, const std::string& rank_var,
                    const std::string& size_var, const std::string& lrank_var,
                    const std::string& lsize_var) {
  if (b.local_size == b.world_size && b.local_rank != b.rank)
    throw ConfigError(fmt::format(
        "{}={} contradicts {}={}: with {}={} = {} every rank is on this host, so the two "
        "must be equal",
        lrank_var, b.local_rank, rank_var, b.rank, lsize_var, b.local_size, size_var));
}

// Slurm's tasks-per-node format "2(x3),1" -> {2,2,2,1}.
std::vector<int> parse_tasks_per_node(const std::string& name, const std::string& value) {
  std::vector<int> out;
  size_t start = 0;
  while (start <= value.size()) {
    size_t comma = value.find(',', start);
    std::string part = value.substr(start, comma == std::string::npos ? value.npos : comma - start);
    int count = 1;
    if (auto paren = part.find("(x"); paren != std::string::npos) {
      if (part.back() != ')') throw ConfigError(fmt::format("{}='{}' is malformed", name, value));
      count = static_cast<int>(
          parse_int(name, part.substr(paren + 2, part.size() - paren - 3), 1, 1 << 20));
      part.resize(paren);
    }
    int tasks = static_cast<int>(parse_int(name, part, 1, 1 << 20));
    if (out.size() + count > (1u << 20))
      throw ConfigError(fmt::format("{}='{}' is too long", name, value));
    out.insert(out.end(), count, tasks);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

BootstrapInfo from_qring_env(const Env& env) {
  BootstrapInfo b;
  b.source = "env";
  if (!env.has("QRING_RANK"))
    throw ConfigError("QRING_WORLD_SIZE is set but QRING_RANK is not; set both");
  if (!env.has("QRING_WORLD_SIZE"))
    throw ConfigError("QRING_RANK is set but QRING_WORLD_SIZE is not; set both");
  b.world_size = *env.integer("QRING_WORLD_SIZE", 1);
  b.rank = *env.integer("QRING_RANK", 0);
  check_rank(b, "QRING_RANK", "QRING_WORLD_SIZE");
  // Without QRING_LOCAL_*, all ranks are assumed to share one host.
  b.local_rank = env.integer("QRING_LOCAL_RANK", 0).value_or(b.rank);
  b.local_size = env.integer("QRING_LOCAL_SIZE", 1).value_or(b.world_size);
  check_local(b, "QRING_LOCAL_RANK", "QRING_LOCAL_SIZE");
  b.job_id = env.str("QRING_JOB_ID").value_or("env");
  if (auto s = env.str("QRING_STORE")) {
    std::tie(b.store_host, b.store_port) = parse_store("QRING_STORE", *s);
  } else if (b.world_size > 1) {
    throw ConfigError(fmt::format(
        "QRING_RANK/QRING_WORLD_SIZE are set (world size {}) but QRING_STORE is not; set "
        "QRING_STORE=host:port of the rendezvous store (rank 0 serves it)",
        b.world_size));
  }
  return b;
}

BootstrapInfo from_slurm(const Env& env) {
  BootstrapInfo b;
  b.source = "slurm";
  b.world_size = env.required("SLURM_NTASKS", 1, "SLURM_PROCID is set, so Slurm launched us");
  b.rank = *env.integer("SLURM_PROCID", 0);
  check_rank(b, "SLURM_PROCID", "SLURM_NTASKS");
  b.local_rank = env.integer("SLURM_LOCALID", 0).value_or(0);

  auto nodelist = env.str("SLURM_STEP_NODELIST");
  if (!nodelist) nodelist = env.str("SLURM_JOB_NODELIST");
  if (nodelist) b.nodes = expand_hostlist(*nodelist);

  // Tasks on this node: the per-node list indexed by SLURM_NODEID, or a single count.
  std::optional<int> local_size;
  for (const char* var : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    auto v = env.str(var);
    if (!v) continue;
    auto per_node = parse_tasks_per_node(var, *v);
    int node = env.integer("SLURM_NODEID", 0).value_or(0);
    if (per_node.size() == 1) node = 0;
    if (static_cast<size_t>(node) >= per_node.size())
      throw ConfigError(fmt::format("SLURM_NODEID={} but {}='{}' lists {} nodes", node, var, *v,
                                    per_node.size()));
    local_size = per_node[node];
    break;
  }
  if (!local_size) local_size = env.integer("SLURM_NTASKS_PER_NODE", 1);
  if (!local_size) {
    if (b.nodes.size() > 1)
      throw ConfigError(
          "Slurm: cannot tell how many tasks run on this node; SLURM_STEP_TASKS_PER_NODE, "
          "SLURM_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE are all unset");
    local_size = b.world_size;  // one node: every task is local
  }
  b.local_size = *local_size;
  check_local(b, "SLURM_LOCALID", "tasks per node");

  auto job = env.str("SLURM_JOB_ID");
  uint64_t job_num = 0;
  uint64_t step_num = 0;
  if (job) job_num = static_cast<uint64_t>(parse_int("SLURM_JOB_ID", *job, 0, INT64_MAX));
  b.job_id = job.value_or("slurm");
  if (auto step = env.str("SLURM_STEP_ID")) {
    step_num = static_cast<uint64_t>(parse_int("SLURM_STEP_ID", *step, 0, INT64_MAX));
    b.job_id += "." + *step;
  }
  // A store served outside the step (qring-store in the batch script) names the job itself.
  if (auto id = env.str("QRING_JOB_ID")) b.job_id = *id;

  if (auto s = env.str("QRING_STORE")) {
    std::tie(b.store_host, b.store_port) = parse_store("QRING_STORE", *s);
  } else if (b.world_size > 1) {
    if (b.nodes.empty())
      throw ConfigError(
          "Slurm: SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are unset; cannot place the "
          "rendezvous store (or set QRING_STORE=host:port)");
    // One node: the store stays on loopback. Several: rank 0 runs on the first node.
    b.store_host = b.nodes.size() == 1 ? "127.0.0.1" : b.nodes.front();
    if (auto port = env.integer("QRING_STORE_PORT", 1, 65535)) {
      b.store_port = *port;
    } else {
      if (!job)
        throw ConfigError(
            "Slurm: SLURM_JOB_ID is unset; cannot derive the store port (set QRING_STORE_PORT)");
      b.store_port = static_cast<int>(20000 + (job_num + step_num * 4099) % 20000);
    }
  }
  return b;
}

BootstrapInfo from_mpi(const Env& env, bool ompi) {
  BootstrapInfo b;
  b.source = "mpi";
  const std::string rank_var = ompi ? "OMPI_COMM_WORLD_RANK" : "PMI_RANK";
  const std::string size_var = ompi ? "OMPI_COMM_WORLD_SIZE" : "PMI_SIZE";
  require_both(env, rank_var, size_var);
  b.world_size = *env.integer(size_var, 1);
  b.rank = *env.integer(rank_var, 0);
  check_rank(b, rank_var, size_var);
  const std::string lrank_var = ompi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "MPI_LOCALRANKID";
  const std::string lsize_var = ompi ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "MPI_LOCALNRANKS";
  require_both(env, lrank_var, lsize_var);
  b.local_rank = env.integer(lrank_var, 0).value_or(b.rank);
  b.local_size = env.integer(lsize_var, 1).value_or(b.world_size);
  check_local(b, lrank_var, lsize_var);
  check_one_host(b, rank_var, size_var, lrank_var, lsize_var);
  // The launcher's job namespace tells two mpirun jobs apart (Open MPI / PMIx).
  b.job_id = "mpi";
  for (const char* var : {"QRING_JOB_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"}) {
    if (auto v = env.str(var)) {
      b.job_id = var == std::string("QRING_JOB_ID") ? *v : "mpi-" + *v;
      break;
    }
  }
  require_both(env, "MASTER_ADDR", "MASTER_PORT");
  if (auto s = env.str("QRING_STORE")) {
    std::tie(b.store_host, b.store_port) = parse_store("QRING_STORE", *s);
  } else if (env.has("MASTER_ADDR")) {
    b.store_host = *env.str("MASTER_ADDR");
    b.store_port = *env.integer("MASTER_PORT", 1, 65535);
  } else if (b.world_size > 1) {
    throw ConfigError(fmt::format(
        "launched by mpirun/PMI ({} is set) but no rendezvous store address: set "
        "QRING_STORE=host:port, or MASTER_ADDR and MASTER_PORT, to an address of the node of "
        "rank 0",
        rank_var));
  }
  return b;
}

// torchrun (torch.distributed.run): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT. MASTER_PORT itself is taken (torchrun's agent serves its own
// store there, or torch.distributed's process group does), so qring's store listens on the
// next port, MASTER_PORT + 1, unless QRING_STORE_PORT or QRING_STORE says otherwise.
BootstrapInfo from_torchrun(const Env& env) {
  BootstrapInfo b;
  b.source = "torchrun";
  require_both(env, "RANK", "WORLD_SIZE");
  b.world_size = *env.integer("WORLD_SIZE", 1);
  b.rank = *env.integer("RANK", 0);
  check_rank(b, "RANK", "WORLD_SIZE");
  require_both(env, "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  b.local_rank = env.integer("LOCAL_RANK", 0).value_or(b.rank);
  b.local_size = env.integer("LOCAL_WORLD_SIZE", 1).value_or(b.world_size);
  check_local(b, "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  check_one_host(b, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  b.job_id = "torchrun";
  if (auto id = env.str("QRING_JOB_ID")) {
    b.job_id = *id;
  } else if (auto run = env.str("TORCHELASTIC_RUN_ID")) {
    b.job_id = "torchrun-" + *run;
  }
  require_both(env, "MASTER_ADDR", "MASTER_PORT");
  if (auto s = env.str("QRING_STORE")) {
    std::tie(b.store_host, b.store_port) = parse_store("QRING_STORE", *s);
  } else if (env.has("MASTER_ADDR")) {
    b.store_host = *env.str("MASTER_ADDR");
    if (auto port = env.integer("QRING_STORE_PORT", 1, 65535)) {
      b.store_port = *port;
    } else {
      const int master = *env.integer("MASTER_PORT", 1, 65535);
      if (master == 65535)
        throw ConfigError(
            "MASTER_PORT=65535 leaves no next port for qring's store (MASTER_PORT + 1); set "
            "QRING_STORE_PORT");
      b.store_port = master + 1;
    }
  } else if (b.world_size > 1) {
    throw ConfigError(fmt::format(
        "torchrun's RANK and WORLD_SIZE are set (world size {}) but MASTER_ADDR and "
        "MASTER_PORT are not; set them (torchrun does), or QRING_STORE=host:port",
        b.world_size));
  }
  return b;
}

// Whether an MPI launcher's rank and world are Slurm's own (srun started the ranks and both
// see them) rather than those of an mpirun nested in a Slurm allocation, whose daemons srun
// started (their SLURM_PROCID is the node, not the rank).
bool same_launch_as_slurm(const Env& env, const std::string& rank_var,
                          const std::string& size_var) {
  return env.str(rank_var) == env.str("SLURM_PROCID") &&
         env.str(size_var) == env.str("SLURM_NTASKS");
}

std::string this_hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

}  // namespace

BootstrapInfo detect_bootstrap(const EnvLookup& lookup) {
  Env env(lookup);
  BootstrapInfo b;
  // The innermost launcher wins: qring-launch (or QRING_* by hand) > torchrun > mpirun/PMI >
  // Slurm, whose allocation may hold any of the others (an MPI launch whose rank and size
  // are Slurm's own is Slurm's).
  const bool ompi = env.has("OMPI_COMM_WORLD_RANK") || env.has("OMPI_COMM_WORLD_SIZE");
  const bool pmi = env.has("PMI_RANK") || env.has("PMI_SIZE");
  const bool slurm = env.has("SLURM_PROCID");
  if (env.has("QRING_RANK") || env.has("QRING_WORLD_SIZE")) {
    b = from_qring_env(env);
  } else if (env.has("RANK") || env.has("WORLD_SIZE")) {
    b = from_torchrun(env);
  } else if (ompi && !(slurm && same_launch_as_slurm(env, "OMPI_COMM_WORLD_RANK",
                                                     "OMPI_COMM_WORLD_SIZE"))) {
    b = from_mpi(env, true);
  } else if (pmi && !(slurm && same_launch_as_slurm(env, "PMI_RANK", "PMI_SIZE"))) {
    b = from_mpi(env, false);
  } else if (slurm) {
    b = from_slurm(env);
  } else {
    // No rank from any launcher: a torchrun variable alone is a partial environment, not a
    // single process.
    for (const char* var : {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
      if (env.has(var))
        throw ConfigError(fmt::format(
            "{} is set but RANK and WORLD_SIZE are not (a partial torchrun environment); "
            "unset it to run one process, or set RANK and WORLD_SIZE",
            var));
    return b;  // single process
  }
  if (b.world_size == 1 && !env.has("QRING_STORE")) b.store_port = 0;
  if (auto h = env.str("QRING_STORE_HOSTED")) {
    if (*h != "0" && *h != "1")
      throw ConfigError(fmt::format("QRING_STORE_HOSTED='{}': expected 0 or 1", *h));
    b.store_hosted = *h == "1";
  }
  if (auto secret = env.str("QRING_JOB_SECRET")) {
    if (const std::string weak = secret_weakness(*secret); !weak.empty())
      throw ConfigError(fmt::format(
          "QRING_JOB_SECRET {}: whoever guesses it can join the job; use a random one, e.g. "
          "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')",
          weak));
    b.job_secret = *secret;
  }
  return b;
}

std::string store_bind_address(const std::string& store_host) {
  in_addr a{};
  if (inet_pton(AF_INET, store_host.c_str(), &a) == 1) return store_host;  // numeric
  if (store_host == "localhost") return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(store_host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr)
    throw ConfigError(fmt::format("rendezvous store host '{}' does not resolve on rank 0: {}",
                                  store_host, gai_strerror(rc)));
  std::string chosen;
  for (addrinfo* i = res; i != nullptr && chosen.empty(); i = i->ai_next) {
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ai_addr)->sin_addr, buf, sizeof(buf));
    if (!is_loopback_host(buf)) chosen = buf;
  }
  freeaddrinfo(res);
  if (chosen.empty()) {
    spdlog::warn(
        "rendezvous store host '{}' resolves only to loopback addresses here, but the other "
        "ranks connect to it by name: the store listens on every interface (set QRING_STORE to "
        "an address of this host to choose one)",
        store_host);
    return "0.0.0.0";
  }
  return chosen;
}

Rendezvous::Rendezvous(const BootstrapInfo& info, Deadline deadline) : info_(info) {
  if (info_.world_size > 1 && info_.store_port == 0)
    throw ConfigError(
        fmt::format("rank {} of {}: no rendezvous store port", info_.rank, info_.world_size));
  std::string host = this_hostname();
  if (info_.store_port == 0) {
    owned_ = std::make_unique<MemoryStore>();  // single process
  } else {
    const bool loopback = is_loopback_host(info_.store_host);
    if (info_.job_secret.empty() && !loopback)
      throw ConfigError(fmt::format(
          "rank {}: the rendezvous store {}:{} is not on loopback, so the job needs a secret: "
          "set QRING_JOB_SECRET to the same random string (16+ characters) on every rank "
          "(qring-launch and scripts/slurm do this)",
          info_.rank, info_.store_host, info_.store_port));
    std::string connect_host = info_.store_host;
    if (info_.rank == 0 && !info_.store_hosted) {
      std::string bind_host = store_bind_address(info_.store_host);
      if (info_.job_secret.empty() && info_.world_size > 1)
        spdlog::warn(
            "rendezvous: QRING_JOB_SECRET is not set: any local user can join the store on "
            "{}:{} (qring-launch sets a secret; by hand: export QRING_JOB_SECRET=<random>)",
            bind_host, info_.store_port);
      StoreServerOptions opts;
      opts.secret = info_.job_secret;
      server_ = std::make_unique<TcpStoreServer>(bind_host, info_.store_port, info_.world_size,
                                                 info_.job_id, std::move(opts));
      connect_host = bind_host == "0.0.0.0" ? "127.0.0.1" : bind_host;
    }
    JoinInfo join{kProtocolVersion, info_.rank,  info_.world_size,
                  info_.job_id,     host,        info_.job_secret};
    owned_ = std::make_unique<TcpStore>(connect_host, info_.store_port, join, deadline);
  }
  store_ = owned_.get();
  try {
    meet(deadline);
  } catch (...) {
    owned_.reset();
    server_.reset();
    throw;
  }
}

Rendezvous::Rendezvous(const BootstrapInfo& info, Store& store, Deadline deadline)
    : info_(info), store_(&store) {
  meet(deadline);
}

void Rendezvous::meet(Deadline deadline) {
  const std::string host = this_hostname();
  store_->set(fmt::format("host/{}", info_.rank), host);
  const int64_t n = store_->add(incarnation_key(info_.rank), 1);
  if (n < 1 || n - 1 > int64_t(UINT32_MAX))
    throw ProtocolError(fmt::format("rank {}: incarnation counter at {}", info_.rank, n));
  incarnation_ = uint32_t(n - 1);
  hostnames_.resize(info_.world_size);
  for (int r = 0; r < info_.world_size; ++r)
    hostnames_[r] = store_->get(fmt::format("host/{}", r), deadline);
}

Rendezvous::~Rendezvous() {
  try {
    // Rank 0 serves the store: when it was lost there is nobody to meet at the exit. A store
    // hosted outside the ranks needs no meeting at all (the barrier only keeps rank 0 from
    // closing its server while others still use it).
    if (info_.store_hosted ||
        (!server_ && std::find(lost_.begin(), lost_.end(), 0) != lost_.end())) {
      owned_.reset();
      return;
    }
    store_->set(fmt::format("exit/{}", info_.rank), "1");
    // A rank that leaves with an error does not wait for the others: the job has failed, or
    // goes on without it (a rank evicted from a job that tolerates losses).
    if (server_ && std::uncaught_exceptions() == 0) {
      std::vector<std::string> keys;
      for (int r = 0; r < info_.world_size; ++r)
        if (std::find(lost_.begin(), lost_.end(), r) == lost_.end())
          keys.push_back(fmt::format("exit/{}", r));
      store_->wait(keys, deadline_in(kExitBarrierTimeout));
    }
  } catch (const std::exception& e) {
    spdlog::warn("rendezvous: final barrier of rank {} failed: {}", info_.rank, e.what());
  }
  owned_.reset();  // the client closes before the server stops
  server_.reset();
}

Store& Rendezvous::store() {
  return *store_;
}

bool Rendezvous::single_host() const {
  return std::all_of(hostnames_.begin(), hostnames_.end(),
                     [&](const std::string& h) { return h == hostnames_.front(); });
}

}  // namespace qring::net
