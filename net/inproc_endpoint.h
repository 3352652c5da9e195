// In-process endpoint: ranks are threads of one process. Same matching semantics as the
// fabric endpoint (tags, ignore masks, per-peer order, truncation errors), no network:
// fast, deterministic tests of the protocols above it.
#pragma once

#include <memory>
#include <vector>

#include "net/endpoint.h"

namespace qring::net {

class InprocFabric {
 public:
  explicit InprocFabric(int world_size);
  ~InprocFabric();
  int world_size() const;
  // One endpoint per rank; each may be used by a different thread.
  std::unique_ptr<Endpoint> endpoint(int rank);

  struct Mailbox;

 private:
  std::vector<std::unique_ptr<Mailbox>> boxes_;
};

}  // namespace qring::net
