// Deadlines for what a test waits on outside its own process: every process a test runs ends
// before ctest's per-test timeout (QRING_TEST_TIMEOUT_S, set by tests/CMakeLists.txt), so
// that a hang shows as the test's own failure with the process's output, not as ctest killing
// a test that printed nothing after "[ RUN ]".
//   test_deadline()     the current test's deadline: its start + ctest's timeout - kMarginS
//   seconds_left()      whole seconds until then (at least 1), for alarm() in a child
//   kill_session(pid)   SIGKILLs a session leader, its session and every descendant
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace qring::testing {

// What is left of ctest's timeout after the deadline: time to kill, collect and report.
constexpr int kMarginS = 20;

inline int ctest_timeout_s() {
  const char* s = std::getenv("QRING_TEST_TIMEOUT_S");
  const int v = s ? std::atoi(s) : 0;
  return v > kMarginS ? v : 120;  // 120: tests/CMakeLists.txt's value, for runs outside ctest
}

// The current test's deadline on the steady clock. ctest runs one test per process, and
// GoogleTest stamps each test's start, so this also holds for a binary run whole (scripts/tsan.sh).
inline std::chrono::steady_clock::time_point test_deadline() {
  using namespace std::chrono;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const auto budget = seconds(ctest_timeout_s() - kMarginS);
  if (!info) return steady_clock::now() + budget;
  const system_clock::time_point started{milliseconds(info->result()->start_timestamp())};
  return steady_clock::now() +
         duration_cast<steady_clock::duration>(started + budget - system_clock::now());
}

inline unsigned seconds_left() {
  using namespace std::chrono;
  const auto left = duration_cast<seconds>(test_deadline() - steady_clock::now()).count();
  return unsigned(std::max<long long>(1, left));
}

// SIGKILLs `leader` (a process that called setsid), every process of its session (a launcher's
// ranks in process groups of their own) and every descendant of those (also one that made a
// session of its own), until none of them is left.
inline void kill_session(pid_t leader) {
  for (int round = 0; round < 10; ++round) {
    std::map<pid_t, std::vector<pid_t>> children;
    std::set<pid_t> doomed;
    if (DIR* d = opendir("/proc")) {
      while (dirent* e = readdir(d)) {
        const pid_t pid = pid_t(std::atoi(e->d_name));
        if (pid <= 0) continue;
        std::ifstream in("/proc/" + std::string(e->d_name) + "/stat");
        std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        const size_t paren = stat.rfind(')');
        if (paren == std::string::npos) continue;
        char state = 0;
        int ppid = 0, pgrp = 0, session = 0;
        if (sscanf(stat.c_str() + paren + 1, " %c %d %d %d", &state, &ppid, &pgrp, &session) != 4)
          continue;
        if (state == 'Z' || pid == getpid()) continue;  // a zombie is dead already
        children[pid_t(ppid)].push_back(pid);
        if (pid == leader || session == leader) doomed.insert(pid);
      }
      closedir(d);
    }
    std::vector<pid_t> todo(doomed.begin(), doomed.end());
    while (!todo.empty()) {
      const pid_t p = todo.back();
      todo.pop_back();
      for (pid_t c : children[p])
        if (doomed.insert(c).second) todo.push_back(c);
    }
    if (doomed.empty()) return;
    for (pid_t p : doomed) kill(p, SIGKILL);
  }
}

}  // namespace qring::testing
