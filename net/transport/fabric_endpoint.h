// libfabric RDM endpoint with tagged messages (fabtests' setup order, RAII teardown).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "net/transport/endpoint.h"
#include "net/rendezvous/store.h"

namespace qring::net {

struct FabricOptions {
  // "auto" (shm on one host, else the best of verbs;ofi_rxm / efa / cxi / tcp;ofi_rxm),
  // "shm", "tcp" (= tcp;ofi_rxm), or any libfabric provider string.
  std::string provider = "auto";
  // Split messages above this size (0 = the provider's own limit). Tests set it small.
  size_t max_message_size = 0;
  // Register every buffer even when the provider does not require it (FI_MR_LOCAL); tests
  // use it to exercise the registration cache on providers that need none.
  bool always_register = false;
  // Address-exchange key: endpoint k publishes under "fabric/k/addr/<rank>" (k = 0:
  // "fabric/addr/<rank>"). -1 (default): the number of endpoints this process opened
  // before, so the n-th endpoint of every rank meets the n-th of the others.
  int64_t instance = -1;
  // One libfabric endpoint per peer ("pairwise") instead of one for all peers. shm completes
  // every send above its inject size (4 KiB) through one response queue per endpoint, in
  // order, so with one endpoint a peer that stopped or died with such a send outstanding held
  // back every later large send to any peer. kAuto: on for shm while the W (W - 1) regions of
  // the host's ranks fit in half of /dev/shm (~4 MiB each), off for other providers (ofi_rxm
  // keeps a connection per peer already); QRING_SHM_PAIRWISE=0 or 1 decides for shm instead.
  enum class Pairwise { kAuto, kOn, kOff };
  Pairwise pairwise = Pairwise::kAuto;
  // This process's incarnation of its rank (0 at the job's start; net/transport/endpoint.h, "Ranks that
  // come back").
  uint32_t incarnation = 0;
  // Joining a running job: publish this endpoint's address but read none, and start with no
  // peer connected (Endpoint::reset_peer connects each one the join protocol names).
  bool join = false;
  // shm: a doorbell for this process (net/transport/doorbell.h), so that the engine's waits
  // block in the kernel until a peer's traffic wakes them instead of polling and yielding.
  // Peers ring the doorbells of the processes that have one. Pays on a node whose cores are
  // taken by computing ranks or other work (a training process, a loaded machine); costs
  // wake-ups on a quiet oversubscribed node (docs/benchmarks.md, "qring.torch against
  // PyTorch DDP"). The Python module turns it on (qring.init(wait="block")).
  bool doorbells = false;
};

// Opens an endpoint, publishes its address in `store` (key: FabricOptions::instance), reads
// every peer's address (until `deadline`) and inserts them into the address vector.
// `single_host` decides what "auto" means.
//
// Effects outside qring, for the whole process (also docs/design.md, net/):
//  - Over ofi_rxm (tcp, verbs) the first endpoint exports FI_OFI_RXM_EAGER_LIMIT=8 MiB into
//    the environment unless it is set (setenv, before rxm reads it); another libfabric user
//    of the process, and child processes, see it too.
//  - Linking qring_net interposes the process's connect() and listen() (net/transport/tcp_tuning.cc).
//    They change only sockets of qring's tcp endpoints (a listener opened while a
//    FabricEndpoint sets up on that thread, a connection to a registered peer address: their
//    congestion control, QRING_TCP_CONGESTION) and pass every other call through unchanged.
//  - Over shm, /dev/shm regions named after this pid that the process has not mapped (left
//    by an earlier process with the same pid that was killed) are removed.
//  - Where the provider needs no registered memory (shm, tcp), the endpoint reserves address
//    space for the largest message (max_message_size, at most 1 GiB; MAP_NORESERVE, no memory
//    until written): every receive continues into it, so that a peer's longer message (a
//    rank that called an operation with a larger count) fails the receive as truncated, with
//    the sender's immediate data, instead of truncating inside the provider (libfabric 1.17's
//    shm spun there for ever; docs/design.md, "Security model").
std::unique_ptr<Endpoint> make_fabric_endpoint(const FabricOptions& opts, int rank, int world_size,
                                               Store& store, bool single_host, Deadline deadline);

// Resolves "auto"/"tcp" aliases to a provider string for fi_getinfo.
std::string resolve_provider(const std::string& setting, bool single_host);

}  // namespace qring::net
