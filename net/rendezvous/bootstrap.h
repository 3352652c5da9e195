// Where a process learns its rank, the world size and where the rendezvous store is:
// explicit QRING_* variables (also set by qring-launch), torchrun, mpirun/PMI, Slurm, or a
// single process when none is present.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "net/transport/endpoint.h"
#include "net/rendezvous/store.h"

namespace qring::net {

struct BootstrapInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string store_host = "127.0.0.1";
  int store_port = 0;  // 0: single process, no store needed
  std::string job_id = "local";
  // QRING_JOB_SECRET: proven by every rank to the store (net/rendezvous/store.h). Empty: the store may
  // only listen on loopback, and any local user could join it.
  std::string job_secret;
  std::string source = "single";   // "env", "torchrun", "slurm", "mpi", "single"
  std::vector<std::string> nodes;  // expanded node list when the launcher gives one
  // QRING_STORE_HOSTED=1: the store runs outside the ranks (qring-launch, qring-store under
  // Slurm), so rank 0 does not serve it and any rank, rank 0 included, can come back
  // (rejoin) while the store lives on.
  bool store_hosted = false;
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
std::optional<std::string> process_env(const std::string& name);

// The innermost launcher wins (docs/bootstrap.md has the table):
// QRING_RANK/QRING_WORLD_SIZE/QRING_STORE (explicit, and qring-launch) >
// torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; store on MASTER_ADDR, port
// QRING_STORE_PORT or MASTER_PORT + 1) >
// mpirun/PMI (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE, PMI_RANK/PMI_SIZE; store from
// QRING_STORE or MASTER_ADDR/MASTER_PORT), unless their rank and size are Slurm's own >
// Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST|SLURM_JOB_NODELIST,
// SLURM_JOB_ID; store on the first node, port QRING_STORE_PORT or derived from the job id) >
// single process. Throws ConfigError naming the variables on malformed, partial (RANK
// without WORLD_SIZE, MASTER_ADDR without MASTER_PORT or without RANK, ...) or
// contradictory values (rank >= world size, a local rank that is not the rank on one host,
// bad host:port ...): never a silent single process.
// The job id: QRING_JOB_ID; else Slurm's "<job>.<step>"; torchrun's
// "torchrun-$TORCHELASTIC_RUN_ID"; under mpirun/PMI the launcher's
// job namespace (PMIX_NAMESPACE, OMPI_MCA_ess_base_jobid); else "env" / "mpi". The job secret:
// QRING_JOB_SECRET (at least 16 characters; qring-launch and scripts/slurm set a random one).
// A store that is not on loopback needs one (Rendezvous throws ConfigError without).
BootstrapInfo detect_bootstrap(const EnvLookup& env = process_env);

// The local address rank 0's store binds for `store_host`: itself for a numeric loopback
// address, 127.0.0.1 for "localhost", else the first non-loopback IPv4 address the name
// resolves to ("0.0.0.0", with a warning, when it resolves only to loopback addresses, as a
// Debian hostname in /etc/hosts does). ConfigError when it does not resolve.
std::string store_bind_address(const std::string& store_host);

// The rendezvous: rank 0 serves a TcpStoreServer on the address the other ranks connect to
// (store_host as rank 0 resolves it; loopback for a loopback store), every rank joins it
// (proof of the job secret, version, world size, job id validated) and publishes its hostname.
// Destruction is a final barrier with a deadline so rank 0 never closes the store while
// others still use it.
class Rendezvous {
 public:
  Rendezvous(const BootstrapInfo& info, Deadline deadline);
  // In-process variant over an existing store (tests, ranks as threads).
  Rendezvous(const BootstrapInfo& info, Store& store, Deadline deadline);
  ~Rendezvous();
  // Ranks lost during the job (dead or evicted): the final barrier does not wait for them.
  void lost(const std::vector<int>& ranks) { lost_ = ranks; }
  Store& store();
  const BootstrapInfo& info() const { return info_; }
  // This process's incarnation of its rank: 0 at the job's start, one more each time a process
  // of this rank meets the store again (a restart, or a rank evicted while alive that comes
  // back: docs/design.md, "Rejoin"). From the store's counter incarnation_key(rank).
  uint32_t incarnation() const { return incarnation_; }
  const std::vector<std::string>& hostnames() const { return hostnames_; }
  bool single_host() const;

 private:
  BootstrapInfo info_;
  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<Store> owned_;
  Store* store_ = nullptr;
  std::vector<std::string> hostnames_;
  std::vector<int> lost_;
  uint32_t incarnation_ = 0;
  void meet(Deadline deadline);
};

}  // namespace qring::net
