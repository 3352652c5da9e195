// Multi-process test harness: forks N ranks that rendezvous over a loopback TCP store and
// open real libfabric endpoints (shm or tcp). A child reports through its exit status; the
// parent bounds the whole run with a deadline (never past the test's own, deadline_harness.h)
// and kills every child on expiry, saying so.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "deadline_harness.h"
#include "net/rendezvous/bootstrap.h"
#include "net/transport/fabric_endpoint.h"

namespace qring::testing {

inline int free_tcp_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

struct ProcResult {
  std::vector<int> status;  // raw wait status per rank (-1: killed by the harness)
  bool timed_out = false;
  bool exited(int r, int code) const {
    int s = status[size_t(r)];
    return s >= 0 && WIFEXITED(s) && WEXITSTATUS(s) == code;
  }
};

// fn(rank, world, rendezvous) runs in the child; its return value is the exit code, an
// exception prints to stderr and exits 99.
inline ProcResult run_procs(int n, const std::function<int(int, int, net::Rendezvous&)>& fn,
                            std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  int port = free_tcp_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
      int code = 99;
      try {
        net::BootstrapInfo info;
        info.rank = r;
        info.world_size = n;
        info.local_rank = r;
        info.local_size = n;
        info.store_host = "127.0.0.1";
        info.store_port = port;
        info.job_id = "test-" + std::to_string(getppid());
        info.source = "env";
        net::Rendezvous rdv(info, net::deadline_in(std::chrono::seconds(20)));
        code = fn(r, n, rdv);
      } catch (const std::exception& e) {
        fprintf(stderr, "rank %d: %s\n", r, e.what());
        code = 99;
      }
      fflush(stdout);
      fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  ProcResult res;
  res.status.assign(size_t(n), -1);
  const auto deadline = std::min(std::chrono::steady_clock::now() + limit, test_deadline());
  size_t left = pids.size();
  while (left > 0) {
    int st = 0;
    pid_t p = waitpid(-1, &st, WNOHANG);
    if (p > 0) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (pids[i] == p) {
          res.status[i] = st;
          pids[i] = -1;
          --left;
        }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      res.timed_out = true;
      fprintf(stderr, "run_procs: %zu of %d ranks still running at the deadline; killed\n", left, n);
      for (pid_t q : pids)
        if (q > 0) kill(q, SIGKILL);
      for (pid_t q : pids)
        if (q > 0) waitpid(q, &st, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return res;
}

inline std::unique_ptr<net::Endpoint> open_endpoint(net::Rendezvous& rdv, const std::string& prov,
                                                    size_t max_msg = 0, bool always_reg = false) {
  net::FabricOptions o;
  o.provider = prov;
  o.max_message_size = max_msg;
  o.always_register = always_reg;
  return net::make_fabric_endpoint(o, rdv.info().rank, rdv.info().world_size, rdv.store(),
                                   rdv.single_host(), net::deadline_in(std::chrono::seconds(20)));
}

}  // namespace qring::testing
