// TcpStoreServer and TcpStore (net/rendezvous/store.h); wire format in docs/bootstrap.md.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "net/base/error.h"
#include "net/rendezvous/store.h"

namespace qring::net {
namespace {

// Deadline for requests the server answers at once (SET, CHECK, ADD, the send of any request).
constexpr auto kOpTimeout = std::chrono::seconds(60);
// A client that does not read its replies is dropped once this much is queued for it.
constexpr size_t kMaxQueuedBytes = size_t{256} << 20;
// Out of descriptors, the server stops accepting for this long after each failed accept.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);
// Warnings an attacker or a resource shortage can repeat are logged at most this often.
constexpr auto kWarnInterval = std::chrono::seconds(5);
// Rejected connections: at most one line per reason this often (issue 44, N3: one client
// had made the server write 77 MB of log in 40 s).
constexpr auto kRejectionLogInterval = std::chrono::seconds(10);
// New connections accepted per turn of the server's loop, after the input of the connections
// it has: a JOIN already sent is read before a burst of newcomers can push its connection out.
constexpr int kAcceptBatch = 16;

std::string errno_text(int err) {
  return fmt::format("{} (errno {})", std::strerror(err), err);
}

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// ---- encoding -------------------------------------------------------------------------------

void put_u16(std::string& s, uint16_t v) {
  s.push_back(static_cast<char>(v & 0xff));
  s.push_back(static_cast<char>(v >> 8));
}
void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_i64(std::string& s, int64_t v) {
  auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}
void put_str(std::string& s, std::string_view v) {
  put_u32(s, static_cast<uint32_t>(v.size()));
  s.append(v);
}
uint64_t load_le(const char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

struct Header {
  uint32_t magic = 0;
  uint16_t version = 0;
  uint16_t type = 0;
  uint32_t id = 0;
  uint32_t len = 0;
};

Header decode_header(const char* p) {
  Header h;
  h.magic = static_cast<uint32_t>(load_le(p, 4));
  h.version = static_cast<uint16_t>(load_le(p + 4, 2));
  h.type = static_cast<uint16_t>(load_le(p + 6, 2));
  h.id = static_cast<uint32_t>(load_le(p + 8, 4));
  h.len = static_cast<uint32_t>(load_le(p + 12, 4));
  return h;
}

std::string encode_frame(StoreMsg type, uint32_t id, std::string_view payload) {
  std::string f;
  f.reserve(kFrameHeaderBytes + payload.size());
  put_u32(f, kStoreMagic);
  put_u16(f, static_cast<uint16_t>(kProtocolVersion));
  put_u16(f, static_cast<uint16_t>(type));
  put_u32(f, id);
  put_u32(f, static_cast<uint32_t>(payload.size()));
  f.append(payload);
  return f;
}

// Reads fields off a payload; every accessor returns false when the payload is too short.
class PayloadReader {
 public:
  explicit PayloadReader(std::string_view p) : p_(p) {}
  bool u32(uint32_t& v) {
    if (p_.size() - pos_ < 4) return false;
    v = static_cast<uint32_t>(load_le(p_.data() + pos_, 4));
    pos_ += 4;
    return true;
  }
  bool i64(int64_t& v) {
    if (p_.size() - pos_ < 8) return false;
    v = static_cast<int64_t>(load_le(p_.data() + pos_, 8));
    pos_ += 8;
    return true;
  }
  bool str(std::string& v) {
    uint32_t n = 0;
    if (!u32(n) || p_.size() - pos_ < n) return false;
    v.assign(p_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool keys(std::vector<std::string>& v) {
    uint32_t n = 0;
    if (!u32(n) || n > (p_.size() - pos_) / 4) return false;  // each key takes >= 4 bytes
    v.resize(n);
    for (auto& k : v)
      if (!str(k)) return false;
    return true;
  }
  bool at_end() const { return pos_ == p_.size(); }

 private:
  std::string_view p_;
  size_t pos_ = 0;
};

std::string encode_keys(const std::vector<std::string>& keys) {
  std::string p;
  put_u32(p, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_str(p, k);
  return p;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string peer_name(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "?";
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a.sin_addr, buf, sizeof(buf));
  return fmt::format("{}:{}", buf, ntohs(a.sin_port));
}

// Resolves an IPv4 address for `host` (numeric or a name).
bool resolve_ipv4(const std::string& host, int port, sockaddr_in& out, std::string& err) {
  out = sockaddr_in{};
  out.sin_family = AF_INET;
  out.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &out.sin_addr) == 1) return true;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    err = fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc));
    return false;
  }
  out.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return true;
}

int remaining_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1'000'000));
}

// A string from an unauthenticated peer, safe for one log line: at most 64 characters,
// anything unprintable escaped.
std::string printable(std::string_view s) {
  std::string out;
  for (unsigned char ch : s.substr(0, 64))
    out += (ch >= 0x20 && ch < 0x7f && ch != '\\') ? std::string(1, static_cast<char>(ch))
                                                   : fmt::format("\\x{:02x}", ch);
  if (s.size() > 64) out += fmt::format("...({} bytes)", s.size());
  return out;
}

// A warning that may repeat at a high rate: logged at most once per kWarnInterval, with the
// number of occurrences suppressed since the last line.
class RateLimitedWarning {
 public:
  template <class... Args>
  void operator()(fmt::format_string<Args...> f, Args&&... args) {
    auto now = Clock::now();
    if (logged_ && now - last_ < kWarnInterval) {
      ++suppressed_;
      return;
    }
    std::string msg = fmt::format(f, std::forward<Args>(args)...);
    if (suppressed_ > 0)
      msg += fmt::format(" ({} more like this since the last report)", suppressed_);
    spdlog::warn("{}", msg);
    logged_ = true;
    last_ = now;
    suppressed_ = 0;
  }

 private:
  bool logged_ = false;
  Clock::time_point last_;
  uint64_t suppressed_ = 0;
};

// The server's rejections (StoreRejection): a counter per reason, and a warning per reason
// rate-limited to one line per kRejectionLogInterval, with the count suppressed since.
class Rejections {
 public:
  template <class... Args>
  void operator()(StoreRejection why, fmt::format_string<Args...> f, Args&&... args) {
    const auto i = static_cast<size_t>(why);
    const uint64_t total = counts_[i].fetch_add(1, std::memory_order_relaxed) + 1;
    Slot& s = slots_[i];
    const auto now = Clock::now();
    if (s.logged && now - s.last < kRejectionLogInterval) {
      ++s.suppressed;
      return;
    }
    std::string msg = fmt::format(f, std::forward<Args>(args)...);
    if (s.suppressed > 0)
      msg += fmt::format(" ({} more '{}' since the last report, {} in all)", s.suppressed,
                         store_rejection_name(why), total);
    spdlog::warn("store server: {}", msg);
    s.logged = true;
    s.last = now;
    s.suppressed = 0;
  }
  uint64_t count(StoreRejection why) const {
    return counts_[static_cast<size_t>(why)].load(std::memory_order_relaxed);
  }

 private:
  static constexpr size_t kReasons = static_cast<size_t>(StoreRejection::kCount);
  struct Slot {
    bool logged = false;
    Clock::time_point last;
    uint64_t suppressed = 0;
  };
  std::array<Slot, kReasons> slots_{};
  std::array<std::atomic<uint64_t>, kReasons> counts_{};
};

// The IPv4 address of a connection's peer (0 when unknown): what the per-source cap counts.
uint32_t peer_address(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return 0;
  return a.sin_addr.s_addr;
}

}  // namespace

