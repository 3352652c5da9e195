// FabricEndpoint: libfabric RDM endpoint with tagged messages.
//
// Setup follows fabtests' order: fi_getinfo → fi_fabric → fi_domain → CQ → AV → fi_endpoint →
// bind → fi_enable → fi_getname / exchange through the store / fi_av_insert (on shm one
// endpoint per peer: see "Pairwise endpoints" below). The Fid<T> members are declared in
// creation order, so destruction closes them in reverse.
#include "net/transport/fabric_endpoint.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "net/base/error.h"
#include "net/transport/doorbell.h"
#include "net/transport/shm_region.h"
#include "net/transport/tcp_tuning.h"

namespace qring::net {

namespace {

// Owns one libfabric object and closes it exactly once.
template <typename T>
class Fid {
 public:
  Fid() = default;
  ~Fid() { reset(); }
  Fid(const Fid&) = delete;
  Fid& operator=(const Fid&) = delete;
  T** out() { return &p_; }
  T* get() const { return p_; }
  void swap(Fid& o) noexcept { std::swap(p_, o.p_); }
  void reset() {
    if (p_) {
      int ret = fi_close(&p_->fid);
      if (ret) spdlog::warn("fi_close: {}", fi_strerror(-ret));
      p_ = nullptr;
    }
  }

 private:
  T* p_ = nullptr;
};

// Where a receive on shm continues past the caller's buffer (FabricEndpoint::post): address
// space of the largest message the provider carries, reserved but backed by memory only where
// a longer message than expected actually wrote. Nothing reads it.
class GuardTail {
 public:
  GuardTail() = default;
  GuardTail(const GuardTail&) = delete;
  GuardTail& operator=(const GuardTail&) = delete;
  ~GuardTail() {
    if (p_ != nullptr) ::munmap(p_, len_);
  }
  void reserve(size_t len) {
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw IoError(fmt::format("mmap of a {}-byte receive guard: {}", len, std::strerror(errno)));
    p_ = p;
    len_ = len;
  }
  bool on() const { return p_ != nullptr; }
  void* data() const { return p_; }
  size_t size() const { return len_; }
  // Gives back the pages a longer message wrote into.
  void release(size_t bytes) const {
    if (p_ != nullptr && bytes > 0) ::madvise(p_, std::min(bytes, len_), MADV_DONTNEED);
  }

