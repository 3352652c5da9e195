// In-process endpoint: ranks are threads of one process. Same matching semantics as the
// fabric endpoint (tags, ignore masks, per-peer order, truncation errors), no network:
// fast, deterministic tests of the protocols above it.
#pragma once

#include <memory>
#include <vector>

#include "net/transport/endpoint.h"

namespace qring::net {

class InprocFabric {
 public:
  explicit InprocFabric(int world_size);
  ~InprocFabric();
  int world_size() const;
  // One endpoint per rank; each may be used by a different thread. A later endpoint of the
  // same rank is a new incarnation of it (rejoin tests): it shares the rank's mailbox, and its
  // peers reach it after reset_peer (it starts with none connected when `join` is set).
  std::unique_ptr<Endpoint> endpoint(int rank, uint32_t incarnation = 0, bool join = false);

  struct Mailbox;

 private:
  std::vector<std::unique_ptr<Mailbox>> boxes_;
};

}  // namespace qring::net
