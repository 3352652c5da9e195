// qring-store --world N --job-id ID [--host HOST] [--port PORT] [--port-file FILE]
//
// Serves a job's rendezvous store outside its ranks, until SIGTERM or SIGINT, so that any
// rank -- rank 0 included -- can die and come back while the store lives on (docs/design.md,
// "Rejoin"). The ranks then run with QRING_STORE=HOST:PORT and QRING_STORE_HOSTED=1 (rank 0
// serves nothing). The job secret comes from QRING_JOB_SECRET, as for the ranks; without one
// the store only listens on loopback. scripts/slurm starts it in the batch step when
// QRING_MAX_RESTARTS > 0. qring-launch serves its store itself and needs no qring-store.
//
// HOST is the name or address the ranks connect to (default: this host's name); the store
// binds the address it resolves to (net/bootstrap.h, store_bind_address). PORT 0 (default)
// picks a free one; --port-file writes the port chosen, for scripts. Exit status: 0 after a
// signal, 1 when the store cannot be served, 2 on a usage error.
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "net/bootstrap.h"
#include "net/error.h"
#include "net/store.h"

namespace {

constexpr const char* kUsage =
    "usage: qring-store --world N --job-id ID [--host HOST] [--port PORT] [--port-file FILE]\n"
    "  --world N        ranks of the job\n"
    "  --job-id ID      the job id every rank has (QRING_JOB_ID)\n"
    "  --host HOST      name or address the ranks connect to (default: this host's name)\n"
    "  --port PORT      port to listen on (default 0: a free one)\n"
    "  --port-file FILE write the port to FILE once the store listens\n"
    "The job secret is QRING_JOB_SECRET (required unless HOST is a loopback address).\n";

[[noreturn]] void usage_error(const std::string& msg) {
  fmt::print(stderr, "qring-store: {}\n{}", msg, kUsage);
  std::exit(2);
}

int parse_int(const std::string& opt, const std::string& v, int lo, int hi) {
  int x = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size() || x < lo || x > hi)
    usage_error(fmt::format("{} expects an integer in [{}, {}], got '{}'", opt, lo, hi, v));
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  int world = 0, port = 0;
  std::string job_id, host, port_file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      fmt::print("{}", kUsage);
      return 0;
    }
    if (i + 1 >= argc) usage_error(fmt::format("{} needs a value", a));
    const std::string v = argv[++i];
    if (a == "--world") {
      world = parse_int(a, v, 1, 1 << 20);
    } else if (a == "--job-id") {
      job_id = v;
    } else if (a == "--host") {
      host = v;
    } else if (a == "--port") {
      port = parse_int(a, v, 0, 65535);
    } else if (a == "--port-file") {
      port_file = v;
    } else {
      usage_error(fmt::format("unknown option '{}'", a));
    }
  }
  if (world == 0) usage_error("--world N is required");
  if (job_id.empty()) usage_error("--job-id ID is required");
  if (host.empty()) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  const char* secret = std::getenv("QRING_JOB_SECRET");
  // Block the signals before the server's thread starts, so that sigwait gets them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  spdlog::set_pattern("qring-store: %v");
  try {
    const std::string bind = qring::net::store_bind_address(host);
    qring::net::StoreServerOptions o;
    o.secret = secret ? secret : "";
    qring::net::TcpStoreServer server(bind, port, world, job_id, o);
    fmt::print("qring-store: serving job '{}' for {} ranks on {}:{} (ranks connect to {}:{})\n",
               job_id, world, bind, server.port(), host, server.port());
    std::fflush(stdout);
    if (!port_file.empty()) {
      const std::string tmp = port_file + ".tmp";
      std::ofstream(tmp) << server.port() << '\n';
      if (std::rename(tmp.c_str(), port_file.c_str()) != 0)
        throw qring::IoError(fmt::format("cannot write {}", port_file));
    }
    int sig = 0;
    sigwait(&set, &sig);
    fmt::print("qring-store: {} received; stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  } catch (const std::exception& e) {
    fmt::print(stderr, "qring-store: {}\n", e.what());
    return 1;
  }
  return 0;
}