 private:
  void* p_ = nullptr;
  size_t len_ = 0;
};

struct InfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

InfoPtr make_hints(const std::string& prov) {
  InfoPtr hints(fi_allocinfo());
  if (!hints) throw IoError("fi_allocinfo failed");
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->tx_attr->msg_order = FI_ORDER_SAS;
  hints->rx_attr->msg_order = FI_ORDER_SAS;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  if (!prov.empty()) hints->fabric_attr->prov_name = strdup(prov.c_str());
  return hints;
}

InfoPtr query(const std::string& prov) {
  InfoPtr hints = make_hints(prov);
  fi_info* info = nullptr;
  int ret = fi_getinfo(FI_VERSION(1, 11), nullptr, nullptr, 0, hints.get(), &info);
  if (ret) return nullptr;
  return InfoPtr(info);
}

// libfabric 1.17's shm provider names its region /dev/shm/<pid>:<n>:<m>. A process killed
// with SIGKILL leaves its region behind, and a later process that gets the same pid then
// fails fi_enable with -FI_EBUSY. Regions named after this pid that this process has not
// mapped can only be such leftovers: remove them.
void remove_stale_shm_regions() {
  std::string maps;
  {
    std::ifstream f("/proc/self/maps");
    maps.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  std::error_code ec;
  for (const std::string& name : shm_regions_of(getpid())) {
    if (maps.find("/dev/shm/" + name) != std::string::npos) continue;
    if (std::filesystem::remove("/dev/shm/" + name, ec))
      spdlog::warn("removed stale shared-memory region /dev/shm/{} of an earlier process with "
                   "this pid",
                   name);
  }
}

// The shm endpoint's watch for peers that died holding their region lock (net/transport/shm_region.h):
// how often it looks, and how long a lock must stay held to be a dead owner's. A sender
// spinning on such a lock is freed within about 250 ms, inside the eviction times in use
// (the default 5 s, 500 ms in the fault tests), so the dead peer is evicted for its silence
// and the stuck senders are not.
constexpr std::chrono::milliseconds kLockWatchPeriod{200};
constexpr std::chrono::milliseconds kLockConfirm{50};

void warn_released(int rank, const std::string& name) {
  spdlog::warn(
      "rank {}: released the lock of shared-memory region /dev/shm/{}, which a process that no "
      "longer exists held (whoever needed it waited inside the shm provider)",
      rank, name);
}

// ofi_rxm (over tcp) sends messages above its eager limit (16 KiB by default) by rendezvous:
// the receiver reads the data after a request-to-send, so every ring segment costs a round
// trip in which the sending process must be scheduled again. With tcp's dynamic receive
// buffers an eager message goes straight into the posted receive buffer (the ring posts its
// receives ahead; measurements: docs/benchmarks.md, "The numbers behind the defaults"). Up to
// kRxmEagerLimit, so a message larger than a ring segment that arrives before its receive is posted
// is not buffered whole. A value the user exported wins; rxm reads it when an endpoint is created.
// A process-wide effect (setenv), listed with the others in fabric_endpoint.h.
constexpr const char* kRxmEagerEnv = "FI_OFI_RXM_EAGER_LIMIT";
constexpr size_t kRxmEagerLimit = size_t(8) << 20;

void export_rxm_eager_limit() {
  static std::once_flag once;
  std::call_once(
      once, [] { setenv(kRxmEagerEnv, std::to_string(kRxmEagerLimit).c_str(), /*overwrite=*/0); });
}

std::string rxm_eager_setting() {
  const char* v = std::getenv(kRxmEagerEnv);
  return v ? v : "default";
}

bool is_loopback_domain(const fi_info* i) {
  return i->domain_attr && i->domain_attr->name && std::strcmp(i->domain_attr->name, "lo") == 0;
}

// Pairwise endpoints (FabricOptions::pairwise). shm sends above its inject size (4 KiB) by
// CMA (or SAR, or a mapped file) and completes each through a response the receiver writes
// into the sender's one response queue, which the sender reads in order and stops at the first
// response still busy. With one endpoint for every peer, a large send to a peer that stopped
// or died thus held back the completion of every later large send, to any peer; one endpoint
// per peer gives each peer its own queue. Setting for "auto": QRING_SHM_PAIRWISE (0 or 1).
constexpr const char* kPairwiseEnv = "QRING_SHM_PAIRWISE";

// Memory: each endpoint is one shm region, a file in /dev/shm of 16 MiB (its 8 MiB SAR pool
// plus queues sized by the depths, rounded up to a power of two) of which ~3.8 MiB are touched
// when it is created (shm zero-fills from its name to the end of the file) and the rest only
// as used. Smaller queue depths do not help: they leave more of the 16 MiB to that zero fill
// (measurements: docs/benchmarks.md, "The numbers behind the defaults"). So the endpoints keep
// shm's depths. All ranks of a host together need W (W - 1) regions: "auto" uses pairwise endpoints
// only while those fit in half of /dev/shm (a container's default 64 MiB holds 3 ranks' worth), so
// that no rank dies of SIGBUS when tmpfs runs out.
constexpr size_t kShmRegionBytes = size_t(4) << 20;  // touched per region, about

bool use_pairwise(FabricOptions::Pairwise setting, const std::string& provider, int rank,
                  int world) {
  if (world < 2) return false;  // no peers to separate
  if (setting == FabricOptions::Pairwise::kOn) return true;
  if (setting == FabricOptions::Pairwise::kOff) return false;
  if (provider != "shm") return false;
  const char* v = std::getenv(kPairwiseEnv);
  if (v && std::strcmp(v, "1") == 0) return true;
  if (v && std::strcmp(v, "0") == 0) return false;
  if (v && *v) throw ConfigError(fmt::format("{}='{}': expected 0 or 1", kPairwiseEnv, v));
  // Every rank of the host decides alike: same world, same /dev/shm.
  struct statvfs fs {};
  if (statvfs("/dev/shm", &fs) != 0) return true;
  const size_t total = size_t(fs.f_blocks) * size_t(fs.f_frsize);
  const size_t need = size_t(world) * size_t(world - 1) * kShmRegionBytes;
  if (need <= total / 2) return true;
  if (rank == 0)
    spdlog::warn("shm: one endpoint per peer would take ~{} MiB of /dev/shm ({} MiB): using one "
                 "endpoint for all peers, where a stopped or dead rank can hold back large sends "
                 "to the others ({}=1 forces one per peer)",
                 need >> 20, total >> 20, kPairwiseEnv);
  return false;
}

std::string endpoint_name(fid_ep* ep) {
  std::string name(256, '\0');
  size_t len = name.size();
  int ret = fi_getname(&ep->fid, name.data(), &len);
  if (ret == -FI_ETOOSMALL) {
    name.resize(len);
    ret = fi_getname(&ep->fid, name.data(), &len);
  }
  QRING_FI_CHECK(ret);
  name.resize(len);
  return name;
}

// Entry `index` of a pairwise address list ("<length>:<address>" per rank, rank order)
// published by rank `from`.
std::string pair_address(const std::string& list, int world, int index, int from) {
  size_t pos = 0;
  for (int i = 0; i < world; ++i) {
    const size_t colon = list.find(':', pos);
    size_t len = 0;
    bool ok = colon != std::string::npos && colon > pos;
    for (size_t k = pos; ok && k < colon; ++k) {
      ok = list[k] >= '0' && list[k] <= '9' && len < (size_t(1) << 20);
      len = len * 10 + size_t(list[k] - '0');
    }
    if (!ok || colon + 1 + len > list.size()) break;
    if (i == index) {
      if (len == 0) break;
      return list.substr(colon + 1, len);
    }
    pos = colon + 1 + len;
  }
  throw ProtocolError(
      fmt::format("rank {}: malformed pairwise fabric addresses of rank {}", index, from));
}

const char* addr_format_name(uint32_t f) {
  switch (f) {
    case FI_SOCKADDR: return "FI_SOCKADDR";
    case FI_SOCKADDR_IN: return "FI_SOCKADDR_IN";
    case FI_SOCKADDR_IN6: return "FI_SOCKADDR_IN6";
    case FI_ADDR_STR: return "FI_ADDR_STR";
    default: return "the provider's format";
  }
}

// The shm region behind a peer's address ("fi_shm://<pid>:<n>:<m>", up to the first NUL):
// its file's name in /dev/shm (net/transport/shm_region.h).
std::string shm_region_name(const std::string& addr) {
  size_t pos = addr.find("://");
  pos = pos == std::string::npos ? 0 : pos + 3;
  const size_t end = addr.find('\0', pos);
  return addr.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
}

// An IPv4 or IPv6 socket address: its size, family and a port other than 0.
template <typename Sockaddr, int kFamily, typename FamilyPort>
std::string sockaddr_problem(const std::string& a, FamilyPort family_port) {
  if (a.size() != sizeof(Sockaddr))
    return fmt::format("{} bytes, expected {}", a.size(), sizeof(Sockaddr));
  Sockaddr sa{};
  std::memcpy(&sa, a.data(), sizeof(sa));
  const auto [family, port] = family_port(sa);
  if (family != kFamily) return fmt::format("address family {}", family);
  if (port == 0) return "port 0";
  return {};
}

// An address read from the store, checked against this endpoint's address format before it
// reaches fi_av_insert (which reads as many bytes as the format implies, and trusts the
// content): socket addresses must have their exact size, family and a port; a string address
// is printable up to its terminating NULs and names a format ("fi_<format>://..."); an
// opaque format must have the length of this endpoint's own name. Returns "" or the problem.
std::string address_problem(const std::string& a, uint32_t format, size_t own_len) {
  auto family = [&]() {
    sa_family_t f = 0;
    std::memcpy(&f, a.data(), std::min(a.size(), sizeof(f)));
    return f;
  };
  switch (format) {
    case FI_SOCKADDR_IN:
      return sockaddr_problem<sockaddr_in, AF_INET>(a, [](const sockaddr_in& x) {
        return std::pair{x.sin_family, x.sin_port};
      });
    case FI_SOCKADDR_IN6:
      return sockaddr_problem<sockaddr_in6, AF_INET6>(a, [](const sockaddr_in6& x) {
        return std::pair{x.sin6_family, x.sin6_port};
      });
    case FI_SOCKADDR: {
      if (a.size() == sizeof(sockaddr_in))
        return address_problem(a, FI_SOCKADDR_IN, own_len);
      if (a.size() == sizeof(sockaddr_in6))
        return address_problem(a, FI_SOCKADDR_IN6, own_len);
      return fmt::format("{} bytes (family {}), not an IPv4 or IPv6 socket address", a.size(),
                         family());
    }
    case FI_ADDR_STR: {
      size_t end = a.size();
      while (end > 0 && a[end - 1] == '\0') --end;
      if (end == 0 || a.size() > FI_NAME_MAX)
        return fmt::format("{} bytes, expected 1 to {}", a.size(), FI_NAME_MAX);
      for (size_t i = 0; i < end; ++i)
        if (a[i] < 0x21 || a[i] > 0x7e) return fmt::format("a non-printable byte at {}", i);
      const size_t sep = a.find("://");
      if (a.rfind("fi_", 0) != 0 || sep == std::string::npos || sep + 3 >= end)
        return "not of the form fi_<format>://<address>";
      return {};
    }
    default:
      if (a.size() != own_len)
        return fmt::format("{} bytes, this rank's address has {}", a.size(), own_len);
      return {};
  }
}

struct AnyRecv;

// Every Request this endpoint hands out is a FabricRequest: the public fields and the
// bookkeeping that stays inside the transport.
struct FabricRequest final : Request {
  int pending_parts = 0;  // fragments (posts) of the request not ended yet
};
int& pending_parts_of(Request& r) {
  return static_cast<FabricRequest&>(r).pending_parts;
}

// One posted libfabric operation (one fragment of a request). FI_CONTEXT(2) mode: the
// provider may use the first bytes of the context, so fi_context2 comes first.
struct OpCtx {
  fi_context2 ctx;
  RequestPtr req;
  fid_ep* ep = nullptr;          // the libfabric endpoint it goes to
  std::shared_ptr<AnyRecv> any;  // set for the per-peer parts of a pairwise any-peer receive
  uint32_t any_index = 0;        // which part
  // For posts the provider refused with -FI_EAGAIN (retried from progress()).
  void* buf = nullptr;
  size_t len = 0;
  uint64_t tag = 0;
  uint64_t ignore = 0;
  uint64_t data = 0;  // sends: immediate data (0: none)
  fi_addr_t addr = FI_ADDR_UNSPEC;
  void* desc = nullptr;
  bool posted = false;
  OpCtx* next = nullptr;  // next in its post queue while refused
};

// The generation bits of a pair (net/transport/tags.h).
uint32_t generation(uint32_t a, uint32_t b) {
  return (a + b) & 0xFu;
}

// The posts of one direction with one peer: a FIFO of those not handed to the provider yet
// (refused, or over the in-flight cap of sends), linked through OpCtx::next (no allocation on the
// hot path), and how many are with the provider.
struct PostQueue {
  OpCtx* head = nullptr;
  OpCtx* tail = nullptr;
  int32_t slot = -1;          // index in FabricEndpoint::active_, -1 while empty
  uint32_t inflight = 0;      // posted, not completed
  uint32_t cap = UINT32_MAX;  // at most this many posted
};

// A message that a part of a pairwise any-peer receive took after another part had already
// completed that receive (two peers' messages matched at once): it goes to the oldest pending
// any-peer receive that matches it, else to the next receive posted (from any peer or from
// its sender) that does.
struct Leftover {
  int peer = 0;
  uint64_t tag = 0;
  std::vector<char> data;
  uint64_t imm = 0;  // the message's immediate data
};

// An any-peer receive over pairwise endpoints, where no single libfabric receive sees every
// peer: one directed receive per peer, each into its own staging buffer, in that peer's
// receive queue (so it keeps its place among that peer's directed receives). The first
// message to arrive completes the caller's request and the other parts are cancelled; a
// message one of them took anyway becomes a Leftover. (Also a receive that a Leftover
// completes: `ready`, no parts.) Any-peer receives among themselves keep each sender's
// order; a directed receive posted while a part of an earlier any-peer receive is still
// pending can, when both match and the part loses its race, get that sender's next message
// before the kept one (which goes to the next matching receive): qring's protocols never
// mix the two on the same tags.
struct AnyRecv {
  struct Part {
    RequestPtr req;        // the internal receive from one peer
    OpCtx* ctx = nullptr;  // its one operation while req is pending
    std::vector<char> stage;
    bool cancelling = false;
  };
  RequestPtr req;  // the caller's
  char* buf = nullptr;
  size_t len = 0;
  uint64_t tag = 0;
  uint64_t ignore = 0;
  std::vector<Part> parts;
  size_t live = 0;        // parts not ended yet
  bool resolved = false;  // req has its final state
  std::optional<Leftover> ready;  // a kept message this receive takes in the next progress()
};

// The peers' tcp endpoint addresses of one FabricEndpoint, registered with tcp_tuning (the
// congestion control of the connections libfabric opens to them) while it lives.
class TcpRegistrations {
 public:
  TcpRegistrations() = default;
  TcpRegistrations(const TcpRegistrations&) = delete;
  TcpRegistrations& operator=(const TcpRegistrations&) = delete;
  ~TcpRegistrations() {
    for (const auto& addr : regs_) unregister_tcp_peer(addr.data(), addr.size());
  }
  void add(const std::string& addr, const std::string& cc) {
    register_tcp_peer(addr.data(), addr.size(), cc);
    regs_.push_back(addr);
  }

 private:
  std::vector<std::string> regs_;
};

class FabricEndpoint final : public Endpoint {
 public:
  // Setup in fabtests' order, one step each: the provider's info, fabric and domain, CQ, the
  // libfabric endpoints (each with its AV; created, bound, enabled), the address exchange
  // through the store, and the per-peer send queues.
  FabricEndpoint(const FabricOptions& opts, int rank, int world, Store& store, bool single_host,
                 Deadline deadline)
      : rank_(rank), world_(world) {
    provider_setting_ = resolve_provider(opts.provider, single_host);
    const bool rxm = provider_setting_.find("ofi_rxm") != std::string::npos;
    if (rxm) export_rxm_eager_limit();
    get_info(opts, single_host);
    if (shm_) {
      remove_stale_shm_regions();
      // Before the address exchange: peers open it on insert_peer.
      if (opts.doorbells) bell_ = Doorbell::own();
      // A peer that died inside the provider may hold its region lock; its reaper releases it
      // under qring-launch, this rank where nobody did (net/transport/shm_region.h): now (the
      // watch's constructor), and while the endpoint lives, every kLockWatchPeriod (its thread).
      lock_watch_ = std::make_unique<DeadShmLockWatch>(
          kLockWatchPeriod, kLockConfirm, kLiveLockConfirm,
          [rank](const std::string& name) { warn_released(rank, name); });
    }
    // Over tcp, the congestion control of this endpoint's connections (tcp_tuning.h): its
    // listening socket, made below, gets it here; connections to peers when they are opened.
    const std::string tcp_cc = provider_name_.find("tcp") != std::string::npos
                                   ? tcp_congestion_for(single_host)
                                   : std::string();
    {
      std::optional<TcpListenScope> listen_scope;
      if (!tcp_cc.empty()) listen_scope.emplace(tcp_cc);
      open_fabric_and_domain();
      open_cq();
      open_endpoints();
    }
    // "<provider>[ eager=<rxm eager limit>][ pairwise]\n<address>": rxm refuses connections
    // between endpoints with different eager limits, which would surface only as a timeout,
    // and pairwise ranks look for one address per peer. Pairwise, the address part is one
    // "<length>:<address>" per rank in rank order (empty for the rank itself).
    setting_ = rxm ? provider_name_ + " eager=" + rxm_eager_setting() : provider_name_;
    if (pairwise_) setting_ += " pairwise";
    tcp_cc_ = tcp_cc;
    incarnation_ = opts.incarnation;
    exchange_addresses(opts, store, deadline);
    size_send_queues();
    spdlog::debug(
        "rank {}: fabric endpoint up: provider {} domain {} max_msg {} mr_local {} endpoints {} "
        "(queue depths tx {} rx {})",
        rank_, provider_name_, info_->domain_attr->name, max_msg_, mr_local_, eps_.size(),
        info_->tx_attr->size, info_->rx_attr->size);
  }

  ~FabricEndpoint() override {
    close();
    for (auto& [addr, mr] : mrs_) fi_close(&mr.mr->fid);
    mrs_.clear();
    for (OpCtx* c : orphans_) delete c;
    orphans_.clear();
  }

  // Unposted fragments are cancelled at once and posted receives through the provider; for
  // up to 200 ms completions (cancellations, sends finishing, messages) are handled as in
  // progress(). Then the libfabric endpoints are closed, after which the provider holds no
  // reference to any buffer of ours, and whatever is still pending ends as cancelled.
  void close() override {
    if (closed_) return;
    lock_watch_.reset();
    for (size_t qi = 0; qi < queues_.size(); ++qi) cancel_queue(qi);
    for (OpCtx* c : outstanding_)
      if (c->posted && !c->req->is_send) fi_cancel(&c->ep->fid, c);
    fi_cq_tagged_entry entries[16];
    const auto until = Clock::now() + std::chrono::milliseconds(200);
    while (!outstanding_.empty() && Clock::now() < until) {
      ssize_t n = fi_cq_read(cq_.get(), entries, 16);
      try {
        if (n == -FI_EAVAIL) {
          handle_error();
        } else if (n > 0) {
          for (ssize_t i = 0; i < n; ++i) complete(entries[i]);
        } else if (n == -FI_EAGAIN) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        } else {
          break;
        }
      } catch (const std::exception& e) {
        spdlog::warn("rank {}: closing the endpoint: {}", rank_, e.what());
        break;
      }
    }
    closed_ = true;
    std::vector<RequestPtr> left;
    for (OpCtx* c : outstanding_) left.push_back(c->req);
    spares_.clear();
    eps_.clear();
    for (OpCtx* c : outstanding_) delete c;
    outstanding_.clear();
    for (const RequestPtr& r : left) end_cancelled(*r);
    for (const auto& a : any_) {
      end_cancelled(*a->req);
      for (const AnyRecv::Part& part : a->parts) end_cancelled(*part.req);
    }
    any_.clear();
    stash_.clear();
    ready_any_ = 0;
    sinks_.clear();  // the provider holds none of their buffers now
    if (!left.empty())
      spdlog::debug("rank {}: endpoint closed with {} operations unfinished", rank_, left.size());
  }
  bool closed() const override { return closed_; }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  uint32_t incarnation() const override { return incarnation_; }
  bool connected(int peer) const override {
    return peer >= 0 && peer < world_ && connected_[static_cast<size_t>(peer)];
  }

  // Waiting without polling (endpoint.h): this process's shm doorbell, where it has one.
  bool wakes_on_traffic() const override { return bell_ != nullptr; }
  uint32_t traffic_token() const override { return bell_ ? bell_->token() : 0; }
  bool wait_traffic(uint32_t token, std::chrono::nanoseconds max) override {
    return bell_ && bell_->wait(token, max);
  }
  void wake() override {
    if (bell_) bell_->ring();
  }

  // "<setting>\n<address>", pairwise "<setting>\n" then "<length>:<address>" per rank.
  std::string published_address() const override {
    std::string out = setting_ + '\n';
    if (!pairwise_) return out + names_[0];
    for (int p = 0; p < world_; ++p) {
      const std::string a = p == rank_ ? std::string() : names_[index_[static_cast<size_t>(p)]];
      out += std::to_string(a.size()) + ':' + a;
    }
    return out;
  }

  void reset_peer(int peer, const std::string& published, uint32_t incarnation) override {
    check_peer(peer, "reset_peer");
    if (peer == rank_) throw UsageError("reset_peer: a rank cannot reconnect itself");
    if (pairwise_ && !any_.empty())
      throw UsageError(fmt::format("rank {}: reset_peer({}) with any-peer receives pending",
                                   rank_, peer));
    const std::string addr = peer_address(published, peer);  // validate before changing state
    const size_t pi = static_cast<size_t>(peer);
    fid_ep* old_ep = ep_of_[pi];
    // Pairwise, the peer's endpoint may hold sends the dead incarnation never answered (shm
    // completes them in order, so they would hold back every later one): it is replaced by a
    // new one, which closes the old one and drops what it held. Messages to itself share it
    // when the peer is the next rank.
    const bool replace = pairwise_ && connected_[pi];
    const bool self_shares = pairwise_ && ep_of_[static_cast<size_t>(rank_)] == old_ep;
    auto affected = [&](const OpCtx* c) {
      return c->req->peer == peer || (replace && self_shares && c->req->peer == rank_);
    };
    // Queued posts end here; posted receives are cancelled (pairwise: dropped with the old
    // endpoint); posted sends complete on their own, or go with the old endpoint.
    cancel_queued_posts(peer);
    std::vector<OpCtx*> posted;
    for (OpCtx* c : outstanding_)
      if (c->posted && affected(c)) posted.push_back(c);
    // The old incarnation's address goes first: shm keeps one map of peers per domain, which
    // a new endpoint reads when it is enabled (a peer process that replaced its endpoints has
    // new regions, possibly under the old names).
    // So does this rank's own entry when it names the endpoint about to be closed: shm reads
    // every entry's region when it enables an endpoint, and libfabric 1.17 keeps a region
    // pointer of a closed endpoint in its map.
    if (connected_[pi]) forget_address(pi, peer);
    if (replace && self_shares) forget_address(static_cast<size_t>(rank_), rank_);
    if (replace)
      replace_endpoint(pi, old_ep, posted, self_shares);
    else
      cancel_posted_recvs(peer, posted);
    insert_peer(peer, addr);
    gens_[pi] = generation(incarnation_, incarnation);
    connected_[pi] = 1;
    departing_[pi] = 0;
    if (suspect_[pi]) {
      suspect_[pi] = 0;
      suspects_.erase(std::remove(suspects_.begin(), suspects_.end(), peer), suspects_.end());
    }
    spdlog::debug("rank {}: rank {} reconnected (incarnation {}, generation {})", rank_, peer,
                  incarnation, gens_[pi]);
  }
  // Pairwise: the endpoint that serves `peer` gets its replacement now (opened and enabled,
  // with an empty AV of its own: nobody can reach it until reset_peer puts it in place).
  void prepare_reset_peer(int peer) override {
    check_peer(peer, "prepare_reset_peer");
    const size_t pi = static_cast<size_t>(peer);
    if (!pairwise_ || closed_ || peer == rank_ || !connected_[pi]) return;
    const size_t i = index_[pi];
    if (spares_.count(i)) return;
    auto spare = std::make_unique<Spare>();
    spare->name = open_endpoint(spare->ep, spare->av);
    spares_.emplace(i, std::move(spare));
  }
  std::string provider() const override { return provider_name_; }
  TransportTraits traits() const override {
    TransportTraits t;
    t.host_copies = provider_name_.rfind("shm", 0) == 0 || provider_name_.rfind("tcp", 0) == 0;
    t.needs_registration = mr_local_;
    return t;
  }
  size_t max_message_size() const override { return max_msg_; }
  size_t data_bytes() const override { return data_bytes_; }

  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len,
                   uint64_t data = 0) override {
    check_open();
    check_peer(peer, "isend");
    auto req = std::make_shared<FabricRequest>();
    req->is_send = true;
    req->peer = peer;
    req->tag = tag;
    req->len = len;
    req->bytes = len;
    if (data_bytes_ < 8) data &= data_bytes_ == 0 ? 0 : (uint64_t(1) << (8 * data_bytes_)) - 1;
    post_fragments(req, const_cast<void*>(buf), len, wire_tag(peer, tag), 0,
                   addrs_[static_cast<size_t>(peer)], ep_of_[static_cast<size_t>(peer)], nullptr, 0,
                   data);
    return req;
  }

  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len, uint64_t ignore = 0) override {
    check_open();
    if (peer != kAnyPeer) check_peer(peer, "irecv");
    if (ignore != 0 && len > max_msg_)
      throw UsageError(fmt::format("irecv with an ignore mask is limited to {} bytes (asked {})",
                                   max_msg_, len));
    if (pairwise_) {
      if (!stash_.empty())
        if (RequestPtr kept = take_kept(peer, tag, ignore, buf, len)) return kept;
      if (peer == kAnyPeer) return irecv_any(tag, buf, len, ignore);
    }
    auto req = std::make_shared<FabricRequest>();
    req->peer = peer;
    req->tag = tag;
    req->len = len;
    // An any-peer receive cannot know its sender's generation: it matches every one.
    if (peer == kAnyPeer)
      post_fragments(req, buf, len, tag, ignore | kGenMask, FI_ADDR_UNSPEC, eps_.front().get());
    else
      post_fragments(req, buf, len, wire_tag(peer, tag), ignore,
                     addrs_[static_cast<size_t>(peer)], ep_of_[static_cast<size_t>(peer)]);
    return req;
  }

