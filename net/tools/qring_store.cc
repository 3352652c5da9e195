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
// binds the address it resolves to (net/rendezvous/bootstrap.h, store_bind_address). PORT 0 (default)
// picks a free one; --port-file writes the port chosen, for scripts. Exit status: 0 after a
// signal, 1 when the store cannot be served, 2 on a usage error.
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "net/rendezvous/bootstrap.h"
#include "net/base/cli.h"
#include "net/base/error.h"
#include "net/rendezvous/store.h"

int main(int argc, char** argv) {
  using qring::cli::to_int;
  int world = 0, port = 0;
  std::string job_id, host, port_file;
  CLI::App app{
      "Serves a job's rendezvous store outside its ranks, until SIGTERM or SIGINT. The job "
      "secret is QRING_JOB_SECRET (required unless HOST is a loopback address).",
      "qring-store"};
  qring::cli::init(app);
  qring::cli::add_value(app, "--world", "ranks of the job (required)")
      ->each([&](const std::string& v) { world = int(to_int("--world", v, 1, 1 << 20)); });
  app.add_option("--job-id", job_id, "the job id every rank has (QRING_JOB_ID; required)");
  app.add_option("--host", host,
                 "name or address the ranks connect to (default: this host's name)");
  qring::cli::add_value(app, "--port", "port to listen on (default 0: a free one)")
      ->each([&](const std::string& v) { port = int(to_int("--port", v, 0, 65535)); });
  app.add_option("--port-file", port_file, "write the port to FILE once the store listens");
  if (int rc = qring::cli::parse(app, qring::cli::args_of(argc, argv)); rc >= 0) return rc;
  const char* missing = world == 0 ? "--world N" : job_id.empty() ? "--job-id ID" : nullptr;
  if (missing) {
    fmt::print(stderr, "qring-store: {} is required (see --help)\n", missing);
    return 2;
  }
  if (host.empty()) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  const char* secret = std::getenv("QRING_JOB_SECRET");
  if (secret != nullptr) {
    if (const std::string weak = qring::net::secret_weakness(secret); !weak.empty()) {
      fmt::print(stderr,
                 "qring-store: QRING_JOB_SECRET {}: whoever guesses it can join the job; use a "
                 "random one, e.g. $(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')\n",
                 weak);
      return 2;
    }
  }
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
    // A rank's connection closing is its death, witnessed (the job goes on without a majority
    // where max(quorum, min_world) ranks are left: docs/design.md, "Witnessed deaths").
    o.witness_deaths = true;
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
