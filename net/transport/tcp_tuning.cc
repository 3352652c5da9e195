#include "net/transport/tcp_tuning.h"

#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

namespace qring::net {

namespace {

// Family tag + address bytes + port bytes of a sockaddr_in or sockaddr_in6.
template <typename Addr, typename Port>
std::string key_parts(char family, const Addr& addr, const Port& port) {
  std::string k(1, family);
  k.append(reinterpret_cast<const char*>(&addr), sizeof(addr));
  k.append(reinterpret_cast<const char*>(&port), sizeof(port));
  return k;
}

// An IPv4/IPv6 socket address as "4|6" + address bytes + port bytes; empty for anything else.
std::string key_of(const sockaddr* sa, size_t len) {
  if (!sa) return {};
  if (sa->sa_family == AF_INET && len >= sizeof(sockaddr_in)) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    return key_parts('4', in->sin_addr, in->sin_port);
  }
  if (sa->sa_family == AF_INET6 && len >= sizeof(sockaddr_in6)) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    return key_parts('6', in6->sin6_addr, in6->sin6_port);
  }
  return {};
}

struct Registry {
  std::mutex mu;
  std::map<std::string, std::pair<int, std::string>> peers;  // key -> (count, cc)
  std::atomic<int> entries{0};
};

// Never destroyed: the interposers may run while the process exits.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

thread_local const std::string* listen_cc = nullptr;

bool is_inet_stream(int fd) {
  int type = 0, domain = 0;
  socklen_t len = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return false;
  len = sizeof(domain);
  return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 &&
         (domain == AF_INET || domain == AF_INET6);
}

void set_congestion(int fd, const std::string& cc) {
  if (setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc.data(), socklen_t(cc.size())) == 0) {
    spdlog::debug("libfabric tcp socket (fd {}) uses congestion control {}", fd, cc);
    return;
  }
  const int err = errno;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    spdlog::warn(
        "QRING_TCP_CONGESTION: cannot give libfabric's tcp connections the congestion control "
        "'{}': {} (see /proc/sys/net/ipv4/tcp_available_congestion_control and "
        "tcp_allowed_congestion_control); they keep the system's",
        cc, std::strerror(err));
}

void before_connect(int fd, const sockaddr* addr, socklen_t len) {
  Registry& reg = registry();
  if (reg.entries.load(std::memory_order_acquire) == 0) return;
  const std::string peer = key_of(addr, len);
  if (peer.empty()) return;
  std::string cc;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.peers.find(peer);
    if (it == reg.peers.end()) return;
    cc = it->second.second;
  }
  if (!cc.empty() && is_inet_stream(fd)) set_congestion(fd, cc);
}

// The value of QRING_TCP_CONGESTION ("auto" when unset or empty).
std::string tcp_congestion_setting() {
  const char* v = std::getenv("QRING_TCP_CONGESTION");
  if (!v || !*v) return "auto";
  return v;
}

void before_listen(int fd) {
  const std::string* cc = listen_cc;
  if (cc && !cc->empty() && is_inet_stream(fd)) set_congestion(fd, *cc);
}

}  // namespace

std::string tcp_congestion_for(bool single_host) {
  const std::string setting = tcp_congestion_setting();
  if (setting == "system") return {};
  if (setting == "auto") return single_host ? "cubic" : std::string();
  return setting;
}

TcpListenScope::TcpListenScope(std::string cc) : cc_(std::move(cc)), prev_(listen_cc) {
  listen_cc = &cc_;
}

TcpListenScope::~TcpListenScope() {
  listen_cc = prev_;
}

void register_tcp_peer(const void* addr, size_t len, const std::string& cc) {
  const std::string k = key_of(static_cast<const sockaddr*>(addr), len);
  if (k.empty()) return;
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto& e = reg.peers[k];
  ++e.first;
  e.second = cc;
  reg.entries.store(int(reg.peers.size()), std::memory_order_release);
}

void unregister_tcp_peer(const void* addr, size_t len) {
  const std::string k = key_of(static_cast<const sockaddr*>(addr), len);
  if (k.empty()) return;
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.peers.find(k);
  if (it != reg.peers.end() && --it->second.first <= 0) reg.peers.erase(it);
  reg.entries.store(int(reg.peers.size()), std::memory_order_release);
}

}  // namespace qring::net

// Interposed socket calls (see tcp_tuning.h). Each applies the setting, then calls the next
// definition (libc's, or a sanitizer's) and returns its result with its errno.
extern "C" {

int connect(int fd, const struct sockaddr* addr, socklen_t len) {
  using Fn = int (*)(int, const struct sockaddr*, socklen_t);
  static Fn next = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "connect"));
  const int saved = errno;
  qring::net::before_connect(fd, addr, len);
  errno = saved;
  return next(fd, addr, len);
}

int listen(int fd, int backlog) noexcept {
  using Fn = int (*)(int, int);
  static Fn next = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "listen"));
  const int saved = errno;
  qring::net::before_listen(fd);
  errno = saved;
  return next(fd, backlog);
}

}  // extern "C"