  size_t progress() override {
    if (closed_) return 0;
    size_t handled = 0;
    fi_cq_tagged_entry entries[32];
    while (true) {
      ssize_t n = fi_cq_read(cq_.get(), entries, 32);
      if (n == -FI_EAGAIN) break;
      if (n == -FI_EAVAIL) {
        handle_error();
        ++handled;
        continue;
      }
      if (n < 0) throw FabricError("fi_cq_read", static_cast<int>(n), __FILE__, __LINE__);
      for (ssize_t i = 0; i < n; ++i) complete(entries[i]);
      handled += static_cast<size_t>(n);
      if (n < 32) break;
    }
    if (!active_.empty()) handled += retry_queues();
    if (!any_.empty()) handled += progress_any();
    if (!sinks_.empty()) reap_sinks();
    return handled;
  }

  std::vector<int> suspect_peers() const override { return suspects_; }
  void expect_departure(int peer) override {
    if (peer == kAnyPeer)
      departing_.assign(departing_.size(), 1);
    else if (peer >= 0 && peer < world_)
      departing_[static_cast<size_t>(peer)] = 1;
  }

  // Every provider here: shm needs it (an unreceived large send holds back the completion of
  // every later send of its endpoint); over tcp (ofi_rxm) an unreceived message keeps the
  // sender's buffer (rendezvous) or one of the receiver's unexpected-message buffers (eager)
  // until the endpoint closes. Sinks are bounded in number: the oldest is withdrawn first.
  void discard(int peer, uint64_t tag, size_t len, Deadline until) override {
    if (closed_) return;
    check_peer(peer, "discard");
    if (peer == rank_) return;  // this rank's own messages: it gave up sending them too
    if (sinks_.size() >= kMaxSinks) withdraw(sinks_.front());
    Sink& s = sinks_.emplace_back();
    s.buf = std::make_unique<char[]>(std::max<size_t>(len, 1));
    s.until = until;
    s.req = irecv(peer, tag, s.buf.get(), len);
  }