const char* store_rejection_name(StoreRejection r) {
  static constexpr const char* kNames[] = {
      "join rejected",  "not a join",          "bad frame", "truncated frame", "join deadline",
      "dropped for a newer connection", "connection error"};
  static_assert(std::size(kNames) == size_t(StoreRejection::kCount));
  const auto i = static_cast<size_t>(r);
  return i < std::size(kNames) ? kNames[i] : "?";
}

std::string encode_join_fields(const JoinInfo& join, std::string_view client_nonce) {
  std::string p;
  put_u32(p, join.version);
  put_i64(p, join.rank);
  put_i64(p, join.world_size);
  put_str(p, join.job_id);
  put_str(p, join.hostname);
  put_str(p, client_nonce);
  return p;
}

std::string join_proof(std::string_view secret, std::string_view server_nonce,
                       std::string_view join_fields) {
  std::string m = "qring-store-join";
  m.append(server_nonce);
  m.append(join_fields);
  return hmac_sha256(secret, m);
}

std::string server_proof(std::string_view secret, std::string_view server_nonce,
                         std::string_view join_fields) {
  std::string m = "qring-store-server";
  m.append(server_nonce);
  m.append(join_fields);
  return hmac_sha256(secret, m);
}

// =============================================================================================
// Server

struct TcpStoreServer::Impl {
  struct Conn {
    Fd fd;
    std::string peer;
    std::string in;
    std::string out;
    bool joined = false;
    bool closing = false;  // an error reply is queued; then the write side is shut down
    bool shut = false;     // and input is discarded until the client closes
    int rank = -1;
    int64_t incarnation = -1;     // counted through this connection (ADD to incarnation_key)
    uint32_t source = 0;          // the peer's address (the per-source cap)
    Clock::time_point since;      // accepted (its CHALLENGE queued) at
    std::string nonce;  // of this connection's CHALLENGE
    // Dropped at this time unless it has joined (then: never, until it is closing).
    Clock::time_point expires = Clock::time_point::max();
  };
  struct Parked {
    uint64_t conn;
    uint32_t id;
    StoreMsg type;
    std::vector<std::string> keys;
  };

  int world_size;
  std::string job_id;
  StoreServerOptions options;
  Fd listen_fd;
  Fd wake_fd;
  Fd reserve_fd;  // a spare descriptor: lets accept() shed a connection when none are left
  Clock::time_point accept_paused_until;
  RateLimitedWarning accept_warning;
  Rejections rejections;
  int port = 0;
  std::map<uint64_t, Conn> conns;
  uint64_t next_conn = 1;
  // The connections that have not joined, oldest (lowest id) first: all of them, and by
  // source address. Past a cap the first of these is dropped for a newcomer.
  std::set<uint64_t> unjoined;
  std::unordered_map<uint32_t, std::set<uint64_t>> unjoined_by_source;
  // world + max_handshakes, but at most a quarter of the process's descriptors (the store
  // may share its process with a rank, whose fabric needs descriptors too).
  size_t max_unjoined = 0;
  std::vector<Parked> parked;
  std::unordered_map<std::string, std::string> data;
  std::map<int, uint64_t> rank_conn;
  std::atomic<int> connected{0};  // rank_conn.size(), for connected_ranks()
  // The owner's writes (record()), for the server's thread; `stopping` tells a wake-up that
  // ends the server from one that brings them.
  std::mutex owner_mu;
  std::vector<std::pair<std::string, std::string>> owner_writes;
  std::atomic<bool> stopping{false};
  std::thread thread;

  void run();
  void accept_all();
  bool connection_pending() const;
  void admit(int fd);
  bool drop_oldest_unjoined(uint32_t source, bool at_fd_limit);
  void forget_unjoined(uint64_t cid, uint32_t source);
  bool read_conn(Conn& c);
  bool process(uint64_t cid, Conn& c);
  bool handle(uint64_t cid, Conn& c, const Header& h, std::string_view payload);
  bool handle_join(uint64_t cid, Conn& c, const Header& h, std::string_view payload,
                   PayloadReader& r);
  bool handle_add(Conn& c, const Header& h, std::string_view payload, PayloadReader& r);
  bool malformed(const Conn& c, std::string_view payload, const char* what);
  bool refuse_foreign(Conn& c, const Header& h, const std::string& key, const char* op);
  bool flush(Conn& c);
  bool drain(Conn& c);
  void reply(Conn& c, uint32_t id, StoreMsg type, std::string_view payload = {}) {
    c.out += encode_frame(type, id, payload);
  }
  void reject(Conn& c, uint32_t id, const std::string& reason) {
    std::string p;
    put_str(p, reason);
    reply(c, id, StoreMsg::kError, p);
    c.closing = true;
    // A rejected client reads the reply and closes; one that does not is dropped.
    c.expires = std::min(c.expires, Clock::now() + options.handshake_timeout);
  }
  // A failed handshake: the client learns only that it was rejected, the log says why.
  void reject_join(Conn& c, uint32_t id, const std::string& why,
                   StoreRejection reason = StoreRejection::kJoinRejected) {
    rejections(reason, "rejected JOIN from {}: {}", c.peer, why);
    reject(c, id, "rejected");
  }
  static size_t frame_limit(const Conn& c) {
    return c.joined ? kMaxFrameBytes : kMaxHandshakeFrameBytes;
  }
  void expire_connections();
  int poll_timeout_ms() const;
  bool has_all(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return data.count(k); });
  }
  void answer(Conn& c, const Parked& p) {
    std::string out;
    if (p.type == StoreMsg::kGet) put_str(out, data.at(p.keys[0]));
    reply(c, p.id, StoreMsg::kOk, out);
  }
  void wake(const std::string& key);
  void close_conn(uint64_t cid);
};

