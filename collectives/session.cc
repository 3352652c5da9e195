// From the environment to a ready communicator (collectives/session.h).
#include "collectives/session.h"

#include <fmt/format.h>

#include "net/base/error.h"
#include "net/transport/fabric_endpoint.h"

namespace qring::collectives {

std::string provider_setting(const std::string& setting) {
  if (setting == "auto")
    if (auto v = net::process_env("QRING_PROVIDER"); v && !v->empty()) return *v;
  return setting;
}

Session::Session(SessionOptions opts) : Session(net::detect_bootstrap(), std::move(opts)) {}

Session::Session(const net::BootstrapInfo& info, SessionOptions opts) : info_(info) {
  const auto deadline = net::deadline_in(opts.setup_timeout);
  rdv_ = std::make_unique<net::Rendezvous>(info_, deadline);
  net::FabricOptions fo;
  fo.provider = provider_setting(opts.provider);
  fo.incarnation = rdv_->incarnation();
  fo.join = rejoining();
  fo.doorbells = opts.doorbells;
  endpoint_ = net::make_fabric_endpoint(fo, info_.rank, info_.world_size, rdv_->store(),
                                        rdv_->single_host(), deadline);
  provider_ = endpoint_->provider();
  if (!opts.communicator) return;
  if (opts.comm.local_size == 1) opts.comm.local_size = info_.local_size;
  comm_ = std::make_unique<Communicator>(std::move(endpoint_), opts.comm);
}

Session::~Session() {
  comm_.reset();  // the engine thread stops before the rendezvous' final barrier
  endpoint_.reset();
}

Communicator& Session::comm() {
  if (!comm_)
    throw UsageError(fmt::format("rank {}: this session was made without a communicator "
                                 "(SessionOptions::communicator = false)",
                                 info_.rank));
  return *comm_;
}

}  // namespace qring::collectives
