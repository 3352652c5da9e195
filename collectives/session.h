// collectives::Session — one call from a process's environment to a ready communicator:
// bootstrap (qring-launch, torchrun, mpirun, Slurm or explicit QRING_*; net/rendezvous/
// bootstrap.h), rendezvous, fabric endpoint, Communicator. qring-train, qring-bench and the
// Python module start this way; a C++ program needs nothing else:
//
//   qring::collectives::Session s;            // throws ConfigError on a partial environment
//   s.comm().allreduce(buf, buf, n, DataType::kFloat32, RedOp::kSum);
//   QuorumOptions qo; qo.store = s.store(); qo.join = s.rejoining(); ...
//
// Members are created in that order and destroyed in reverse: the communicator (its engine
// thread) stops first, then the endpoint, then the rendezvous, whose destructor is the job's
// final barrier (call lost() first with the ranks the job lost, so it does not wait for them).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "net/rendezvous/bootstrap.h"
#include "net/rendezvous/store.h"
#include "net/transport/endpoint.h"

namespace qring::collectives {

struct SessionOptions {
  // libfabric provider: "auto" (shm on one host, else tcp;ofi_rxm or the fabric's own),
  // "shm", "tcp", or any provider string. "auto" defers to $QRING_PROVIDER when it is set
  // (qring-launch --provider sets it).
  std::string provider = "auto";
  // Deadline of the rendezvous and of the address exchange.
  std::chrono::milliseconds setup_timeout{30000};
  // The communicator's options; local_size is taken from the bootstrap when left at 1.
  CommOptions comm;
  // false: no Communicator; the endpoint stays with the caller (take_endpoint), for programs
  // that drive the endpoint alone (qring-bench's sendrecv).
  bool communicator = true;
  // Block in the kernel while waiting for peers where the provider allows it (shm doorbells,
  // net::FabricOptions::doorbells) instead of polling and yielding.
  bool doorbells = false;
};

class Session {
 public:
  // Detects the launch from the process's environment (net::detect_bootstrap).
  explicit Session(SessionOptions opts = {});
  // With a launch the caller has detected (and checked) already.
  Session(const net::BootstrapInfo& info, SessionOptions opts);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const net::BootstrapInfo& info() const { return info_; }
  int rank() const { return info_.rank; }
  int size() const { return info_.world_size; }
  // This process's incarnation of its rank: 0 at the job's start, > 0 for a rank that came
  // back (restarted by qring-launch --max-restarts, or evicted while alive) and must join the
  // running job (QuorumOptions::join) instead of starting with the others.
  uint32_t incarnation() const { return rdv_->incarnation(); }
  bool rejoining() const { return incarnation() > 0 && size() > 1; }
  // The rendezvous store (ranks that come back are found through it: QuorumOptions::store);
  // nullptr in a single process.
  net::Store* store() { return size() > 1 ? &rdv_->store() : nullptr; }
  net::Rendezvous& rendezvous() { return *rdv_; }
  // The provider the endpoint runs on (e.g. "shm", "tcp;ofi_rxm").
  const std::string& provider() const { return provider_; }

  // The communicator; UsageError when SessionOptions::communicator was false.
  Communicator& comm();
  // The endpoint, when SessionOptions::communicator was false (once; nullptr afterwards).
  std::unique_ptr<net::Endpoint> take_endpoint() { return std::move(endpoint_); }

  // Ranks the job lost: the final barrier does not wait for them.
  void lost(const std::vector<int>& ranks) { rdv_->lost(ranks); }

 private:
  net::BootstrapInfo info_;
  std::string provider_;
  std::unique_ptr<net::Rendezvous> rdv_;
  std::unique_ptr<net::Endpoint> endpoint_;
  std::unique_ptr<Communicator> comm_;
};

// "auto" -> $QRING_PROVIDER when set, else the setting itself.
std::string provider_setting(const std::string& setting);

}  // namespace qring::collectives
