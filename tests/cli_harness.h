// Runs a shell command under a time limit (SIGKILL on expiry) for tests of the programs as
// users run them (qring-train, qring-bench under qring-launch).
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace qring::testing {

struct CmdResult {
  int status = -1;     // exit status, or 128 + signal
  std::string output;  // stdout and stderr together
};

inline CmdResult sh(const std::string& cmd, int timeout_s = 120) {
  std::string full = "timeout -s KILL " + std::to_string(timeout_s) + " bash -c '" + cmd + "' 2>&1";
  CmdResult r;
  FILE* p = popen(full.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

}  // namespace qring::testing
