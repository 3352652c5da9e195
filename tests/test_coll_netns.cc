// One rank of a job across emulated hosts (scripts/netns-cluster.sh): tests/netns/run.sh starts
// this test once per rank inside the hosts' namespaces, with the QRING_* bootstrap variables
// and QRING_NETNS_ADDR = the address of the rank's host. Anywhere else it is skipped.
//
// Checks what only runs across hosts: the rendezvous sees several host names, rank 0's store
// listens on the address the ranks use (not 0.0.0.0), "auto" picks tcp, the endpoint publishes
// its host's own interface address (not loopback), and collectives across the hosts give
// bit-exact results (recursive doubling, halving-doubling, ring, broadcast, allgather).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "coll_harness.h"
#include "net/rendezvous/bootstrap.h"
#include "net/transport/fabric_endpoint.h"

namespace qring::testing {
namespace {

// The local address of the listening TCP socket on `port` in this network namespace, or "".
std::string listening_address(int port) {
  std::ifstream f("/proc/net/tcp");
  std::string line;
  std::getline(f, line);  // header
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string sl, local, remote, state;
    in >> sl >> local >> remote >> state;
    if (state != "0A") continue;  // LISTEN
    const size_t colon = local.find(':');
    if (colon == std::string::npos) continue;
    if (std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
    in_addr a{};
    a.s_addr = uint32_t(std::stoul(local.substr(0, colon), nullptr, 16));
    char buf[INET_ADDRSTRLEN];
    return inet_ntop(AF_INET, &a, buf, sizeof(buf));
  }
  return "";
}

TEST(NetnsHosts, RanksOnTwoHostsChooseTcpBindTheirInterfaceAndReduceExactly) {
  const char* host_addr = std::getenv("QRING_NETNS_ADDR");
  if (!host_addr) GTEST_SKIP() << "run by tests/netns/run.sh inside emulated hosts";
  const net::BootstrapInfo info = net::detect_bootstrap();
  const auto setup = std::chrono::seconds(30);
  net::Rendezvous rdv(info, net::deadline_in(setup));
  EXPECT_FALSE(rdv.single_host());
  const auto names = rdv.hostnames();
  EXPECT_GE(std::set<std::string>(names.begin(), names.end()).size(), 2u);
  if (info.rank == 0) {
    EXPECT_EQ(listening_address(info.store_port), info.store_host)
        << "the store listens on another address than the one the ranks use";
  }
  net::FabricOptions fo;  // provider "auto"
  auto ep = net::make_fabric_endpoint(fo, info.rank, info.world_size, rdv.store(),
                                      rdv.single_host(), net::deadline_in(setup));
  EXPECT_EQ(ep->provider(), "tcp;ofi_rxm");
  // The address this rank published: its host's interface, where the other hosts reach it.
  const std::string v =
      rdv.store().get("fabric/addr/" + std::to_string(info.rank), net::deadline_in(setup));
  const std::string addr = v.substr(v.find('\n') + 1);
  ASSERT_EQ(addr.size(), sizeof(sockaddr_in));
  sockaddr_in sin{};
  std::memcpy(&sin, addr.data(), sizeof(sin));
  char buf[INET_ADDRSTRLEN];
  EXPECT_STREQ(inet_ntop(AF_INET, &sin.sin_addr, buf, sizeof(buf)), host_addr);

  CommOptions co;
  co.local_size = info.local_size;
  co.timeout = std::chrono::seconds(30);
  Communicator comm(std::move(ep), co);
  const int n = comm.size(), r = comm.rank();
  size_t wrong = 0;
  for (size_t count : {size_t(1000), size_t(100003), size_t(600000)}) {  // RD, HD, ring
    std::vector<float> b(count);
    for (size_t j = 0; j < count; ++j) put(b.data(), j, DataType::kFloat32, pattern(j, r));
    comm.allreduce(b.data(), b.data(), count, DataType::kFloat32, RedOp::kSum);
    wrong += count_wrong(b.data(), count, DataType::kFloat32, RedOp::kSum, n);
  }
  std::vector<float> g(5000);
  for (size_t j = 0; j < g.size(); ++j) g[j] = float(pattern(j, r));
  comm.broadcast(g.data(), g.size(), DataType::kFloat32, n - 1);
  for (size_t j = 0; j < g.size(); ++j) wrong += g[j] != float(pattern(j, n - 1));
  std::vector<float> mine(777, float(r)), all(777 * size_t(n));
  comm.allgather(mine.data(), all.data(), mine.size(), DataType::kFloat32);
  for (size_t j = 0; j < all.size(); ++j) wrong += all[j] != float(j / 777);
  comm.barrier();
  EXPECT_EQ(wrong, 0u);
}

}  // namespace
}  // namespace qring::testing
