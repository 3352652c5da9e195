// Congestion control of the TCP connections that libfabric's tcp provider opens for qring.
//
// On a host whose default congestion control is bbr, TCP paces every connection itself:
// without an fq qdisc the kernel arms a high-resolution timer per burst and sends the rest of
// a burst from that timer. Between the ranks of one host there is no bottleneck queue for
// pacing to protect, and qring's all-reduce, which hands the kernel whole segments (1-2 MiB)
// at once, runs slower paced (measurements: docs/benchmarks.md, "The numbers behind the defaults").
// QRING_TCP_CONGESTION chooses for qring's connections:
//   auto (default)  cubic when every rank is on this host (the connections are loopback),
//                   else the system's default
//   system          the system's default (net.ipv4.tcp_congestion_control)
//   <name>          <name> (reno, cubic, dctcp, bbr, ...: one listed in
//                   /proc/sys/net/ipv4/tcp_available_congestion_control and, for users
//                   without CAP_NET_ADMIN, in tcp_allowed_congestion_control)
// It has to be set before a connection starts: a connection that began with bbr keeps being
// paced after a switch. The tcp provider owns its sockets, so this library interposes
// listen() and connect(): a socket that starts listening while a FabricEndpoint sets itself
// up on this thread (TcpListenScope), or connects to a registered peer endpoint address,
// gets the setting first; accepted connections inherit it from their listener. Every other
// socket of the process is left alone. The interposed symbols are process-wide (linking
// qring_net is enough): fabric_endpoint.h lists them with qring's other effects on the
// process.
#pragma once

#include <cstddef>
#include <string>

namespace qring::net {

// What QRING_TCP_CONGESTION gives the connections of an endpoint (empty: the system's default).
std::string tcp_congestion_for(bool single_host);

// While alive, a socket this thread puts into the listening state gets congestion control
// `cc` (nothing when empty).
class TcpListenScope {
 public:
  explicit TcpListenScope(std::string cc);
  ~TcpListenScope();
  TcpListenScope(const TcpListenScope&) = delete;
  TcpListenScope& operator=(const TcpListenScope&) = delete;

 private:
  std::string cc_;
  const std::string* prev_;
};

// A peer endpoint's fabric address (the raw sockaddr bytes fi_getname returns): connections
// to it get congestion control `cc` (nothing when empty). Addresses that are not IPv4/IPv6
// socket addresses are ignored. Registrations are counted; each is matched by an
// unregistration.
void register_tcp_peer(const void* addr, size_t len, const std::string& cc);
void unregister_tcp_peer(const void* addr, size_t len);

}  // namespace qring::net
