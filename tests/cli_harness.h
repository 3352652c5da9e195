// Runs a shell command under a deadline for tests of the programs as users run them
// (qring-train, qring-bench under qring-launch). The command runs in a session of its own; at
// the deadline the whole session is SIGKILLed (a launcher's ranks too, which live in process
// groups of their own and would otherwise keep the output pipe open), and the command and its
// output so far are printed at once, so that a hang is a clear failure well before ctest's
// timeout (tests/deadline_harness.h).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <string>

#include "deadline_harness.h"

namespace qring::testing {

struct CmdResult {
  int status = -1;         // exit status, or 128 + signal (137 when killed at the deadline)
  std::string output;      // stdout and stderr together
  bool timed_out = false;  // killed at the deadline
};

namespace detail {

// Reads `fd` into `out` until end of file or `until`; returns whether it reached end of file.
inline bool read_until(int fd, std::string& out, std::chrono::steady_clock::time_point until) {
  std::array<char, 4096> buf;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          until - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, int(std::min<long long>(left, 1000))) <= 0) continue;
    const ssize_t n = read(fd, buf.data(), buf.size());
    if (n == 0) return true;
    if (n > 0) out.append(buf.data(), size_t(n));
  }
}

}  // namespace detail

// Runs `bash -c cmd` with stdout and stderr captured, for at most `timeout_s` seconds and never
// past the current test's deadline (by default only that: a long run under a loaded ctest -j2
// is not a hang, and a hang still ends 20 s before ctest's timeout, its output printed).
inline CmdResult sh(const std::string& cmd, int timeout_s = 24 * 3600) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = std::min(start + std::chrono::seconds(timeout_s), test_deadline());
  CmdResult r;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return r;
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return r;
  }
  if (pid == 0) {
    setsid();
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    execl("/bin/bash", "bash", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  bool eof = detail::read_until(fds[0], r.output, deadline);
  int st = 0;
  while (eof && waitpid(pid, &st, WNOHANG) == 0) {
    if (Clock::now() >= deadline) {
      eof = false;
      break;
    }
    usleep(2000);
  }
  if (!eof) {  // the deadline: kill everything the command started, keep what it printed
    kill_session(pid);
    detail::read_until(fds[0], r.output, Clock::now() + std::chrono::seconds(2));
    waitpid(pid, &st, 0);
    r.timed_out = true;
    const double secs = std::chrono::duration<double>(Clock::now() - start).count();
    r.output += "\n[qring::testing::sh: killed after " + std::to_string(int(secs)) +
                " s, at the deadline]\n";
    fprintf(stderr, "qring::testing::sh: killed after %.1f s (limit %d s, the test's deadline %d s "
            "after its start): %s\n---- its output ----\n%s---- end of its output ----\n",
            secs, timeout_s, ctest_timeout_s() - kMarginS, cmd.c_str(), r.output.c_str());
  }
  close(fds[0]);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

}  // namespace qring::testing