TcpStoreServer::TcpStoreServer(const std::string& bind_host, int port, int world_size,
                               std::string job_id, StoreServerOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (world_size < 1) throw UsageError(fmt::format("store server: world size {} < 1", world_size));
  if (port < 0 || port > 65535) throw UsageError(fmt::format("store server: bad port {}", port));
  if (options.secret.empty() && !is_loopback_host(bind_host))
    throw ConfigError(fmt::format(
        "store server: refusing to serve {} without a job secret: anyone who reaches the port "
        "could join the job; set QRING_JOB_SECRET (the same on every rank), or keep the store "
        "on loopback",
        bind_host));
  if (options.max_handshakes < 1 || options.max_handshakes_per_source < 1 ||
      options.handshake_timeout <= milliseconds(0))
    throw UsageError(
        "store server: max_handshakes, max_handshakes_per_source and handshake_timeout must "
        "be positive");
  auto& s = *impl_;
  s.world_size = world_size;
  s.job_id = std::move(job_id);
  s.options = std::move(options);
  s.max_unjoined = size_t(world_size) + size_t(s.options.max_handshakes);
  if (rlimit lim{}; getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
    s.max_unjoined = std::min(s.max_unjoined,
                              std::max(size_t(world_size) + 16, size_t(lim.rlim_cur / 4)));
  sockaddr_in addr{};
  std::string err;
  if (!resolve_ipv4(bind_host, port, addr, err))
    throw ConfigError(fmt::format("store server: bind address {}", err));
  s.listen_fd = Fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (s.listen_fd.get() < 0) throw IoError("store server: socket(): " + errno_text(errno));
  int one = 1;
  setsockopt(s.listen_fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(s.listen_fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    std::string hint;
    if (err == EADDRINUSE)
      hint = "; another process (another job?) uses this port: pick another (QRING_STORE_PORT, "
             "QRING_STORE or --port)";
    else if (err == EADDRNOTAVAIL)
      hint = "; that is not an address of this host: the store runs on rank 0's host";
    throw IoError(fmt::format("store server: cannot bind {}:{}: {}{}", bind_host, port,
                              errno_text(err), hint));
  }
  // A long queue of completed connections: a flood must not make the kernel drop a rank's
  // connection attempt (its SYN is only sent again after 1 s, then 3 s).
  if (listen(s.listen_fd.get(), SOMAXCONN) != 0)
    throw IoError("store server: listen(): " + errno_text(errno));
  socklen_t len = sizeof(addr);
  getsockname(s.listen_fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  s.port = ntohs(addr.sin_port);
  s.wake_fd = Fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (s.wake_fd.get() < 0) throw IoError("store server: eventfd(): " + errno_text(errno));
  s.reserve_fd = Fd(open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (s.reserve_fd.get() < 0) throw IoError("store server: open(/dev/null): " + errno_text(errno));
  s.thread = std::thread([&s] {
    try {
      s.run();
    } catch (const std::exception& e) {
      spdlog::error("store server on port {} stopped: {}", s.port, e.what());
    }
  });
  spdlog::debug("store server listening on {}:{} (world size {}, job '{}'{})", bind_host, s.port,
                world_size, s.job_id, s.options.secret.empty() ? ", no job secret" : "");
}

TcpStoreServer::~TcpStoreServer() {
  impl_->stopping.store(true);
  uint64_t one = 1;
  if (write(impl_->wake_fd.get(), &one, sizeof(one)) < 0)
    spdlog::error("store server: cannot wake server thread: {}", errno_text(errno));
  if (impl_->thread.joinable()) impl_->thread.join();
}

int TcpStoreServer::port() const {
  return impl_->port;
}

uint64_t TcpStoreServer::rejections(StoreRejection why) const {
  return impl_->rejections.count(why);
}

int TcpStoreServer::connected_ranks() const {
  return impl_->connected.load(std::memory_order_relaxed);
}

void TcpStoreServer::record(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(impl_->owner_mu);
    impl_->owner_writes.emplace_back(key, value);
  }
  uint64_t one = 1;
  if (write(impl_->wake_fd.get(), &one, sizeof(one)) < 0)
    spdlog::error("store server: cannot wake server thread: {}", errno_text(errno));
}

void TcpStoreServer::Impl::run() {
  std::vector<pollfd> pfds;
  std::vector<uint64_t> ids;
  while (true) {
    pfds.clear();
    ids.clear();
    pfds.push_back({wake_fd.get(), POLLIN, 0});
    // While accepting is paused the listening socket is not watched (it stays readable).
    short listen_ev = Clock::now() >= accept_paused_until ? POLLIN : 0;
    pfds.push_back({listen_fd.get(), listen_ev, 0});
    for (auto& [id, c] : conns) {
      short ev = POLLIN;
      if (!c.out.empty()) ev |= POLLOUT;
      pfds.push_back({c.fd.get(), ev, 0});
      ids.push_back(id);
    }
    int n = poll(pfds.data(), pfds.size(), poll_timeout_ms());
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("store server: poll(): {}", errno_text(errno));
      std::this_thread::sleep_for(milliseconds(10));
      continue;
    }
    if (pfds[0].revents) {
      // Read first, then look at `stopping`: the read may consume the destructor's wake-up
      // together with a record()'s, and a look before it would miss the stop and poll forever
      // (qring-launch hung in ~TcpStoreServer after recording a death).
      uint64_t n = 0;
      (void)read(wake_fd.get(), &n, sizeof(n));
      if (stopping.load()) return;
      std::vector<std::pair<std::string, std::string>> writes;
      {
        std::lock_guard<std::mutex> lock(owner_mu);
        writes.swap(owner_writes);
      }
      for (auto& [key, value] : writes) {
        data[key] = std::move(value);
        wake(key);
      }
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      short rev = pfds[i + 2].revents;
      auto it = conns.find(ids[i]);
      if (rev == 0 || it == conns.end()) continue;
      Conn& c = it->second;
      bool ok = true;
      if (rev & POLLIN) ok = c.closing ? drain(c) : read_conn(c) && process(ids[i], c);
      if (ok && (rev & (POLLERR | POLLHUP | POLLNVAL)) && !(rev & POLLIN)) ok = false;
      if (ok) ok = flush(c);
      if (!ok) close_conn(ids[i]);
    }
    // Newcomers after the input of the connections there are (kAcceptBatch).
    if (pfds[1].revents & POLLIN) accept_all();
    // Replies to parked requests (and CHALLENGEs) may have been queued on any connection.
    for (auto it = conns.begin(); it != conns.end();) {
      auto cur = it++;
      if (!cur->second.out.empty() && !flush(cur->second)) close_conn(cur->first);
    }
    expire_connections();
  }
}

int TcpStoreServer::Impl::poll_timeout_ms() const {
  auto next = Clock::time_point::max();
  for (const auto& [id, c] : conns) next = std::min(next, c.expires);
  if (Clock::now() < accept_paused_until) next = std::min(next, accept_paused_until);
  if (next == Clock::time_point::max()) return -1;
  return remaining_ms(next);
}

void TcpStoreServer::Impl::expire_connections() {
  auto now = Clock::now();
  for (auto it = conns.begin(); it != conns.end();) {
    auto cur = it++;
    if (cur->second.expires > now) continue;
    if (!cur->second.closing)
      rejections(StoreRejection::kJoinDeadline,
                 "{} sent no complete JOIN within {} ms of its CHALLENGE; dropping it",
                 cur->second.peer, options.handshake_timeout.count());
    close_conn(cur->first);
  }
}

void TcpStoreServer::Impl::accept_all() {
  for (int accepted = 0; accepted < kAcceptBatch;) {
    int fd = accept4(listen_fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // accept() wants a descriptor before it looks at the queue: at the limit it fails even
      // when nobody waits, and the connection admitted last (a rank's, perhaps) must not make
      // room for no one.
      if ((err == EMFILE || err == ENFILE) && !connection_pending()) return;
      // Out of descriptors: a connection that has not joined makes room for the newcomer,
      // as past the caps (an attacker's connections hold descriptors, not ranks out).
      if ((err == EMFILE || err == ENFILE) && drop_oldest_unjoined(0, true)) {
        accept_warning(
            "store server on port {}: accept(): {}; dropping the oldest connection that has "
            "not joined for each new one (ulimit -n)",
            port, errno_text(err));
        continue;
      }
      // Out of descriptors (EMFILE, ENFILE) or memory: the pending connection keeps the
      // listening socket readable, so poll() would return at once, forever. Shed it with the
      // reserved descriptor (its client retries) and stop accepting for a while.
      if (err == EMFILE || err == ENFILE) {
        reserve_fd.reset();
        int shed = accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (shed >= 0) ::close(shed);
        reserve_fd = Fd(open("/dev/null", O_RDONLY | O_CLOEXEC));
      }
      accept_warning(
          "store server on port {}: accept(): {}; refusing connections for {} ms at a time "
          "until descriptors or memory free up (ulimit -n)",
          port, errno_text(err), kAcceptBackoff.count());
      accept_paused_until = Clock::now() + kAcceptBackoff;
      return;
    }
    admit(fd);
    ++accepted;
  }
}

// Whether a connection waits in the listening socket's queue (it is readable then).
bool TcpStoreServer::Impl::connection_pending() const {
  pollfd p{listen_fd.get(), POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & POLLIN);
}

// Serves a new connection (its CHALLENGE), first making room past the caps.
void TcpStoreServer::Impl::admit(int fd) {
  const uint32_t source = peer_address(fd);
  while (drop_oldest_unjoined(source, false)) {
  }
  set_nodelay(fd);
  Conn c;
  c.fd = Fd(fd);
  c.peer = peer_name(fd);
  c.source = source;
  c.since = Clock::now();
  c.nonce = random_bytes(kNonceBytes);
  c.expires = c.since + options.handshake_timeout;
  std::string p;
  put_str(p, c.nonce);
  reply(c, 0, StoreMsg::kChallenge, p);
  const uint64_t cid = next_conn++;
  conns.emplace(cid, std::move(c));
  unjoined.insert(cid);
  unjoined_by_source[source].insert(cid);
}

// Drops the oldest connection that has not joined: of `source` when it holds its cap, else of
// all when they hold theirs (or, at_fd_limit, in any case). False when there is none to drop.
bool TcpStoreServer::Impl::drop_oldest_unjoined(uint32_t source, bool at_fd_limit) {
  uint64_t victim = 0;
  std::string cap;
  auto mine = unjoined_by_source.find(source);
  if (at_fd_limit && !unjoined.empty()) {
    victim = *unjoined.begin();
    cap = "descriptors ran out";
  } else if (mine != unjoined_by_source.end() &&
             mine->second.size() >= std::min(size_t(options.max_handshakes_per_source),
                                             max_unjoined)) {
    victim = *mine->second.begin();
    cap = fmt::format("{} connections from its address have not joined",
                      mine->second.size());
  } else if (unjoined.size() >= max_unjoined) {
    victim = *unjoined.begin();
    cap = fmt::format("{} connections have not joined", unjoined.size());
  }
  if (victim == 0) return false;
  const Conn& v = conns.at(victim);
  if (!v.closing)
    rejections(StoreRejection::kDroppedForNewer,
               "{}; dropping the oldest, from {} ({} ms old), for a new one", cap, v.peer,
               std::chrono::duration_cast<milliseconds>(Clock::now() - v.since).count());
  close_conn(victim);
  return true;
}

void TcpStoreServer::Impl::forget_unjoined(uint64_t cid, uint32_t source) {
  unjoined.erase(cid);
  auto it = unjoined_by_source.find(source);
  if (it == unjoined_by_source.end()) return;
  it->second.erase(cid);
  if (it->second.empty()) unjoined_by_source.erase(it);
}

bool TcpStoreServer::Impl::read_conn(Conn& c) {
  char buf[65536];
  while (true) {
    // Before JOIN succeeds, at most one handshake frame is buffered: process() handles it
    // (or closes the connection) before more is read.
    size_t want = sizeof(buf);
    if (!c.joined) {
      const size_t cap = kFrameHeaderBytes + kMaxHandshakeFrameBytes;
      if (c.in.size() >= cap) return true;
      want = std::min(want, cap - c.in.size());
    }
    ssize_t r = recv(c.fd.get(), buf, want, 0);
    if (r > 0) {
      c.in.append(buf, static_cast<size_t>(r));
      // Reject an oversized header before buffering its payload.
      if (c.in.size() >= kFrameHeaderBytes) {
        Header h = decode_header(c.in.data());
        if (h.magic != kStoreMagic || h.len > frame_limit(c)) return true;  // process() reports
        if (c.in.size() >= kFrameHeaderBytes + h.len) return true;
      }
      continue;
    }
    if (r == 0) {
      if (!c.in.empty() && !c.closing)
        rejections(StoreRejection::kTruncatedFrame,
                   "connection from {} closed inside a frame ({} bytes of a truncated frame); "
                   "dropping it",
                   c.peer, c.in.size());
      else
        spdlog::debug("store server: {} (rank {}) disconnected", c.peer, c.rank);
      return false;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    if (errno == EINTR) continue;
    rejections(StoreRejection::kConnectionError, "recv from {}{}: {}", c.peer,
               c.joined ? fmt::format(" (rank {})", c.rank) : "", errno_text(errno));
    return false;
  }
}

bool TcpStoreServer::Impl::process(uint64_t cid, Conn& c) {
  size_t pos = 0;
  bool ok = true;
  while (!c.closing && c.in.size() - pos >= kFrameHeaderBytes) {
    Header h = decode_header(c.in.data() + pos);
    if (h.magic != kStoreMagic) {
      rejections(StoreRejection::kBadFrame,
                 "bad frame magic {:#010x} from {} (expected {:#010x}); closing the connection",
                 h.magic, c.peer, kStoreMagic);
      ok = false;
      break;
    }
    if (h.len > frame_limit(c)) {
      rejections(StoreRejection::kBadFrame,
                 "frame of {} bytes from {} exceeds the limit of {} bytes{}; closing the "
                 "connection",
                 h.len, c.peer, frame_limit(c), c.joined ? "" : " before JOIN");
      ok = false;
      break;
    }
    if (c.in.size() - pos < kFrameHeaderBytes + h.len) break;
    std::string_view payload(c.in.data() + pos + kFrameHeaderBytes, h.len);
    pos += kFrameHeaderBytes + h.len;
    if (!handle(cid, c, h, payload)) {
      ok = false;
      break;
    }
  }
  c.in.erase(0, pos);
  return ok;
}

bool TcpStoreServer::Impl::handle(uint64_t cid, Conn& c, const Header& h,
                                  std::string_view payload) {
  if (h.version != kProtocolVersion) {
    std::string why = fmt::format("protocol version mismatch: client speaks version {}, server "
                                  "version {}",
                                  h.version, kProtocolVersion);
    if (c.joined)
      reject(c, h.id, why);
    else
      reject_join(c, h.id, why, StoreRejection::kNotJoin);
    return true;
  }
  auto type = static_cast<StoreMsg>(h.type);
  if (!c.joined && type != StoreMsg::kJoin) {
    reject_join(c, h.id, fmt::format("the first message was of type {:#x}, not JOIN", h.type),
                StoreRejection::kNotJoin);
    return true;
  }
  PayloadReader r(payload);
  switch (type) {
    case StoreMsg::kJoin:
      return handle_join(cid, c, h, payload, r);
    case StoreMsg::kSet: {
      std::string key, value;
      if (!r.str(key) || !r.str(value) || !r.at_end()) return malformed(c, payload, "SET");
      if (refuse_foreign(c, h, key, "set")) return true;
      data[key] = std::move(value);
      reply(c, h.id, StoreMsg::kOk);
      wake(key);
      return true;
    }
    case StoreMsg::kGet: {
      std::string key;
      if (!r.str(key) || !r.at_end()) return malformed(c, payload, "GET");
      Parked p{cid, h.id, type, {std::move(key)}};
      if (has_all(p.keys))
        answer(c, p);
      else
        parked.push_back(std::move(p));
      return true;
    }
    case StoreMsg::kWait:
    case StoreMsg::kCheck: {
      std::vector<std::string> keys;
      if (!r.keys(keys) || !r.at_end())
        return malformed(c, payload, type == StoreMsg::kWait ? "WAIT" : "CHECK");
      if (type == StoreMsg::kCheck) {
        std::string out;
        put_u32(out, has_all(keys) ? 1 : 0);
        reply(c, h.id, StoreMsg::kOk, out);
      } else if (has_all(keys)) {
        reply(c, h.id, StoreMsg::kOk);
      } else {
        parked.push_back({cid, h.id, type, std::move(keys)});
      }
      return true;
    }
    case StoreMsg::kMissing: {
      std::vector<std::string> keys;
      if (!r.keys(keys) || !r.at_end()) return malformed(c, payload, "MISSING");
      std::vector<std::string> missing;
      for (auto& k : keys)
        if (!data.count(k)) missing.push_back(std::move(k));
      reply(c, h.id, StoreMsg::kOk, encode_keys(missing));
      return true;
    }
    case StoreMsg::kAdd:
      return handle_add(c, h, payload, r);
    default:
      rejections(StoreRejection::kBadFrame,
                 "unknown message type {:#x} from {}; closing the connection", h.type, c.peer);
      return false;
  }
}

// JOIN: admits the connection as a rank of the job, or rejects it.
bool TcpStoreServer::Impl::handle_join(uint64_t cid, Conn& c, const Header& h,
                                       std::string_view payload, PayloadReader& r) {
  uint32_t version = 0;
  int64_t rank = 0, world = 0;
  std::string job, host, client_nonce, proof;
  if (!r.u32(version) || !r.i64(rank) || !r.i64(world) || !r.str(job) || !r.str(host) ||
      !r.str(client_nonce) || !r.str(proof) || !r.at_end())
    return malformed(c, payload, "JOIN");
  // The proof covers everything before it: the fields as the client sent them.
  std::string_view fields = payload.substr(0, payload.size() - 4 - proof.size());
  std::string expected = join_proof(options.secret, c.nonce, fields);
  std::string who = fmt::format("rank {} on '{}', world size {}, job '{}'", rank,
                                printable(host), world, printable(job));
  if (c.joined) {
    reject(c, h.id, fmt::format("rank {} sent JOIN twice", c.rank));
  } else if (version != kProtocolVersion) {
    reject_join(c, h.id,
                fmt::format("{}: protocol version mismatch: client speaks version {}, "
                            "server version {}",
                            who, version, kProtocolVersion));
  } else if (proof.size() != expected.size() ||
             CRYPTO_memcmp(proof.data(), expected.data(), expected.size()) != 0) {
    reject_join(c, h.id,
                fmt::format("{}: wrong proof of the job secret (another job, a different "
                            "QRING_JOB_SECRET, or not a qring rank)",
                            who));
  } else if (world != world_size) {
    reject_join(c, h.id,
                fmt::format("{}: world size mismatch, the store serves {}", who, world_size));
  } else if (job != job_id) {
    reject_join(c, h.id,
                fmt::format("{}: job id mismatch, the store serves '{}'", who, job_id));
  } else if (rank < 0 || rank >= world_size) {
    reject_join(c, h.id, fmt::format("{}: rank out of range [0, {})", who, world_size));
  } else if (auto it = rank_conn.find(static_cast<int>(rank)); it != rank_conn.end()) {
    reject_join(c, h.id,
                fmt::format("{}: duplicate rank, already joined from {}", who,
                            conns.count(it->second) ? conns.at(it->second).peer : "?"));
  } else {
    c.joined = true;
    c.rank = static_cast<int>(rank);
    c.expires = Clock::time_point::max();
    forget_unjoined(cid, c.source);
    rank_conn[c.rank] = cid;
    connected.store(int(rank_conn.size()), std::memory_order_relaxed);
    spdlog::debug("store server: rank {} ({}) joined from {}", rank, printable(host), c.peer);
    std::string out;
    put_str(out, server_proof(options.secret, c.nonce, fields));
    reply(c, h.id, StoreMsg::kOk, out);
  }
  return true;
}

// ADD: adds to a counter and answers with its new value.
bool TcpStoreServer::Impl::handle_add(Conn& c, const Header& h, std::string_view payload,
                                      PayloadReader& r) {
  std::string key;
  int64_t delta = 0;
  if (!r.str(key) || !r.i64(delta) || !r.at_end()) return malformed(c, payload, "ADD");
  if (refuse_foreign(c, h, key, "add to")) return true;
  int64_t v = 0;
  try {
    auto it = data.find(key);
    if (it != data.end()) v = parse_counter(key, it->second);
  } catch (const UsageError& e) {
    std::string out;
    put_str(out, e.what());
    reply(c, h.id, StoreMsg::kError, out);
    return true;
  }
  if (__builtin_add_overflow(v, delta, &v)) {  // found by fuzz_store (signed overflow)
    std::string out;
    put_str(out, fmt::format("add to key '{}': {} + {} overflows a 64-bit counter",
                             printable(key), data.count(key) ? data[key] : "0", delta));
    reply(c, h.id, StoreMsg::kError, out);
    return true;
  }
  data[key] = std::to_string(v);
  // This connection counted its rank's incarnation: it is that process's (witness_deaths).
  if (delta == 1 && v >= 1 && key == incarnation_key(c.rank)) c.incarnation = v - 1;
  std::string out;
  put_i64(out, v);
  reply(c, h.id, StoreMsg::kOk, out);
  wake(key);
  return true;
}

bool TcpStoreServer::Impl::malformed(const Conn& c, std::string_view payload, const char* what) {
  rejections(StoreRejection::kBadFrame,
             "malformed {} message ({} bytes) from {}; closing the connection", what,
             payload.size(), c.peer);
  return false;
}

// SET and ADD of a key that belongs to another rank (key_owner()).
bool TcpStoreServer::Impl::refuse_foreign(Conn& c, const Header& h, const std::string& key,
                                          const char* op) {
  if (owner_only_key(key)) {
    spdlog::warn("store server: rank {} ({}) tried to {} key '{}', which only the store's owner "
                 "writes; refused",
                 c.rank, c.peer, op, printable(key));
    std::string out;
    put_str(out, fmt::format("rank {} may not {} key '{}': only the store's owner writes it",
                             c.rank, op, key));
    reply(c, h.id, StoreMsg::kError, out);
    return true;
  }
  int owner = key_owner(key, world_size);
  if (owner < 0 || owner == c.rank) return false;
  spdlog::warn("store server: rank {} ({}) tried to {} key '{}' of rank {}; refused", c.rank,
               c.peer, op, printable(key), owner);
  std::string out;
  put_str(out, fmt::format("rank {} may not {} key '{}': it belongs to rank {}", c.rank, op,
                           key, owner));
  reply(c, h.id, StoreMsg::kError, out);
  return true;
}

void TcpStoreServer::Impl::wake(const std::string& key) {
  for (auto it = parked.begin(); it != parked.end();) {
    bool relevant = std::find(it->keys.begin(), it->keys.end(), key) != it->keys.end();
    if (relevant && has_all(it->keys)) {
      auto c = conns.find(it->conn);
      if (c != conns.end()) answer(c->second, *it);
      it = parked.erase(it);
    } else {
      ++it;
    }
  }
}

bool TcpStoreServer::Impl::drain(Conn& c) {
  char buf[4096];
  while (true) {
    ssize_t r = recv(c.fd.get(), buf, sizeof(buf), 0);
    if (r > 0) continue;
    if (r < 0 && errno == EINTR) continue;
    return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

bool TcpStoreServer::Impl::flush(Conn& c) {
  while (!c.out.empty()) {
    ssize_t w = send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (w > 0) {
      c.out.erase(0, static_cast<size_t>(w));
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (w < 0 && errno == EINTR) continue;
    spdlog::debug("store server: send to {}: {}", c.peer, errno_text(errno));
    return false;
  }
  if (c.out.size() > kMaxQueuedBytes) {
    spdlog::error("store server: {} does not read its replies ({} bytes queued); dropping it",
                  c.peer, c.out.size());
    return false;
  }
  if (c.closing && c.out.empty() && !c.shut) {
    shutdown(c.fd.get(), SHUT_WR);  // the client reads the error reply, then EOF
    c.shut = true;
  }
  return true;
}

void TcpStoreServer::Impl::close_conn(uint64_t cid) {
  auto it = conns.find(cid);
  if (it == conns.end()) return;
  if (it->second.joined) {
    auto rc = rank_conn.find(it->second.rank);
    if (rc != rank_conn.end() && rc->second == cid) rank_conn.erase(rc);
    if (options.witness_deaths && it->second.incarnation >= 0 &&
        it->second.rank >= options.witness_first_rank) {
      const std::string key = dead_key(it->second.rank, uint32_t(it->second.incarnation));
      data[key] = "connection closed";
      wake(key);
    }
    connected.store(int(rank_conn.size()), std::memory_order_relaxed);
  } else {
    forget_unjoined(cid, it->second.source);
  }
  std::erase_if(parked, [&](const Parked& p) { return p.conn == cid; });
  Conn& c = it->second;
  if (!c.out.empty())  // best effort: replies to the requests before a bad frame
    (void)send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  conns.erase(it);
}

std::string store_server_feed(std::string_view bytes, bool joined, int world_size) {
  TcpStoreServer::Impl s;
  s.world_size = std::max(1, world_size);
  s.job_id = "fuzz";
  s.options.secret = "fuzz-secret";
  // Two connections, as in a job: rank 1 parked in a WAIT that the input's SETs may wake.
  for (uint64_t cid : {uint64_t(1), uint64_t(2)}) {
    TcpStoreServer::Impl::Conn& c = s.conns[cid];
    c.peer = fmt::format("fuzz-{}", cid);
    c.nonce = "nonce";
    if (joined && cid <= uint64_t(s.world_size)) {
      c.joined = true;
      c.rank = int(cid) - 1;
      s.rank_conn[c.rank] = cid;
    }
  }
  s.parked.push_back({2, 7, StoreMsg::kWait, {"fabric/addr/0", "host/0"}});
  TcpStoreServer::Impl::Conn& c = s.conns[1];
  c.in.assign(bytes.data(), bytes.size());
  // As the poll loop does: whole frames are processed; a bad one ends the connection.
  const bool ok = s.process(1, c);
  std::string out = c.out;
  if (!ok) s.close_conn(1);
  return out;
}

// =============================================================================================
// Client

struct TcpStore::Impl {
  struct Reply {
    bool done = false;
    Header h;
    std::string payload;
  };
  enum class ReadResult { kFrame, kTimeout, kError, kMalformed };

  std::string where;  // "host:port"
  JoinInfo join;
  Fd fd;
  std::mutex mu;
  std::condition_variable cv;
  bool reading = false;  // one thread at a time reads the socket and hands replies out
  bool broken = false;
  std::string broken_reason;
  uint32_t next_id = 1;
  std::unordered_map<uint32_t, Reply*> pending;
  std::string in;  // touched only by the reading thread
  // Connections of earlier attempts still waiting for their CHALLENGE, oldest first. A store
  // slow to accept (loaded, or busy with an attacker's connections) serves its queue in
  // order: a new attempt must not cost the old one its place, or a queue slower than the
  // longest attempt timeout is never served.
  std::vector<Fd> waiting;
  static constexpr size_t kMaxWaiting = 3;

  // What the attempts to join met (the final error names it).
  struct Attempts {
    int total = 0, unreachable = 0, closed_before_challenge = 0, no_challenge = 0,
        closed_before_reply = 0, no_reply = 0;
    std::string last_error;
    std::string describe() const;
  };
  enum class Attempt { kJoined, kRetry };
  bool try_connect(const std::string& host, int port, Deadline deadline, std::string& err);
  // Waits until `fd` or a connection in `waiting` is readable (its CHALLENGE, or its end);
  // a waiting one that is becomes `fd`, and `fd` waits in its stead. False at the deadline.
  bool await_challenge(Deadline deadline);
  // One connection: CHALLENGE, JOIN, the server's proof. kRetry (counted in `a`) when the
  // connection fails, closes or stays silent past `attempt_deadline`; throws ProtocolError
  // when the server rejects the JOIN or is not this job's store.
  Attempt try_join(const std::string& host, int port, Deadline deadline,
                   Deadline attempt_deadline, Attempts& a);
  // The keys of `keys` the store does not have (for a timeout message).
  std::vector<std::string> missing(const std::vector<std::string>& keys);
  bool send_all(const std::string& frame, Deadline deadline, std::string& err);
  ReadResult read_frame(Deadline deadline, Header& h, std::string& payload, std::string& err);
  // Sends one request and waits for its reply. `what` describes the wait for TimeoutError.
  Reply request(StoreMsg type, const std::string& payload, Deadline deadline,
                const std::string& what);
  // Checks an OK reply; a reply of ERROR raises E with the server's reason.
  template <class E>
  void expect_ok(const Reply& r, const char* op) {
    if (r.h.type == static_cast<uint16_t>(StoreMsg::kError)) {
      PayloadReader pr(r.payload);
      std::string reason;
      if (!pr.str(reason)) reason = "(unreadable reason)";
      throw E(fmt::format("store {} rejected {} of rank {}: {}", where, op, join.rank, reason));
    }
    if (r.h.type != static_cast<uint16_t>(StoreMsg::kOk) || r.h.version != kProtocolVersion)
      malformed(op, fmt::format("reply type {:#x}, version {}", r.h.type, r.h.version));
  }
  [[noreturn]] void malformed(const char* op, const std::string& detail) {
    std::string msg = fmt::format("malformed reply from store {} to {} of rank {}: {}", where, op,
                                  join.rank, detail);
    {
      std::lock_guard lk(mu);
      broken = true;
      broken_reason = msg;
    }
    throw ProtocolError(msg);
  }
};

bool TcpStore::Impl::try_connect(const std::string& host, int port, Deadline deadline,
                                 std::string& err) {
  sockaddr_in addr{};
  if (!resolve_ipv4(host, port, addr, err)) return false;
  Fd s(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (s.get() < 0) {
    err = "socket(): " + errno_text(errno);
    return false;
  }
  if (connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) {
      err = errno_text(errno);
      return false;
    }
    pollfd p{s.get(), POLLOUT, 0};
    int n = poll(&p, 1, std::min(remaining_ms(deadline), 1000));
    if (n <= 0) {
      err = n == 0 ? "connect timed out" : "poll(): " + errno_text(errno);
      return false;
    }
    int soerr = 0;
    socklen_t len = sizeof(soerr);
    getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr != 0) {
      err = errno_text(soerr);
      return false;
    }
  }
  set_nodelay(s.get());
  fd = std::move(s);
  return true;
}

bool TcpStore::Impl::await_challenge(Deadline deadline) {
  std::vector<pollfd> p;
  while (true) {
    p.clear();
    for (const Fd& w : waiting) p.push_back({w.get(), POLLIN, 0});
    p.push_back({fd.get(), POLLIN, 0});
    int n = poll(p.data(), p.size(), remaining_ms(deadline));
    if (n < 0 && errno != EINTR) return true;  // read_frame() meets and reports the error
    if (n > 0) break;
    if (Clock::now() >= deadline) return false;
  }
  for (size_t i = 0; i < waiting.size(); ++i) {
    if (p[i].revents == 0) continue;
    Fd older = std::move(waiting[i]);
    waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i));
    waiting.push_back(std::move(fd));
    fd = std::move(older);
    break;
  }
  return true;
}

std::string TcpStore::Impl::Attempts::describe() const {
  std::vector<std::string> parts;
  auto add = [&](int n, const char* what) {
    if (n > 0) parts.push_back(fmt::format("{} {}", n, what));
  };
  add(unreachable, "found the store unreachable");
  add(closed_before_challenge, "were closed by the store before its CHALLENGE");
  add(no_challenge, "got no CHALLENGE within the attempt's timeout");
  add(closed_before_reply, "were closed before the JOIN was answered");
  add(no_reply, "got no answer to the JOIN within the attempt's timeout");
  std::string out = fmt::format("{} attempt{}", total, total == 1 ? "" : "s");
  for (size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? ": " : ", ") + parts[i];
  return out;
}

TcpStore::Impl::Attempt TcpStore::Impl::try_join(const std::string& host, int port,
                                                 Deadline deadline, Deadline attempt_deadline,
                                                 Attempts& a) {
  ++a.total;
  fd.reset();
  in.clear();
  std::string err;
  if (!try_connect(host, port, attempt_deadline, err)) {
    ++a.unreachable;
    a.last_error = err;
    return Attempt::kRetry;
  }
  Header h;
  std::string payload;
  if (!await_challenge(attempt_deadline)) {
    ++a.no_challenge;
    a.last_error = "no CHALLENGE";
    waiting.push_back(std::move(fd));  // it keeps its place in the store's queue
    if (waiting.size() > kMaxWaiting) waiting.erase(waiting.begin());
    return Attempt::kRetry;
  }
  ReadResult rr = read_frame(attempt_deadline, h, payload, err);
  if (rr == ReadResult::kMalformed) throw ProtocolError(err);
  if (rr != ReadResult::kFrame) {
    (rr == ReadResult::kTimeout ? a.no_challenge : a.closed_before_challenge) += 1;
    a.last_error = rr == ReadResult::kTimeout ? "no CHALLENGE" : err;
    return Attempt::kRetry;
  }
  PayloadReader pr(payload);
  std::string server_nonce;
  if (h.type != static_cast<uint16_t>(StoreMsg::kChallenge) || h.version != kProtocolVersion ||
      !pr.str(server_nonce) || !pr.at_end() || server_nonce.size() != kNonceBytes)
    throw ProtocolError(fmt::format(
        "malformed reply from store {}: expected a CHALLENGE of protocol version {}, got type "
        "{:#x}, version {}, {} bytes",
        where, kProtocolVersion, h.type, h.version, payload.size()));
  const std::string fields = encode_join_fields(join, random_bytes(kNonceBytes));
  std::string p = fields;
  put_str(p, join_proof(join.secret, server_nonce, fields));
  const uint32_t id = next_id++;
  // The reply is due at once; the whole deadline is left for a server that is slow only.
  const Deadline reply_deadline = std::max(attempt_deadline, std::min(deadline, Clock::now() +
                                                                          milliseconds(500)));
  if (!send_all(encode_frame(StoreMsg::kJoin, id, p), reply_deadline, err)) {
    ++a.closed_before_reply;
    a.last_error = err;
    return Attempt::kRetry;
  }
  rr = read_frame(reply_deadline, h, payload, err);
  if (rr == ReadResult::kMalformed) throw ProtocolError(err);
  if (rr != ReadResult::kFrame) {
    (rr == ReadResult::kTimeout ? a.no_reply : a.closed_before_reply) += 1;
    a.last_error = rr == ReadResult::kTimeout ? "no answer to JOIN" : err;
    return Attempt::kRetry;
  }
  if (h.id != id || h.version != kProtocolVersion)
    throw ProtocolError(fmt::format("malformed reply from store {} to JOIN of rank {}: id {}, "
                                    "version {}",
                                    where, join.rank, h.id, h.version));
  if (h.type == static_cast<uint16_t>(StoreMsg::kError))
    throw ProtocolError(fmt::format(
        "store {} rejected JOIN of rank {} (world size {}, job '{}'): the store's log on rank 0 "
        "says why (a different QRING_JOB_SECRET, job id, world size or protocol version, or "
        "the rank already joined)",
        where, join.rank, join.world_size, join.job_id));
  Reply r;
  r.h = h;
  r.payload = std::move(payload);
  expect_ok<ProtocolError>(r, "JOIN");
  PayloadReader proof_reader(r.payload);
  std::string proof;
  if (!proof_reader.str(proof) || !proof_reader.at_end())
    malformed("JOIN", "bad server proof encoding");
  const std::string expected = server_proof(join.secret, server_nonce, fields);
  if (proof.size() != expected.size() ||
      CRYPTO_memcmp(proof.data(), expected.data(), expected.size()) != 0)
    throw ProtocolError(fmt::format(
        "store {} accepted JOIN of rank {} but cannot prove the job secret: not this job's "
        "store (check QRING_STORE and QRING_JOB_SECRET)",
        where, join.rank));
  return Attempt::kJoined;
}

std::vector<std::string> TcpStore::Impl::missing(const std::vector<std::string>& keys) {
  auto r = request(StoreMsg::kMissing, encode_keys(keys), deadline_in(std::chrono::seconds(5)),
                   "the reply to MISSING");
  expect_ok<UsageError>(r, "MISSING");
  PayloadReader pr(r.payload);
  std::vector<std::string> out;
  if (!pr.keys(out) || !pr.at_end()) malformed("MISSING", "bad key list");
  return out;
}

bool TcpStore::Impl::send_all(const std::string& frame, Deadline deadline, std::string& err) {
  size_t off = 0;
  while (off < frame.size()) {
    ssize_t w = send(fd.get(), frame.data() + off, frame.size() - off, MSG_NOSIGNAL);
    if (w > 0) {
      off += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd.get(), POLLOUT, 0};
      int n = poll(&p, 1, remaining_ms(deadline));
      if (n == 0 && Clock::now() >= deadline) {
        err = fmt::format("timed out sending to store {}", where);
        return false;
      }
      continue;
    }
    err = fmt::format("send to store {} failed: {}", where, errno_text(errno));
    return false;
  }
  return true;
}

TcpStore::Impl::ReadResult TcpStore::Impl::read_frame(Deadline deadline, Header& h,
                                                      std::string& payload, std::string& err) {
  char buf[65536];
  while (true) {
    if (in.size() >= kFrameHeaderBytes) {
      h = decode_header(in.data());
      if (h.magic != kStoreMagic) {
        err = fmt::format("malformed reply from store {}: bad magic {:#010x}", where, h.magic);
        return ReadResult::kMalformed;
      }
      if (h.len > kMaxFrameBytes) {
        err = fmt::format("malformed reply from store {}: frame of {} bytes exceeds the limit",
                          where, h.len);
        return ReadResult::kMalformed;
      }
      if (in.size() >= kFrameHeaderBytes + h.len) {
        payload.assign(in, kFrameHeaderBytes, h.len);
        in.erase(0, kFrameHeaderBytes + h.len);
        return ReadResult::kFrame;
      }
    }
    pollfd p{fd.get(), POLLIN, 0};
    int n = poll(&p, 1, remaining_ms(deadline));
    if (n < 0 && errno != EINTR) {
      err = "poll(): " + errno_text(errno);
      return ReadResult::kError;
    }
    if (n == 0) {
      if (Clock::now() >= deadline) return ReadResult::kTimeout;
      continue;
    }
    ssize_t r = recv(fd.get(), buf, sizeof(buf), 0);
    if (r > 0) {
      in.append(buf, static_cast<size_t>(r));
    } else if (r == 0) {
      err = fmt::format("store {} closed the connection{}", where,
                        in.empty() ? "" : " inside a reply");
      return ReadResult::kError;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      err = fmt::format("recv from store {} failed: {}", where, errno_text(errno));
      return ReadResult::kError;
    }
  }
}

TcpStore::Impl::Reply TcpStore::Impl::request(StoreMsg type, const std::string& payload,
                                              Deadline deadline, const std::string& what) {
  auto start = Clock::now();
  std::unique_lock lk(mu);
  if (broken)
    throw IoError(fmt::format("store client of rank {} is broken: {}", join.rank, broken_reason));
  uint32_t id = next_id++;
  Reply reply;
  pending[id] = &reply;
  struct Unregister {
    Impl& s;
    uint32_t id;
    ~Unregister() { s.pending.erase(id); }  // runs with `mu` held (declared after the lock)
  } unregister{*this, id};

  std::string err;
  if (!send_all(encode_frame(type, id, payload), std::max(deadline, start + kOpTimeout), err)) {
    broken = true;
    broken_reason = err;
    throw IoError(err);
  }
  while (!reply.done) {
    if (broken) throw IoError(broken_reason);
    if (!reading) {
      reading = true;
      lk.unlock();
      Header h;
      std::string body;
      ReadResult rr = read_frame(deadline, h, body, err);
      lk.lock();
      reading = false;
      cv.notify_all();
      if (rr == ReadResult::kFrame) {
        auto it = pending.find(h.id);
        if (it != pending.end()) {  // else: the reply to a request that timed out earlier
          it->second->h = h;
          it->second->payload = std::move(body);
          it->second->done = true;
        }
      } else if (rr != ReadResult::kTimeout) {
        broken = true;
        broken_reason = err;
        if (rr == ReadResult::kMalformed) throw ProtocolError(err);
        throw IoError(err);
      } else {
        break;
      }
    } else if (cv.wait_until(lk, deadline) == std::cv_status::timeout && !reply.done) {
      break;
    }
  }
  if (!reply.done) {
    auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
    throw TimeoutError(fmt::format("store {} (rank {}): timed out after {} ms waiting for {}",
                                   where, join.rank, ms, what));
  }
  return reply;  // expect_ok() checks its type
}

TcpStore::TcpStore(const std::string& host, int port, const JoinInfo& join, Deadline deadline)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.where = fmt::format("{}:{}", host, port);
  s.join = join;
  if (port <= 0 || port > 65535)
    throw ConfigError(fmt::format("store address {}: port out of range", s.where));
  const auto start = Clock::now();
  Impl::Attempts attempts;
  // Per attempt: 500 ms for the CHALLENGE, doubling to 4 s (a loaded server is slow, not
  // gone); a refused connection is retried after 50 ms. The connections of the last attempts
  // that got no CHALLENGE stay open beside the new one (Impl::waiting).
  auto timeout = milliseconds(500);
  while (true) {
    const auto t0 = Clock::now();
    if (s.try_join(host, port, deadline, std::min(deadline, t0 + timeout), attempts) ==
        Impl::Attempt::kJoined) {
      s.waiting.clear();
      if (attempts.total > 1)
        spdlog::info("rank {}: joined store {} after {} ms; {} (last failure: {})", join.rank,
                     s.where,
                     std::chrono::duration_cast<milliseconds>(Clock::now() - start).count(),
                     attempts.describe(), attempts.last_error);
      return;
    }
    s.fd.reset();
    if (Clock::now() - t0 >= timeout) timeout = std::min(2 * timeout, milliseconds(4000));
    if (Clock::now() >= deadline) {
      const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
      const bool silent = attempts.no_challenge == attempts.total;
      throw TimeoutError(fmt::format(
          "rank {}: store {} unreachable: could not join within {} ms; {} (last: {}){}",
          join.rank, s.where, ms, attempts.describe(), attempts.last_error,
          silent ? fmt::format("; it accepts connections but never speaks: not a qring store "
                               "of protocol version {}?",
                               kProtocolVersion)
                 : ""));
    }
    std::this_thread::sleep_for(
        std::min<Clock::duration>(milliseconds(50), deadline - Clock::now()));
  }
}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const std::string& value) {
  std::string p;
  put_str(p, key);
  put_str(p, value);
  auto r = impl_->request(StoreMsg::kSet, p, deadline_in(kOpTimeout),
                          fmt::format("the reply to SET of key '{}'", key));
  impl_->expect_ok<UsageError>(r, "SET");
}