  bool cancel(const RequestPtr& req) override {
    if (req->done()) return false;
    if (req->is_send) return false;
    const bool posted = start_cancel(req);
    // The provider reports each cancelled receive as an FI_ECANCELED completion; wait for
    // them so the buffer is free when we return.
    Deadline dl = deadline_in(std::chrono::seconds(5));
    Backoff backoff;
    while (posted && !req->done()) {
      if (progress()) continue;
      if (Clock::now() > dl)
        throw TimeoutError(fmt::format("rank {}: cancel of a receive (tag {:#x}) did not complete",
                                       rank_, req->tag));
      backoff.idle();
    }
    return req->state == RequestState::kCancelled;
  }

  // Starts the cancellation of a pending receive without waiting: unposted fragments end at
  // once; posted ones are cancelled at the provider, which confirms each in a later
  // progress(). An any-peer receive that holds a message already completes with it. Returns
  // whether a confirmation is awaited.
  bool start_cancel(const RequestPtr& req) {
    auto it = std::find_if(any_.begin(), any_.end(), [&](const auto& a) { return a->req == req; });
    if (it != any_.end()) {
      const std::shared_ptr<AnyRecv> a = *it;
      if (a->ready) {
        take_ready(*a);
        return false;
      }
      return cancel_parts(*a);
    }
    bool posted = false;
    for (OpCtx* c : outstanding_) {
      if (c->req == req && c->posted) {
        fi_cancel(&c->ep->fid, c);
        posted = true;
      }
    }
    drop_queued(req);
    return posted;
  }