std::string TcpStore::get(const std::string& key, Deadline deadline) {
  std::string p;
  put_str(p, key);
  auto r = impl_->request(StoreMsg::kGet, p, deadline, describe_keys({key}));
  impl_->expect_ok<UsageError>(r, "GET");
  PayloadReader pr(r.payload);
  std::string value;
  if (!pr.str(value) || !pr.at_end()) impl_->malformed("GET", "bad value encoding");
  return value;
}

void TcpStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  auto start = Clock::now();
  Impl::Reply r;
  try {
    r = impl_->request(StoreMsg::kWait, encode_keys(keys), deadline, describe_keys(keys));
  } catch (const TimeoutError&) {
    // Name the keys still missing, not every key waited for.
    auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
    std::string what;
    try {
      auto missing = impl_->missing(keys);
      what = missing.empty() ? fmt::format("{} (all present now)", describe_keys(keys))
                             : fmt::format("{} ({} of {} missing)", describe_keys(missing),
                                           missing.size(), keys.size());
    } catch (const Error& e) {
      what = fmt::format("{} (cannot tell which are missing: {})", describe_keys(keys), e.what());
    }
    throw TimeoutError(fmt::format("store {} (rank {}): timed out after {} ms waiting for {}",
                                   impl_->where, impl_->join.rank, ms, what));
  }
  impl_->expect_ok<UsageError>(r, "WAIT");
  if (!r.payload.empty()) impl_->malformed("WAIT", "unexpected payload");
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  auto r = impl_->request(StoreMsg::kCheck, encode_keys(keys), deadline_in(kOpTimeout),
                          "the reply to CHECK");
  impl_->expect_ok<UsageError>(r, "CHECK");
  PayloadReader pr(r.payload);
  uint32_t v = 0;
  if (!pr.u32(v) || !pr.at_end() || v > 1) impl_->malformed("CHECK", "bad boolean");
  return v == 1;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::string p;
  put_str(p, key);
  put_i64(p, delta);
  auto r = impl_->request(StoreMsg::kAdd, p, deadline_in(kOpTimeout),
                          fmt::format("the reply to ADD of key '{}'", key));
  impl_->expect_ok<UsageError>(r, "ADD");
  PayloadReader pr(r.payload);
  int64_t v = 0;
  if (!pr.i64(v) || !pr.at_end()) impl_->malformed("ADD", "bad integer");
  return v;
}

}  // namespace qring::net