  void register_memory(const void* ptr, size_t len) override {
    if (!mr_local_ || len == 0) return;
    auto it = mrs_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != mrs_.end() && it->second.len >= len) return;
    if (it != mrs_.end()) {
      fi_close(&it->second.mr->fid);
      mrs_.erase(it);
    }
    fid_mr* mr = nullptr;
    // Providers without FI_MR_PROV_KEY need a key unique within the domain.
    QRING_FI_CHECK(
        fi_mr_reg(domain_.get(), ptr, len, FI_SEND | FI_RECV, 0, next_key_++, 0, &mr, nullptr));
    mrs_[reinterpret_cast<uintptr_t>(ptr)] = Mr{mr, len};
  }

  void deregister_memory(const void* ptr) override {
    auto it = mrs_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == mrs_.end()) return;
    fi_close(&it->second.mr->fid);
    mrs_.erase(it);
  }

 private:
  struct Mr {
    fid_mr* mr;
    size_t len;
  };

  void check_open() const {
    if (closed_) throw IoError(fmt::format("rank {}: the endpoint is closed", rank_));
  }

  static void end_cancelled(Request& r) {
    if (r.state != RequestState::kPending) return;
    pending_parts_of(r) = 0;
    r.state = RequestState::kCancelled;
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= world_)
      throw UsageError(fmt::format("{}: peer {} out of range [0, {})", what, peer, world_));
  }

  // The address in rank r's published value (published_address() there) that this rank
  // sends to, after checking that r runs the same provider and settings.
  std::string peer_address(const std::string& v, int r) const {
    size_t nl = v.find('\n');
    if (nl == std::string::npos)
      throw ProtocolError(fmt::format("rank {}: malformed fabric address of rank {}", rank_, r));
    std::string peer_setting = v.substr(0, nl);
    std::string peer_prov = peer_setting.substr(0, peer_setting.find(' '));
    if (peer_prov != provider_name_)
      throw ConfigError(fmt::format(
          "rank {}: provider mismatch: this rank uses '{}', rank {} uses '{}'; set the same "
          "provider on every rank",
          rank_, provider_name_, r, peer_prov));
    if (peer_setting != setting_) {
      const bool pairwise_differs =
          (peer_setting.find(" pairwise") != std::string::npos) != pairwise_;
      throw ConfigError(fmt::format(
          "rank {}: libfabric settings differ: this rank has '{}', rank {} has '{}'; export "
          "the same {} on every rank",
          rank_, setting_, r, peer_setting, pairwise_differs ? kPairwiseEnv : kRxmEagerEnv));
    }
    std::string addr =
        pairwise_ ? pair_address(v.substr(nl + 1), world_, rank_, r) : v.substr(nl + 1);
    const std::string problem =
        address_problem(addr, info_->addr_format, names_[index_[static_cast<size_t>(r)]].size());
    if (!problem.empty())
      throw ProtocolError(fmt::format(
          "rank {}: the fabric address that rank {} published is not a valid {} address ({}); a "
          "rank of another build, provider or job wrote it",
          rank_, r, addr_format_name(info_->addr_format), problem));
    return addr;
  }

  // The AV that holds rank r's entry: that of the endpoint that talks to it.
  fid_av* av_of(int r) const {
    return avs_[pairwise_ ? index_[static_cast<size_t>(r)] : 0].get();
  }

  void insert_peer(int r, const std::string& addr) {
    if (!tcp_cc_.empty() && r != rank_) tcp_regs_.add(addr, tcp_cc_);
    if (bell_) {  // shm: the peer process's doorbell, rung when there is traffic for it
      peer_bells_.resize(static_cast<size_t>(world_));
      peer_bells_[static_cast<size_t>(r)] =
          r == rank_ ? nullptr : Doorbell::of(Doorbell::pid_in_shm_address(addr));
    }
    if (shm_) {  // shm: the lock its sends take (net/transport/shm_region.h, PeerRegionLock)
      peer_locks_.resize(static_cast<size_t>(world_));
      auto& l = peer_locks_[static_cast<size_t>(r)];
      const std::string region = shm_region_name(addr);
      l = r == rank_ ? nullptr : std::make_unique<PeerRegionLock>(region);
      if (l && !l->mapped())
        spdlog::debug("rank {}: no shm region {} for rank {}: its sends post without a look", rank_,
                      region, r);
    }
    int n = fi_av_insert(av_of(r), addr.data(), 1, &addrs_[static_cast<size_t>(r)], 0, nullptr);
    if (n != 1)
      throw FabricError(fmt::format("fi_av_insert(rank {})", r), n < 0 ? n : -FI_EINVAL, __FILE__,
                        __LINE__);
  }

  // The posts still queued (not handed to the provider) in queue `qi` end, cancelled.
  void cancel_queue(size_t qi) {
    PostQueue& q = queues_[qi];
    while (OpCtx* c = q.head) {
      q.head = c->next;
      c->next = nullptr;
      finish_part(c, RequestState::kCancelled, {});
    }
    q.tail = nullptr;
    deactivate(qi);
  }

  // reset_peer: the queued posts to and from `peer` end (cancelled).
  void cancel_queued_posts(int peer) {
    for (size_t qi : {queue_index(true, peer), queue_index(false, peer)}) cancel_queue(qi);
  }

  // reset_peer: removes the address of endpoint i (rank `who`'s) from its AV.
  void forget_address(size_t i, int who) {
    int ret = fi_av_remove(av_of(int(i)), &addrs_[i], 1, 0);
    if (ret) spdlog::warn("rank {}: fi_av_remove(rank {}): {}", rank_, who, fi_strerror(-ret));
    addrs_[i] = FI_ADDR_NOTAVAIL;
  }

  // reset_peer, pairwise: the peer's endpoint `old_ep` (and its AV) is replaced; the ops
  // posted on it are orphaned.
  void replace_endpoint(size_t pi, fid_ep* old_ep, const std::vector<OpCtx*>& posted,
                        bool self_shares) {
    for (OpCtx* c : posted) {
      outstanding_.erase(c);
      --queues_[queue_index(c->req->is_send, c->req->peer)].inflight;
      if (c->req->state == RequestState::kPending) c->req->state = RequestState::kCancelled;
      pending_parts_of(*c->req) = 0;
      c->req.reset();
      orphans_.push_back(c);  // its endpoint is closed below; never completed
    }
    const size_t i = index_[pi];
    Fid<fid_ep>& ep = eps_[i];
    ep.reset();
    // A new AV as well (the old one goes with the old endpoint): nothing of the old
    // incarnation's entries, nor of the closed endpoint's region, is seen by the new one.
    Fid<fid_av>& av = avs_[i];
    av.reset();
    auto spare = spares_.find(i);
    if (spare != spares_.end()) {  // made ready by prepare_reset_peer
      ep.swap(spare->second->ep);
      av.swap(spare->second->av);
      names_[i] = std::move(spare->second->name);
      spares_.erase(spare);
    } else {
      names_[i] = open_endpoint(ep, av);
    }
    for (size_t p = 0; p < ep_of_.size(); ++p)
      if (ep_of_[p] == old_ep) ep_of_[p] = ep.get();
    if (self_shares) insert_peer(rank_, names_[i]);
  }

  // reset_peer, not replacing the endpoint: cancels the receives posted from the peer.
  void cancel_posted_recvs(int peer, const std::vector<OpCtx*>& posted) {
    std::vector<OpCtx*> recvs;
    for (OpCtx* c : posted) {
      if (c->req->is_send) continue;
      fi_cancel(&c->ep->fid, c);
      recvs.push_back(c);
    }
    // The provider reports each cancelled receive (FI_ECANCELED): wait, so that their
    // buffers are free and no message of the old incarnation lands in them afterwards.
    // A context that completed is deleted: only its address is compared from then on.
    Deadline dl = deadline_in(std::chrono::seconds(5));
    auto still = [&] {
      for (OpCtx* c : recvs)
        if (outstanding_.count(c)) return true;
      return false;
    };
    while (still()) {
      if (progress()) continue;
      if (Clock::now() > dl)
        throw TimeoutError(fmt::format("rank {}: reset_peer({}): receives from the old "
                                       "incarnation were not cancelled within 5 s",
                                       rank_, peer));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // A directed tag as it goes on the wire: with the pair's generation (net/transport/tags.h).
  uint64_t wire_tag(int peer, uint64_t tag) const {
    return with_generation(tag, peer == kAnyPeer ? 0 : gens_[static_cast<size_t>(peer)]);
  }

  // Memory descriptor for [ptr, ptr+len), registering (and caching) when the provider
  // requires local registration.
  void* descriptor(void* ptr, size_t len) {
    if (!mr_local_ || len == 0) return nullptr;
    uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    auto it = mrs_.upper_bound(p);
    if (it != mrs_.begin()) {
      --it;
      if (p >= it->first && p + len <= it->first + it->second.len) return fi_mr_desc(it->second.mr);
    }
    register_memory(ptr, len);
    return fi_mr_desc(mrs_[p].mr);
  }

  // `any`: the request is part `any_index` of that pairwise any-peer receive (one fragment).
  void post_fragments(const RequestPtr& req, void* buf, size_t len, uint64_t tag, uint64_t ignore,
                      fi_addr_t addr, fid_ep* ep, const std::shared_ptr<AnyRecv>& any = nullptr,
                      uint32_t any_index = 0, uint64_t data = 0) {
    size_t parts = len == 0 ? 1 : (len + max_msg_ - 1) / max_msg_;
    pending_parts_of(*req) = static_cast<int>(parts);
    char* p = static_cast<char*>(buf);
    for (size_t i = 0; i < parts; ++i) {
      size_t off = i * max_msg_;
      size_t n = std::min(max_msg_, len - std::min(len, off));
      auto* c = new OpCtx{};
      c->req = req;
      c->buf = p ? p + off : nullptr;
      c->len = n;
      c->tag = tag | (i & kFragMask);
      c->ignore = ignore;
      c->data = data;
      c->addr = addr;
      c->ep = ep;
      if (any) {
        c->any = any;
        c->any_index = any_index;
        any->parts[any_index].ctx = c;
      }
      c->desc = descriptor(c->buf, n);
      outstanding_.insert(c);
      // Behind earlier refused posts of the same queue (order), else straight to the provider.
      const size_t qi = queue_index(req->is_send, req->peer);
      const PostQueue& q = queues_[qi];
      if (!q.head && q.inflight < q.cap && queue_open(qi)) {
        ssize_t ret = post(c);
        if (ret == 0) continue;
        if (ret != -FI_EAGAIN) {
          fail_post(c, ret);  // fails the request: its later fragments are not posted
          return;
        }
      }
      enqueue(qi, c);
    }
  }

  // Post queues: sends to p at p, receives from p at world + p, any-peer receives at
  // 2 * world. Posts the provider refused, or sends over the in-flight cap, wait there in
  // order and are retried from progress(), each queue on its own: a peer that stops reading
  // holds back only its own queue.
  size_t queue_index(bool is_send, int peer) const {
    if (peer == kAnyPeer) return 2 * static_cast<size_t>(world_);
    return static_cast<size_t>(peer) + (is_send ? 0 : static_cast<size_t>(world_));
  }
  bool queue_open(size_t qi) const {
    return qi == 2 * static_cast<size_t>(world_) || connected_[qi % static_cast<size_t>(world_)];
  }
  bool orphaned(const OpCtx* c) const {
    return !orphans_.empty() && std::find(orphans_.begin(), orphans_.end(), c) != orphans_.end();
  }

  void enqueue(size_t qi, OpCtx* c) {
    PostQueue& q = queues_[qi];
    c->next = nullptr;
    if (q.tail)
      q.tail->next = c;
    else
      q.head = c;
    q.tail = c;
    if (q.slot < 0) {
      q.slot = static_cast<int32_t>(active_.size());
      active_.push_back(static_cast<uint32_t>(qi));  // reserved: never reallocates
    }
  }

  void deactivate(size_t qi) {
    PostQueue& q = queues_[qi];
    if (q.slot < 0) return;
    const uint32_t last = active_.back();
    active_[static_cast<size_t>(q.slot)] = last;
    queues_[last].slot = q.slot;
    active_.pop_back();
    q.slot = -1;
  }

  // Hands one fragment to the provider: 0, -FI_EAGAIN (refused for now) or a hard error.
  ssize_t post(OpCtx* c) {
    ssize_t ret;
    if (c->req->is_send && receiver_locked(c->req->peer))
      ret = -FI_EAGAIN;  // the receiver holds its lock: posting now would spin until it lets go
    else if (c->req->is_send && c->data != 0)
      ret = fi_tsenddata(c->ep, c->buf, c->len, c->desc, c->data, c->addr, c->tag, &c->ctx);
    else if (c->req->is_send)
      ret = fi_tsend(c->ep, c->buf, c->len, c->desc, c->addr, c->tag, &c->ctx);
    else if (guard_.on())
      ret = post_guarded_recv(c);
    else
      ret = fi_trecv(c->ep, c->buf, c->len, c->desc, c->addr, c->tag, c->ignore, &c->ctx);
    if (ret >= 0) {
      c->posted = true;
      ++queues_[queue_index(c->req->is_send, c->req->peer)].inflight;
      if (c->req->is_send) ring(c->req->peer);
      return 0;
    }
    // A send refused for now waits for the peer (shm: its first message to a peer waits for
    // the peer to take the connection; a full queue for the peer to read it): wake it.
    if (ret == -FI_EAGAIN && c->req->is_send) ring(c->req->peer);
    // shm refuses a receive beyond its rx depth (posted receives) with -FI_ENOMEM: it waits
    // like a refused post until earlier receives complete.
    if (ret == -FI_ENOMEM && shm_ && !c->req->is_send) return -FI_EAGAIN;
    return ret;
  }

  // A receive into the caller's buffer followed by the guard tail: a message longer than the
  // buffer (a peer that called the operation with a larger count) lands whole, and
  // complete() fails the request as truncated, with the sender's immediate data. Posted as
  // a plain receive of the buffer, libfabric 1.17's shm spins inside fi_cq_read for ever on
  // such a message above its inject size (4 KiB; issue 44, N4): no deadline could fire.
  ssize_t post_guarded_recv(OpCtx* c) {
    iovec iov[2];
    void* desc[2] = {c->desc, nullptr};
    size_t n = 0;
    if (c->len > 0) iov[n++] = {c->buf, c->len};
    iov[n++] = {guard_.data(), guard_.size()};
    return fi_trecvv(c->ep, iov, c->len > 0 ? desc : desc + 1, n, c->addr, c->tag, c->ignore,
                     &c->ctx);
  }

  // A post failed with a hard error. For a directed request it concerns that peer only: the
  // request fails and the peer is marked suspect. An any-peer receive names no peer: the
  // endpoint itself is in trouble, which throws (after failing the request).
  void fail_post(OpCtx* c, ssize_t ret) {
    const bool send = c->req->is_send;
    const int peer = c->req->peer;
    const char* fn = send ? "fi_tsend" : "fi_trecv";
    if (peer == kAnyPeer) {
      finish_part(c, RequestState::kError, fmt::format("{}: {}", fn, fi_strerror(int(-ret))));
      throw FabricError(fn, static_cast<int>(ret), __FILE__, __LINE__);
    }
    std::string msg = fmt::format("{} rank {}: {} failed: {}", send ? "to" : "from", peer, fn,
                                  fi_strerror(int(-ret)));
    mark_suspect(peer, msg);
    finish_part(c, RequestState::kError, msg);
  }

  // shm: whether `peer`'s region lock is held now (PeerRegionLock); false elsewhere.
  bool receiver_locked(int peer) const {
    if (peer < 0 || static_cast<size_t>(peer) >= peer_locks_.size()) return false;
    const PeerRegionLock* l = peer_locks_[static_cast<size_t>(peer)].get();
    return l && l->held();
  }

  // Wakes `peer`'s process if it waits for traffic (shm; nothing elsewhere).
  void ring(int peer) {
    if (peer >= 0 && static_cast<size_t>(peer) < peer_bells_.size())
      if (Doorbell* b = peer_bells_[static_cast<size_t>(peer)].get()) b->ring();
  }

  void mark_suspect(int peer, const std::string& why) {
    if (peer < 0 || peer >= world_ || suspect_[static_cast<size_t>(peer)]) return;
    suspect_[static_cast<size_t>(peer)] = 1;
    suspects_.insert(std::lower_bound(suspects_.begin(), suspects_.end(), peer), peer);
    // A peer that said goodbye (or every peer, once this rank did) may be gone already.
    spdlog::log(departing_[static_cast<size_t>(peer)] ? spdlog::level::debug : spdlog::level::warn,
                "rank {}: rank {} is suspect: {}", rank_, peer, why);
  }

  // Retries every non-empty post queue, each up to its first refusal. Returns the requests
  // that ended here (fragments of failed requests dropped, hard errors).
  size_t retry_queues() {
    size_t ended = 0;
    for (size_t i = 0; i < active_.size();) {
      const uint32_t qi = active_[i];
      PostQueue& q = queues_[qi];
      if (!queue_open(qi)) {  // a peer not connected yet: its posts wait for reset_peer
        ++i;
        continue;
      }
      while (OpCtx* c = q.head) {
        // A request that already failed (an earlier fragment) posts no more fragments.
        const bool failed = c->req->state == RequestState::kError;
        if (!failed && q.inflight >= q.cap) break;  // completions make room
        const ssize_t ret = failed ? 0 : post(c);
        if (ret == -FI_EAGAIN) break;  // the next progress() tries again
        q.head = c->next;
        if (!q.head) {
          q.tail = nullptr;
          deactivate(qi);
        }
        c->next = nullptr;
        if (failed) {
          finish_part(c, RequestState::kError, {});
        } else if (ret != 0) {
          ++ended;
          fail_post(c, ret);
        }
      }
      if (i < active_.size() && active_[i] == qi) ++i;  // still refused: next queue
    }
    return ended;
  }

  void finish_part(OpCtx* c, RequestState st, const std::string& err) {
    Request& r = *c->req;
    if (st == RequestState::kError && r.state != RequestState::kError) {
      r.state = RequestState::kError;
      r.error = err;
    } else if (st == RequestState::kCancelled && r.state == RequestState::kPending) {
      r.state = RequestState::kCancelled;
    }
    if (--pending_parts_of(r) == 0 && r.state == RequestState::kPending)
      r.state = RequestState::kDone;
    if (c->posted) --queues_[queue_index(r.is_send, r.peer)].inflight;
    outstanding_.erase(c);
    if (c->any) {
      const std::shared_ptr<AnyRecv> any = std::move(c->any);
      const uint32_t index = c->any_index;
      delete c;
      if (pending_parts_of(*any->parts[index].req) == 0) on_part_done(any, index);
      return;
    }
    delete c;
  }

  // ---- any-peer receives over pairwise endpoints (AnyRecv).

  static bool tag_matches(uint64_t msg_tag, uint64_t tag, uint64_t ignore) {
    return ((msg_tag ^ tag) & ~ignore) == 0;
  }

  std::shared_ptr<AnyRecv> new_any(int peer, uint64_t tag, void* buf, size_t len,
                                   uint64_t ignore) {
    auto req = std::make_shared<FabricRequest>();
    req->peer = peer;
    req->tag = tag;
    req->len = len;
    req->pending_parts = 1;
    auto a = std::make_shared<AnyRecv>();
    a->req = req;
    a->buf = static_cast<char*>(buf);
    a->len = len;
    a->tag = tag;
    a->ignore = ignore;
    any_.push_back(a);
    return a;
  }

  // A receive (from `peer` or any peer) that a kept message matches takes it: the message
  // was its sender's next one (a part took it in the sender's order). Completed in the next
  // progress(). Null if none matches.
  RequestPtr take_kept(int peer, uint64_t tag, uint64_t ignore, void* buf, size_t len) {
    for (auto it = stash_.begin(); it != stash_.end(); ++it) {
      if ((peer == kAnyPeer || it->peer == peer) && tag_matches(it->tag, tag, ignore)) {
        auto a = new_any(peer, tag, buf, len, ignore);
        a->ready = std::move(*it);
        stash_.erase(it);
        ++ready_any_;
        return a->req;
      }
    }
    return nullptr;
  }

  RequestPtr irecv_any(uint64_t tag, void* buf, size_t len, uint64_t ignore) {
    if (len > max_msg_)
      throw UsageError(fmt::format("an any-peer receive is limited to {} bytes (asked {})",
                                   max_msg_, len));
    auto a = new_any(kAnyPeer, tag, buf, len, ignore);
    const RequestPtr req = a->req;
    a->parts.reserve(static_cast<size_t>(world_));
    for (int p = 0; p < world_ && !a->resolved; ++p) {
      const auto i = static_cast<uint32_t>(a->parts.size());
      AnyRecv::Part& part = a->parts.emplace_back();
      part.req = std::make_shared<FabricRequest>();
      part.req->peer = p;
      part.req->tag = tag;
      part.req->len = len;
      part.stage.resize(len);
      ++a->live;
      post_fragments(part.req, part.stage.data(), len, wire_tag(p, tag), ignore,
                     addrs_[static_cast<size_t>(p)], ep_of_[static_cast<size_t>(p)], a, i);
    }
    return req;
  }

  // Completes any-peer receives that took a kept message, drops finished ones from the front.
  size_t progress_any() {
    size_t handled = 0;
    if (ready_any_ > 0) {
      for (size_t i = 0; i < any_.size() && ready_any_ > 0; ++i) {
        if (any_[i]->ready) {
          take_ready(*any_[i]);
          ++handled;
        }
      }
    }
    while (!any_.empty() && any_.front()->resolved && any_.front()->live == 0) any_.pop_front();
    return handled;
  }

  void take_ready(AnyRecv& a) {
    Leftover m = std::move(*a.ready);
    a.ready.reset();
    --ready_any_;
    resolve(a, RequestState::kDone, m.data.data(), m.data.size(), m.tag, {}, m.imm);
  }

  // Gives the caller's request its final state; the parts still pending are cancelled.
  void resolve(AnyRecv& a, RequestState st, const char* data, size_t bytes, uint64_t tag,
               std::string err, uint64_t imm = 0) {
    Request& r = *a.req;
    a.resolved = true;
    r.data = imm;
    if (st == RequestState::kDone && bytes > a.len) {
      st = RequestState::kError;
      r.truncated = true;
      err = fmt::format("{}: message truncated: {} bytes arrived for a {}-byte buffer",
                        r.peer == kAnyPeer ? "from any peer" : fmt::format("from rank {}", r.peer),
                        bytes, a.len);
      if (r.peer != kAnyPeer) mark_suspect(r.peer, err);
    }
    if (st == RequestState::kDone) {
      if (bytes > 0) std::memcpy(a.buf, data, bytes);
      r.bytes = bytes;
      r.matched_tag = tag;
    } else if (st == RequestState::kError) {
      r.error = std::move(err);
    }
    pending_parts_of(r) = 0;
    r.state = st;
    cancel_parts(a);
  }

  // Cancels the parts still pending: unposted ones at once, posted ones through the provider
  // (which reports FI_ECANCELED, or the message if one matched first). Returns whether any
  // posted part is still to report.
  bool cancel_parts(AnyRecv& a) {
    bool posted = false;
    for (AnyRecv::Part& part : a.parts) {
      if (part.req->done() || !part.ctx) continue;
      if (part.ctx->posted) {
        if (!part.cancelling) fi_cancel(&part.ctx->ep->fid, part.ctx);
        part.cancelling = true;
        posted = true;
      } else {
        drop_queued(part.req);
      }
    }
    return posted;
  }

  // Part `index` of `ap` has ended (message, error or cancellation).
  void on_part_done(const std::shared_ptr<AnyRecv>& ap, uint32_t index) {
    AnyRecv& a = *ap;
    AnyRecv::Part& part = a.parts[index];
    part.ctx = nullptr;
    --a.live;
    const Request& sub = *part.req;
    if (sub.state == RequestState::kDone) {
      if (!a.resolved) {
        resolve(a, RequestState::kDone, part.stage.data(), sub.bytes, sub.matched_tag, {},
                sub.data);
      } else {
        part.stage.resize(sub.bytes);
        hand_on(Leftover{sub.peer, sub.matched_tag, std::move(part.stage), sub.data});
      }
    } else if (sub.state == RequestState::kError) {
      if (!a.resolved) {
        resolve(a, RequestState::kError, nullptr, 0, 0, sub.error, sub.data);
        a.req->truncated = sub.truncated;
      } else
        spdlog::warn("rank {}: a message for a finished any-peer receive failed: {}", rank_,
                     sub.error);
    } else if (a.live == 0 && !a.resolved) {  // every part cancelled
      a.resolved = true;
      pending_parts_of(*a.req) = 0;
      a.req->state = RequestState::kCancelled;
    }
  }

  // A message that a part of an already finished any-peer receive took: to the oldest pending
  // any-peer receive it matches, else kept for the next one.
  void hand_on(Leftover m) {
    for (const auto& a : any_) {
      if (a->resolved || a->ready || !tag_matches(m.tag, a->tag, a->ignore)) continue;
      resolve(*a, RequestState::kDone, m.data.data(), m.data.size(), m.tag, {}, m.imm);
      return;
    }
    stash_.push_back(std::move(m));
  }

  // ---- sinks (discard): receives of messages nobody wants, into buffers of their own.
  struct Sink {
    RequestPtr req;
    std::unique_ptr<char[]> buf;
    Deadline until;
    bool withdrawn = false;
  };
  static constexpr size_t kMaxSinks = 1024;

  bool is_sink(const Request* r) const {
    for (const Sink& s : sinks_)
      if (s.req.get() == r) return true;
    return false;
  }

  // Withdraws a sink's receive without waiting (start_cancel); reap_sinks() frees its buffer
  // once the cancellation is confirmed.
  void withdraw(Sink& s) {
    if (s.withdrawn || s.req->done()) return;
    s.withdrawn = true;
    start_cancel(s.req);
  }

  void reap_sinks() {
    const auto now = Clock::now();
    for (auto it = sinks_.begin(); it != sinks_.end();) {
      if (it->req->done()) {
        deregister_memory(it->buf.get());
        it = sinks_.erase(it);
        continue;
      }
      if (now > it->until) withdraw(*it);
      ++it;
    }
  }

  // Removes the unposted fragments of a receive from its post queue, cancelled.
  void drop_queued(const RequestPtr& req) {
    const size_t qi = queue_index(false, req->peer);
    PostQueue& q = queues_[qi];
    OpCtx* prev = nullptr;
    for (OpCtx* c = q.head; c;) {
      OpCtx* next = c->next;
      if (c->req == req) {
        (prev ? prev->next : q.head) = next;
        if (q.tail == c) q.tail = prev;
        finish_part(c, RequestState::kCancelled, {});
      } else {
        prev = c;
      }
      c = next;
    }
    if (!q.head) deactivate(qi);
  }

  void complete(const fi_cq_tagged_entry& e) {
    auto* c = static_cast<OpCtx*>(e.op_context);
    if (orphaned(c)) return;  // of an endpoint reset_peer closed: its request ended there
    if (!c->req->is_send && e.len > c->len) {  // ran into the guard tail (post_guarded_recv)
      guard_.release(e.len - c->len);
      if (e.flags & FI_REMOTE_CQ_DATA) c->req->data = e.data;
      fail_truncated(c, e.len);
      return;
    }
    if (!c->req->is_send) {
      c->req->bytes += e.len;
      c->req->matched_tag = e.tag & ~(kFragMask | kGenMask);
      if (e.flags & FI_REMOTE_CQ_DATA) c->req->data = e.data;
      ring(c->req->peer);  // its sender completes the send in its own progress
    }
    finish_part(c, RequestState::kDone, {});
  }

  void handle_error() {
    fi_cq_err_entry err{};
    ssize_t r = fi_cq_readerr(cq_.get(), &err, 0);
    if (r < 0) throw FabricError("fi_cq_readerr", static_cast<int>(r), __FILE__, __LINE__);
    auto* c = static_cast<OpCtx*>(err.op_context);
    if (!c)
      throw IoError(fmt::format("rank {}: completion error without context: {}", rank_,
                                fi_strerror(err.err)));
    if (orphaned(c)) return;
    // Some providers (shm) report the error code negated.
    const int code = err.err < 0 ? -err.err : err.err;
    if (code == FI_ECANCELED) {
      finish_part(c, RequestState::kCancelled, {});
      return;
    }
    Request& req = *c->req;
    // A truncated message still names its sender's immediate data: the collectives tell a
    // shape mismatch from it.
    if (!req.is_send && (err.flags & FI_REMOTE_CQ_DATA)) req.data = err.data;
    if (!req.is_send && code == FI_ETRUNC) {
      fail_truncated(c, err.olen > 0 ? err.olen + err.len : 0);
      return;
    }
    fail_part(c, fmt::format("{} ({})", fi_strerror(code),
                             fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, nullptr, 0)));
  }

  // A receive whose message was longer than its buffer (`arrived` bytes; 0: unknown).
  void fail_truncated(OpCtx* c, size_t arrived) {
    c->req->truncated = true;
    fail_part(c, arrived > 0 ? fmt::format("message truncated: {} bytes arrived for a {}-byte "
                                           "buffer",
                                           arrived, c->len)
                             : fmt::format("message truncated: more than {} bytes arrived",
                                           c->len));
  }

  // An error of a request to or from one peer fails that request and marks the peer
  // suspect; the endpoint and its other peers go on.
  void fail_part(OpCtx* c, const std::string& detail) {
    Request& req = *c->req;
    std::string msg =
        req.peer == kAnyPeer
            ? "from any peer: " + detail
            : fmt::format("{} rank {}: {}", req.is_send ? "to" : "from", req.peer, detail);
    if (req.peer != kAnyPeer && !is_sink(&req)) mark_suspect(req.peer, msg);
    finish_part(c, RequestState::kError, msg);
  }

  // ---- Setup steps (the constructor's order).

  // fi_getinfo for the provider setting; of the interfaces it offers, the loopback one when
  // every rank is on this host, else the first other one (FI_TCP_IFACE etc. still filter
  // inside libfabric). Then what this endpoint takes from the provider's attributes.
  void get_info(const FabricOptions& opts, bool single_host) {
    InfoPtr all = query(provider_setting_);
    if (!all)
      throw ConfigError(fmt::format(
          "rank {}: libfabric provider '{}' (from setting '{}') offers no RDM endpoint with "
          "tagged messages here; `fi_info -l` lists the providers present",
          rank_, provider_setting_, opts.provider));
    const fi_info* pick = all.get();
    for (const fi_info* i = all.get(); i; i = i->next) {
      if (single_host == is_loopback_domain(i)) {
        pick = i;
        break;
      }
    }
    info_.reset(fi_dupinfo(pick));
    provider_name_ = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : "?";
    mr_local_ = (info_->domain_attr->mr_mode & FI_MR_LOCAL) != 0 || opts.always_register;
    max_msg_ = info_->ep_attr->max_msg_size;
    data_bytes_ = std::min<size_t>(info_->domain_attr->cq_data_size, 8);
    if (max_msg_ == 0 || max_msg_ > (size_t(1) << 30)) max_msg_ = size_t(1) << 30;
    if (opts.max_message_size) max_msg_ = std::min(max_msg_, opts.max_message_size);
    shm_ = provider_name_ == "shm";
    pairwise_ = use_pairwise(opts.pairwise, provider_name_, rank_, world_);
    // Every receive continues into a guard tail (post_guarded_recv) where that needs no
    // registration (shm, tcp): the pinned memory of a registered guard would cost too much.
    if (!mr_local_ && info_->rx_attr->iov_limit >= 2) guard_.reserve(max_msg_);
  }

  void open_fabric_and_domain() {
    QRING_FI_CHECK(fi_fabric(info_->fabric_attr, fabric_.out(), nullptr));
    QRING_FI_CHECK(fi_domain(fabric_.get(), info_.get(), domain_.out(), nullptr));
  }

  void open_cq() {
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_TAGGED;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 4096;
    QRING_FI_CHECK(fi_cq_open(domain_.get(), &cq_attr, cq_.out(), nullptr));
    av_attr_.type = FI_AV_TABLE;
    av_attr_.count = static_cast<size_t>(world_);
  }

  // Opens `av` and `ep` on the domain, `ep` bound to the CQ and to `av`, enabled; returns its
  // address.
  std::string open_endpoint(Fid<fid_ep>& ep, Fid<fid_av>& av) {
    QRING_FI_CHECK(fi_av_open(domain_.get(), &av_attr_, av.out(), nullptr));
    QRING_FI_CHECK(fi_endpoint(domain_.get(), info_.get(), ep.out(), nullptr));
    QRING_FI_CHECK(fi_ep_bind(ep.get(), &cq_.get()->fid, FI_TRANSMIT | FI_RECV));
    QRING_FI_CHECK(fi_ep_bind(ep.get(), &av.get()->fid, 0));
    QRING_FI_CHECK(fi_enable(ep.get()));
    return endpoint_name(ep.get());
  }

  // Pairwise: endpoint i serves peer i below this rank's number and peer i + 1 from it on;
  // messages to itself share the next rank's endpoint. All of them share the CQ (one read
  // progresses every endpoint bound to it); each has its own AV, with the entry of its peer
  // (and of itself, for the one that carries messages to itself): shm maps the regions of
  // every entry of an AV into each endpoint bound to it, and an endpoint that reset_peer
  // replaced, enabled on an AV shared with the others, took over messages meant for another
  // of this rank's endpoints (a ring neighbour's sends never completed; test
  // Rejoin.ReconnectingOneRankDoesNotDisturbTheOthersTraffic). Otherwise one endpoint and
  // one AV serve everyone.
  void open_endpoints() {
    const int n_eps = pairwise_ ? world_ - 1 : 1;
    for (int i = 0; i < n_eps; ++i)
      names_.push_back(open_endpoint(eps_.emplace_back(), avs_.emplace_back()));
    index_.assign(static_cast<size_t>(world_), 0);
    if (pairwise_) {
      for (int p = 0; p < world_; ++p) {
        const int q = p == rank_ ? (rank_ + 1) % world_ : p;
        index_[static_cast<size_t>(p)] = static_cast<size_t>(q < rank_ ? q : q - 1);
      }
    }
    for (size_t i : index_) ep_of_.push_back(eps_[i].get());
  }

  // Publishes this endpoint's address and inserts every peer's (a joining endpoint: only its
  // own; reset_peer connects the others). The n-th endpoint a process opens publishes under
  // its own key, so several endpoints (communicators) per process each find their peers'
  // matching endpoint. Every rank opens its endpoints in the same order, as communicators are
  // created collectively.
  void exchange_addresses(const FabricOptions& opts, Store& store, Deadline deadline) {
    const std::string prefix =
        opts.instance == 0 ? "fabric/addr/" : fmt::format("fabric/{}/addr/", opts.instance);
    store.set(prefix + std::to_string(rank_), published_address());
    addrs_.assign(static_cast<size_t>(world_), FI_ADDR_NOTAVAIL);
    gens_.assign(static_cast<size_t>(world_), 0);
    connected_.assign(static_cast<size_t>(world_), opts.join ? 0 : 1);
    connected_[static_cast<size_t>(rank_)] = 1;
    for (int r = 0; r < world_; ++r) {
      if (opts.join && r != rank_) continue;  // connected by reset_peer
      const std::string addr =
          r == rank_ ? names_[index_[static_cast<size_t>(r)]]  // pairwise: the endpoint's own name
                     : peer_address(store.get(prefix + std::to_string(r), deadline), r);
      insert_peer(r, addr);
    }
  }

  // Some providers refuse sends for the whole endpoint once one peer holds enough of its
  // resources (ofi_rxm: one pool of tx_attr->size credits, and sends to a peer that reads
  // nothing never give theirs back). A quarter of the depth in flight per peer keeps a
  // stopped peer from starving the others. Pairwise, a peer's endpoint is its own: up to
  // the full depth. Receives have no cap: one posted beyond it could be needed to complete
  // a send that earlier ones wait for (rendezvous).
  void size_send_queues() {
    const size_t depth = info_->tx_attr->size;
    const auto send_cap =
        static_cast<uint32_t>(std::clamp<size_t>(pairwise_ ? depth : depth / 4, 1, 1u << 16));
    queues_.resize(2 * static_cast<size_t>(world_) + 1);
    for (size_t i = 0; i < static_cast<size_t>(world_); ++i) queues_[i].cap = send_cap;
    active_.reserve(queues_.size());
    suspect_.assign(static_cast<size_t>(world_), 0);
    departing_.assign(static_cast<size_t>(world_), 0);
  }

  int rank_;
  int world_;
  std::string provider_setting_;
  std::string provider_name_;
  bool mr_local_ = false;
  size_t max_msg_ = 0;
  size_t data_bytes_ = 0;  // immediate data per message (the provider's cq_data_size, <= 8)
  bool closed_ = false;
  InfoPtr info_;
  // Where a message longer than a receive's buffer goes; unmapped after the endpoints.
  GuardTail guard_;
  TcpRegistrations tcp_regs_;  // outlives the endpoints' connections (destroyed after eps_)
  // Creation order; destroyed in reverse.
  Fid<fid_fabric> fabric_;
  Fid<fid_domain> domain_;
  Fid<fid_cq> cq_;
  fi_av_attr av_attr_{};
  std::deque<Fid<fid_av>> avs_;  // per endpoint (pairwise), else one; destroyed after eps_
  std::deque<Fid<fid_ep>> eps_;  // pairwise: one per peer (see the constructor), else one
  // prepare_reset_peer: replacements for endpoints of eps_ (by index), each with its AV.
  struct Spare {
    Fid<fid_av> av;  // destroyed after ep
    Fid<fid_ep> ep;
    std::string name;
  };
  std::map<size_t, std::unique_ptr<Spare>> spares_;
  std::vector<fid_ep*> ep_of_;   // per rank: the endpoint that talks to it
  bool pairwise_ = false;
  bool shm_ = false;
  // shm: this process's doorbell and each peer's (net/transport/doorbell.h); empty elsewhere.
  std::shared_ptr<Doorbell> bell_;
  std::vector<std::shared_ptr<Doorbell>> peer_bells_;
  std::vector<std::unique_ptr<PeerRegionLock>> peer_locks_;  // shm: per rank, its region's lock
  std::vector<fi_addr_t> addrs_;
  std::vector<uint32_t> gens_;     // per rank: the pair's generation (in every tag)
  std::vector<char> connected_;    // per rank: reachable (a joining endpoint starts with none)
  std::string setting_;            // the first line of what this endpoint publishes
  std::vector<std::string> names_;  // per libfabric endpoint: its address
  std::vector<size_t> index_;       // per rank: its endpoint in eps_ / names_
  std::string tcp_cc_;              // the congestion control of tcp connections ("": not tcp)
  uint32_t incarnation_ = 0;
  std::deque<Sink> sinks_;          // discard(): freed once their receive ended (close: after)
  std::vector<OpCtx*> orphans_;     // operations of endpoints reset_peer closed
  std::map<uintptr_t, Mr> mrs_;
  uint64_t next_key_ = 1;
  std::unique_ptr<DeadShmLockWatch> lock_watch_;  // shm: frees senders to a dead peer
  std::unordered_set<OpCtx*> outstanding_;
  std::vector<PostQueue> queues_;  // see queue_index()
  std::vector<uint32_t> active_;   // indices of the non-empty queues
  std::vector<char> suspect_;      // per rank: an error concerned it
  std::vector<int> suspects_;      // the same, sorted
  std::vector<char> departing_;    // per rank: said goodbye (expect_departure), errors expected
  // Pairwise any-peer receives in posting order (finished ones leave from the front), the
  // messages kept for later ones, and how many hold one to complete in progress().
  std::deque<std::shared_ptr<AnyRecv>> any_;
  std::deque<Leftover> stash_;
  size_t ready_any_ = 0;
};

}  // namespace

std::string resolve_provider(const std::string& setting, bool single_host) {
  if (setting == "tcp") return "tcp;ofi_rxm";
  if (setting == "verbs") return "verbs;ofi_rxm";
  if (setting != "auto" && !setting.empty()) return setting;
  if (single_host) return "shm";
  for (const char* p : {"cxi", "efa", "verbs;ofi_rxm"}) {
    if (query(p)) return p;
  }
  return "tcp;ofi_rxm";
}

std::unique_ptr<Endpoint> make_fabric_endpoint(const FabricOptions& opts, int rank, int world_size,
                                               Store& store, bool single_host, Deadline deadline) {
  static std::atomic<uint64_t> opened{0};
  FabricOptions o = opts;
  if (o.instance < 0) o.instance = int64_t(opened.fetch_add(1));
  return std::make_unique<FabricEndpoint>(o, rank, world_size, store, single_host, deadline);
}

}  // namespace qring::net
