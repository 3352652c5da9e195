// qring-launch end to end: runs the built binary with small shell commands as ranks.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli_harness.h"
#include "net/rendezvous/bootstrap.h"
#include "net/transport/fabric_endpoint.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using ::testing::HasSubstr;
using ::testing::Not;

const char* kLauncher = QRING_BUILD_DIR "/net/qring-launch";

// One run of qring-launch with its stdout and stderr captured.
class LaunchRun {
 public:
  explicit LaunchRun(const std::vector<std::string>& args, const char* env_var = nullptr) {
    EXPECT_EQ(access(kLauncher, X_OK), 0) << kLauncher << " is missing: build target qring-launch";
    int out[2], err[2];
    EXPECT_EQ(pipe2(out, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(err, O_CLOEXEC), 0);
    start_ = Clock::now();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      dup2(err[1], 2);
      if (env_var) putenv(const_cast<char*>(env_var));
      std::vector<char*> argv{const_cast<char*>(kLauncher)};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(kLauncher, argv.data());
      _exit(126);
    }
    close(out[1]);
    close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
  }
  ~LaunchRun() {
    if (pid_ > 0 && !finished_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) close(out_fd_);
    if (err_fd_ >= 0) close(err_fd_);
  }
  pid_t pid() const { return pid_; }

  // Reads output until `done(out, err)` holds or `limit` passes; returns whether it held.
  bool read_until(const std::function<bool()>& done, std::chrono::milliseconds limit) {
    auto deadline = Clock::now() + limit;
    while (!done()) {
      if (Clock::now() >= deadline || (out_fd_ < 0 && err_fd_ < 0)) return done();
      pollfd p[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
      poll(p, 2, 50);
      for (int i = 0; i < 2; ++i) {
        int& fd = i == 0 ? out_fd_ : err_fd_;
        if (fd < 0 || !(p[i].revents & (POLLIN | POLLHUP))) continue;
        char buf[4096];
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n <= 0) {
          close(fd);
          fd = -1;
        } else {
          (i == 0 ? out : err).append(buf, n);
        }
      }
    }
    return true;
  }
  // Waits for the launcher to exit (killing it after `limit`); returns its exit code, or
  // 128 + signal.
  int finish(std::chrono::milliseconds limit = 10s) {
    read_until([&] { return out_fd_ < 0 && err_fd_ < 0; }, limit);
    auto deadline = Clock::now() + 2s;
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (Clock::now() >= deadline) {
        ADD_FAILURE() << "qring-launch did not exit; killing it";
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    finished_ = true;
    elapsed = Clock::now() - start_;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  std::string out, err;
  Clock::duration elapsed{};

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  bool finished_ = false;
  Clock::time_point start_;
};

// A process is gone when it does not exist or is a zombie awaiting its reaper.
bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return true;
  std::string s;
  try {
    std::ifstream stat(fmt::format("/proc/{}/stat", pid));
    s.assign(std::istreambuf_iterator<char>(stat), {});
  } catch (const std::ios_base::failure&) {
    return true;  // it was reaped between kill() and the read (ESRCH)
  }
  auto p = s.rfind(')');
  return p != std::string::npos && p + 2 < s.size() && s[p + 2] == 'Z';
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "qring-launch-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::vector<pid_t> pids(int n) const {
    std::vector<pid_t> out;
    for (int r = 0; r < n; ++r) {
      std::ifstream f(fmt::format("{}/{}.pid", path, r));
      pid_t p = 0;
      if (f >> p) out.push_back(p);
    }
    return out;
  }
  std::string path;
};

// Reads the launcher's output until ranks 0 and 1 have both printed "ready" (at most 5 s).
bool both_ranks_ready(LaunchRun& run) {
  return run.read_until(
      [&] {
        return run.out.find("[rank 0] ready") != std::string::npos &&
               run.out.find("[rank 1] ready") != std::string::npos;
      },
      5s);
}

TEST(Launch, FailingRankStopsTheOthers) {
  LaunchRun run({"-n", "3", "--", "sh", "-c", "if [ $QRING_RANK = 1 ]; then exit 3; fi; sleep 30"});
  int code = run.finish();
  EXPECT_EQ(code, 3);
  EXPECT_LT(run.elapsed, 5s);
  EXPECT_THAT(run.err, HasSubstr("qring-launch: rank 1 exited with status 3"));
  EXPECT_THAT(run.err, Not(HasSubstr("ranks lost")));  // no --tolerate-failures: fail-fast

  // An explicit --tolerate-failures 0 is the same fail-fast; 75 (evicted) is just a failure.
  LaunchRun zero({"-n", "3", "--tolerate-failures", "0", "--", "sh", "-c",
                  "if [ $QRING_RANK = 1 ]; then exit 75; fi; sleep 30"});
  EXPECT_EQ(zero.finish(), 75);
  EXPECT_LT(zero.elapsed, 5s);
  EXPECT_THAT(zero.err, HasSubstr("qring-launch: rank 1 exited with status 75; stopping"));
}

TEST(Launch, NoRankOrGrandchildSurvives) {
  TempDir dir;
  // Every rank starts a background `sleep 30` (a grandchild of the launcher) and records its
  // pid; rank 1 fails once all three pids are written.
  std::string script = fmt::format(
      "sleep 30 & echo $! > {0}/$QRING_RANK.pid; "
      "if [ $QRING_RANK = 1 ]; then "
      "  while [ $(ls {0} | wc -l) -lt 3 ]; do sleep 0.02; done; sleep 0.1; exit 3; "
      "fi; wait",
      dir.path);
  LaunchRun run({"-n", "3", "--timeout-s", "20", "--", "sh", "-c", script});
  EXPECT_EQ(run.finish(), 3);
  EXPECT_LT(run.elapsed, 5s);
  auto pids = dir.pids(3);
  ASSERT_EQ(pids.size(), 3u);
  for (pid_t p : pids) EXPECT_TRUE(process_gone(p)) << "sleep 30 with pid " << p << " survived";
}

TEST(Launch, KilledLauncherTakesItsRanksAlong) {
  TempDir dir;
  std::string script = fmt::format("echo $$ > {}/$QRING_RANK.pid; exec sleep 30", dir.path);
  LaunchRun run({"-n", "2", "--", "sh", "-c", script});
  auto deadline = Clock::now() + 5s;
  while (dir.pids(2).size() < 2 && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  auto pids = dir.pids(2);
  ASSERT_EQ(pids.size(), 2u);
  std::this_thread::sleep_for(100ms);  // let the ranks reach exec
  kill(run.pid(), SIGKILL);
  EXPECT_EQ(run.finish(), 128 + SIGKILL);
  deadline = Clock::now() + 3s;
  for (pid_t p : pids) {
    while (!process_gone(p) && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
    EXPECT_TRUE(process_gone(p)) << "rank process " << p << " survived its launcher";
  }
}

// A rank that is a wrapper (a shell running its program as a child, not exec'ing it): when
// the launcher is SIGKILLed, the parent-death signal reaches only a direct child, so the
// wrapper's children must be killed by the rank's supervisor, which outlives the launcher.
TEST(Launch, KilledLauncherTakesWrappedRanksChildrenAlong) {
  TempDir dir;
  std::string script = fmt::format(
      "sleep 30 >/dev/null 2>&1 & echo $! > {}/$QRING_RANK.pid.tmp; "
      "mv {}/$QRING_RANK.pid.tmp {}/$QRING_RANK.pid; wait",
      dir.path, dir.path, dir.path);
  LaunchRun run({"-n", "2", "--", "sh", "-c", script});
  auto deadline = Clock::now() + 5s;
  while (dir.pids(2).size() < 2 && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  auto pids = dir.pids(2);
  ASSERT_EQ(pids.size(), 2u);
  kill(run.pid(), SIGKILL);
  EXPECT_EQ(run.finish(), 128 + SIGKILL);
  deadline = Clock::now() + 3s;
  for (pid_t p : pids) {
    while (!process_gone(p) && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
    EXPECT_TRUE(process_gone(p)) << "sleep 30 with pid " << p << " survived the launcher";
    if (!process_gone(p)) kill(p, SIGKILL);  // do not leave it behind
  }
}

TEST(Launch, OutputIsPrefixedLineByLine) {
  LaunchRun run({"-n", "2", "--", "sh", "-c",
                 "echo out-$QRING_RANK; echo err-$QRING_RANK >&2; seq 1 300; "
                 "printf tail-$QRING_RANK"});
  EXPECT_EQ(run.finish(), 0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(run.out, HasSubstr(fmt::format("[rank {}] out-{}\n", r, r)));
    EXPECT_THAT(run.err, HasSubstr(fmt::format("[rank {}] err-{}\n", r, r)));
    EXPECT_THAT(run.out, HasSubstr(fmt::format("[rank {}] tail-{}\n", r, r)));  // partial line
  }
  EXPECT_THAT(run.out, Not(HasSubstr("err-")));
  EXPECT_THAT(run.err, Not(HasSubstr("out-")));
  // Every stdout line carries exactly one prefix; each rank's 300 numbers arrive in order.
  std::istringstream lines(run.out);
  std::regex line_re(R"(\[rank ([01])\] (out-[01]|tail-[01]|(\d+)))");
  std::string line;
  int next[2] = {1, 1};
  int count = 0;
  while (std::getline(lines, line)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, line_re)) << "bad line: " << line;
    if (m[3].matched) {
      int r = std::stoi(m[1]);
      EXPECT_EQ(std::stoi(m[3]), next[r]++);
    }
    ++count;
  }
  EXPECT_EQ(count, 2 * 302);
  EXPECT_EQ(next[0], 301);
  EXPECT_EQ(next[1], 301);
}

TEST(Launch, SetsTheBootstrapEnvironment) {
  LaunchRun run({"-n", "3", "--provider", "tcp", "--port", "23456", "--", "sh", "-c",
                 "echo \"$QRING_RANK $QRING_WORLD_SIZE $QRING_LOCAL_RANK $QRING_LOCAL_SIZE "
                 "$QRING_STORE $QRING_JOB_ID $QRING_PROVIDER $QRING_TOLERATE_FAILURES\""},
                "QRING_TOLERATE_FAILURES=9");  // not inherited: the launcher sets its own
  EXPECT_EQ(run.finish(), 0);
  // The job id: launch-<launcher pid>-<random hex>, the same for every rank.
  std::smatch id;
  ASSERT_TRUE(
      std::regex_search(run.out, id, std::regex(fmt::format("launch-{}-[0-9a-f]+ ", run.pid()))))
      << run.out;
  for (int r = 0; r < 3; ++r)
    EXPECT_THAT(run.out, HasSubstr(fmt::format("[rank {}] {} 3 {} 3 127.0.0.1:23456 {}tcp 0\n", r,
                                               r, r, id.str())));

  // Without --port a free port is chosen, the same for every rank; no provider is set.
  LaunchRun run2({"-n", "2", "--", "sh", "-c", "echo \"store=$QRING_STORE p=$QRING_PROVIDER\""});
  EXPECT_EQ(run2.finish(), 0);
  std::smatch m;
  std::regex re(R"(\[rank 0\] store=127\.0\.0\.1:(\d+) p=\n)");
  ASSERT_TRUE(std::regex_search(run2.out, m, re)) << run2.out;
  int port = std::stoi(m[1]);
  EXPECT_GT(port, 0);
  EXPECT_THAT(run2.out, HasSubstr(fmt::format("[rank 1] store=127.0.0.1:{} p=\n", port)));
}

TEST(Launch, ForwardsSigterm) {
  LaunchRun run({"-n", "2", "--", "sh", "-c",
                 "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.05; done"});
  ASSERT_TRUE(both_ranks_ready(run)) << run.out << run.err;
  kill(run.pid(), SIGTERM);
  EXPECT_EQ(run.finish(), 128 + SIGTERM);
  EXPECT_LT(run.elapsed, 5s);
  EXPECT_THAT(run.out, HasSubstr("[rank 0] got-term"));
  EXPECT_THAT(run.out, HasSubstr("[rank 1] got-term"));
  EXPECT_THAT(run.err, HasSubstr("received SIGTERM"));
}

// Preemption: a forwarded SIGTERM that every rank answers by checkpointing and exiting 76
// (qring-train) ends the launcher with 76 too, so that a batch script knows to requeue.
TEST(Launch, RanksThatStopAfterCheckpointingOnSigtermMakeItExit76) {
  LaunchRun run({"-n", "2", "--", "sh", "-c",
                 "trap 'sleep 0.2; exit 76' TERM; echo ready; while :; do sleep 0.05; done"});
  ASSERT_TRUE(both_ranks_ready(run)) << run.out << run.err;
  kill(run.pid(), SIGTERM);
  EXPECT_EQ(run.finish(), 76) << run.err;
  EXPECT_THAT(run.err, HasSubstr("the ranks stopped after checkpointing (exit status 76)"));
}

// SIGUSR1 (Slurm's --signal ahead of a time limit) is forwarded like SIGTERM, and the ranks
// get --stop-grace-s to end before SIGKILL.
TEST(Launch, ForwardsSigusr1AndGivesTheRanksTheirGrace) {
  LaunchRun run({"-n", "2", "--stop-grace-s", "5", "--", "sh", "-c",
                 "trap 'sleep 1; echo saved; exit 76' USR1; echo ready; "
                 "while :; do sleep 0.05; done"});
  ASSERT_TRUE(both_ranks_ready(run)) << run.out << run.err;
  kill(run.pid(), SIGUSR1);
  EXPECT_EQ(run.finish(), 76) << run.err;
  EXPECT_THAT(run.err, HasSubstr("received SIGUSR1; forwarding it to all ranks"));
  EXPECT_THAT(run.out, HasSubstr("[rank 0] saved"));
  EXPECT_THAT(run.out, HasSubstr("[rank 1] saved"));
  EXPECT_THAT(run.err, Not(HasSubstr("SIGKILL")));
}

// --prefix others: rank 0's lines pass through as they are, the others keep "[rank R] ".
TEST(Launch, PrefixOthersLeavesRankZerosLinesBare) {
  LaunchRun run({"-n", "2", "--prefix", "others", "--", "sh", "-c", "echo line-$QRING_RANK"});
  EXPECT_EQ(run.finish(), 0) << run.err;
  EXPECT_THAT(run.out, HasSubstr("line-0\n"));
  EXPECT_THAT(run.out, Not(HasSubstr("[rank 0]")));
  EXPECT_THAT(run.out, HasSubstr("[rank 1] line-1\n"));
  LaunchRun none({"-n", "2", "--prefix", "none", "--", "sh", "-c", "echo line-$QRING_RANK"});
  EXPECT_EQ(none.finish(), 0) << none.err;
  EXPECT_THAT(none.out, Not(HasSubstr("[rank ")));
  LaunchRun bad({"-n", "2", "--prefix", "some", "--", "true"});
  EXPECT_EQ(bad.finish(), 2);
  EXPECT_THAT(bad.err, HasSubstr("--prefix expects 'all', 'others' or 'none', got 'some'"));
}

// Across hosts (torchrun's shape): two launchers, here both on loopback, form one job of
// 2 x 2 ranks: global ranks, the world, local ranks, node 0's store for everyone.
TEST(Launch, TwoLaunchersFormOneJob) {
  const int port = 20000 + int(getpid() % 20000);
  const std::string master = fmt::format("127.0.0.1:{}", port);
  const std::vector<std::string> cmd{
      "--", "sh", "-c",
      "echo rank=$QRING_RANK world=$QRING_WORLD_SIZE local=$QRING_LOCAL_RANK/$QRING_LOCAL_SIZE "
      "node=$QRING_NODE_RANK/$QRING_NNODES store=$QRING_STORE hosted=$QRING_STORE_HOSTED"};
  auto args = [&](int node) {
    std::vector<std::string> a{"--nnodes", "2", "--node-rank", std::to_string(node), "--master",
                               master, "-n", "2"};
    a.insert(a.end(), cmd.begin(), cmd.end());
    return a;
  };
  LaunchRun n0(args(0));
  LaunchRun n1(args(1));
  EXPECT_EQ(n0.finish(), 0) << n0.err;
  EXPECT_EQ(n1.finish(), 0) << n1.err;
  for (int r = 0; r < 4; ++r) {
    const LaunchRun& n = r < 2 ? n0 : n1;
    EXPECT_THAT(n.out, HasSubstr(fmt::format("[rank {}] rank={} world=4 local={}/2 node={}/2 "
                                             "store={} hosted=1\n",
                                             r, r, r % 2, r / 2, master)))
        << n.out;
  }
}

TEST(Launch, AcrossHostsUsageErrors) {
  LaunchRun no_master({"--nnodes", "2", "-n", "1", "--", "true"});
  EXPECT_EQ(no_master.finish(), 2);
  EXPECT_THAT(no_master.err, HasSubstr("--nnodes 2 needs --master HOST:PORT"));
  LaunchRun no_secret(
      {"--nnodes", "2", "--node-rank", "1", "--master", "10.213.9.9:29500", "-n", "1", "--",
       "true"},
      "QRING_JOB_SECRET=");
  EXPECT_EQ(no_secret.finish(), 2);
  EXPECT_THAT(no_secret.err, HasSubstr("needs the job secret: export QRING_JOB_SECRET"));
  LaunchRun bad_rank({"--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500", "-n",
                      "1", "--", "true"});
  EXPECT_EQ(bad_rank.finish(), 2);
  EXPECT_THAT(bad_rank.err, HasSubstr("--node-rank 2 is not below --nnodes 2"));
  LaunchRun bad_master({"--nnodes", "2", "--master", "nohostport", "-n", "1", "--", "true"});
  EXPECT_EQ(bad_master.finish(), 2);
  EXPECT_THAT(bad_master.err, HasSubstr("--master expects HOST:PORT, got 'nohostport'"));
}

TEST(Launch, RankKilledBySignal) {
  LaunchRun run(
      {"-n", "2", "--", "sh", "-c", "if [ $QRING_RANK = 0 ]; then kill -KILL $$; fi; sleep 30"});
  EXPECT_EQ(run.finish(), 128 + SIGKILL);
  EXPECT_LT(run.elapsed, 5s);
  EXPECT_THAT(run.err, HasSubstr("rank 0 killed by signal SIGKILL"));
}

TEST(Launch, SigtermIgnoringRankIsKilledAfterGrace) {
  LaunchRun run({"-n", "2", "--", "sh", "-c",
                 "if [ $QRING_RANK = 0 ]; then sleep 0.3; exit 1; fi; trap '' TERM; "
                 "while :; do sleep 0.05; done"});
  EXPECT_EQ(run.finish(), 1);
  EXPECT_GE(run.elapsed, 3s);  // SIGTERM was ignored: SIGKILL after the 3 s grace
  EXPECT_LT(run.elapsed, 7s);
  EXPECT_THAT(run.err, HasSubstr("sending SIGKILL"));
}

// --tolerate-failures K: a rank killed by a signal is reported at once, the others run to
// the end, and the launcher exits 100 + lost ranks ("degraded success").
TEST(Launch, ToleratesALostRank) {
  LaunchRun run({"-n", "4", "--tolerate-failures", "1", "--", "sh", "-c",
                 "if [ $QRING_RANK = 2 ]; then kill -9 $$; fi; sleep 0.5; "
                 "echo finished-$QRING_RANK tolerate=$QRING_TOLERATE_FAILURES"});
  EXPECT_EQ(run.finish(), 101) << run.out << run.err;
  EXPECT_LT(run.elapsed, 5s);
  EXPECT_THAT(run.err,
              testing::ContainsRegex("qring-launch: rank 2 \\(pid [0-9]+\\) was killed by signal 9 "
                                     "\\(SIGKILL\\); 1 of 4 ranks lost, tolerating up to 1\n"));
  EXPECT_THAT(run.err, testing::ContainsRegex(
                           "qring-launch: finished with 1 of 4 ranks lost \\(tolerating up to "
                           "1\\): rank 2 \\(pid [0-9]+\\) was killed by signal 9 \\(SIGKILL\\); "
                           "exit status 101\n"));
  EXPECT_THAT(run.err, Not(HasSubstr("stopping the other ranks")));
  for (int r : {0, 1, 3})
    EXPECT_THAT(run.out, HasSubstr(fmt::format("[rank {}] finished-{} tolerate=1\n", r, r)));
  EXPECT_THAT(run.out, Not(HasSubstr("finished-2")));
}

// --max-restarts N: a rank that fails is started again (QRING_RESTART counts), up to N times,
// with the failure and the restart in the output; the job then succeeds. Every rank is told
// that the store lives in the launcher.
TEST(Launch, RestartsAFailedRank) {
  LaunchRun run({"-n", "3", "--max-restarts", "2", "--", "sh", "-c",
                 "if [ $QRING_RANK = 1 ] && [ $QRING_RESTART -lt 2 ]; then kill -9 $$; fi; "
                 "echo done-$QRING_RANK restart=$QRING_RESTART hosted=$QRING_STORE_HOSTED"});
  EXPECT_EQ(run.finish(), 0) << run.out << run.err;
  EXPECT_THAT(run.err, testing::ContainsRegex(
                           "qring-launch: rank 1 \\(pid [0-9]+\\) was killed by signal 9 "
                           "\\(SIGKILL\\); restarting it \\(restart 1 of 2\\)\n"));
  EXPECT_THAT(run.err, testing::ContainsRegex("restarting it \\(restart 2 of 2\\)\n"));
  EXPECT_THAT(run.err, testing::ContainsRegex("qring-launch: rank 1 restarted \\(pid [0-9]+\\)"));
  EXPECT_THAT(run.out, HasSubstr("[rank 1] done-1 restart=2 hosted=1\n"));
  EXPECT_THAT(run.out, HasSubstr("[rank 0] done-0 restart=0 hosted=1\n"));
  EXPECT_THAT(run.out, Not(HasSubstr("done-1 restart=0")));
}

// Beyond its restarts a rank fails the job as without the flag (fail-fast), or is lost under
// --tolerate-failures.
TEST(Launch, RestartsRunOut) {
  LaunchRun run({"-n", "2", "--max-restarts", "1", "--", "sh", "-c",
                 "if [ $QRING_RANK = 1 ]; then exit 3; fi; sleep 30"});
  EXPECT_EQ(run.finish(), 3) << run.err;
  EXPECT_LT(run.elapsed, 8s);
  EXPECT_THAT(run.err, HasSubstr("exited with status 3; restarting it (restart 1 of 1)"));
  EXPECT_THAT(run.err, HasSubstr("rank 1 exited with status 3; stopping the other ranks"));

  LaunchRun tolerant({"-n", "3", "--max-restarts", "1", "--tolerate-failures", "1", "--", "sh",
                      "-c", "if [ $QRING_RANK = 2 ]; then exit 4; fi; sleep 0.5"});
  EXPECT_EQ(tolerant.finish(), 101) << tolerant.err;
  EXPECT_THAT(tolerant.err, HasSubstr("restarting it (restart 1 of 1)"));
  EXPECT_THAT(tolerant.err, HasSubstr("1 of 3 ranks lost, tolerating up to 1"));
}

// Once a rank exits 74 (qring-train: the job is lost) no rank is restarted: rank 3 dies at
// once and is restarted; rank 0 then reports the job lost; rank 3's second incarnation dies
// 1 s after rank 0 is gone, and stays down, named with why. The job ends with the job-lost status.
TEST(Launch, NoRestartIntoALostJob) {
  TempDir dir;
  // Every wait is bounded (200 x 50 ms): a broken launcher fails the test, it does not hang it.
  const std::string script = fmt::format(
      "w() {{ for i in $(seq 200); do [ -e $1 ] && return; sleep 0.05; done; }}; "
      "case $QRING_RANK in "
      "0) w {0}/3.back; echo $$ > {0}/0.pid; exit 74;; "
      "3) [ $QRING_RESTART = 0 ] && exit 1; echo > {0}/3.back; w {0}/0.pid; "
      "while kill -0 $(cat {0}/0.pid) 2>/dev/null; do sleep 0.05; done; sleep 1; "
      "echo > {0}/3.done; exit 1;; "
      "esac; w {0}/3.done; sleep 0.5; exit 74",
      dir.path);
  LaunchRun run({"-n", "4", "--max-restarts", "5", "--tolerate-failures", "3", "--", "sh", "-c",
                 script});
  EXPECT_EQ(run.finish(15s), 74) << run.err;
  EXPECT_LT(run.elapsed, 10s);
  EXPECT_THAT(run.err, HasSubstr("exited with status 1; restarting it (restart 1 of 5)"));
  EXPECT_THAT(run.err, HasSubstr("rank 0 exited with status 74: the job is lost; no rank is "
                                 "restarted from now on"));
  EXPECT_THAT(run.err, testing::ContainsRegex(
                           "rank 3 \\(pid [0-9]+\\) exited with status 1; not restarting it "
                           "\\(rank 0 exited with status 74: the job is lost\\)"));
  EXPECT_THAT(run.err, Not(HasSubstr("restart 2 of 5")));
}

TEST(Launch, BadMaxRestartsIsAUsageError) {
  for (const char* v : {"-1", "x", "1001"}) {
    LaunchRun run({"-n", "2", "--max-restarts", v, "--", "true"});
    EXPECT_EQ(run.finish(), 2) << v;
    EXPECT_THAT(run.err, HasSubstr("--max-restarts expects an integer")) << v;
  }
}

// Exit status 75 is a rank evicted from the job: lost, named "evicted"; a second loss of
// another kind adds up (102).
TEST(Launch, EvictedRankCountsAsLost) {
  LaunchRun run({"-n", "4", "--tolerate-failures", "2", "--", "sh", "-c",
                 "case $QRING_RANK in 1) exit 75;; 3) sleep 0.2; exit 3;; esac; sleep 0.5; "
                 "echo finished-$QRING_RANK"});
  EXPECT_EQ(run.finish(), 102) << run.out << run.err;
  EXPECT_LT(run.elapsed, 5s);
  EXPECT_THAT(run.err, testing::ContainsRegex("qring-launch: rank 1 \\(pid [0-9]+\\) was evicted "
                                              "\\(exit status 75\\); [12] of 4 ranks lost, "
                                              "tolerating up to 2\n"));
  EXPECT_THAT(run.err,
              testing::ContainsRegex("qring-launch: rank 3 \\(pid [0-9]+\\) exited with "
                                     "status 3; [12] of 4 ranks lost, tolerating up to 2"));
  EXPECT_THAT(run.err, HasSubstr("qring-launch: finished with 2 of 4 ranks lost"));
  EXPECT_THAT(run.err, testing::ContainsRegex("rank 1 \\(pid [0-9]+\\) was evicted \\(exit "
                                              "status 75\\).*exit status 102\n"));
  for (int r : {0, 2})
    EXPECT_THAT(run.out, HasSubstr(fmt::format("[rank {}] finished-{}\n", r, r)));
}

// More losses than tolerated: fail-fast as without the flag; the status is the failing rank's,
// never one of the degraded-success statuses.
TEST(Launch, TooManyLostRanksStopTheOthers) {
  LaunchRun run({"-n", "4", "--tolerate-failures", "1", "--", "sh", "-c",
                 "case $QRING_RANK in 1) exit 3;; 2) sleep 0.2; exit 4;; esac; sleep 30; "
                 "echo finished-$QRING_RANK"});
  int code = run.finish();
  EXPECT_THAT(code, testing::AnyOf(3, 4)) << run.err;  // whichever loss was reaped second
  EXPECT_LT(run.elapsed, 5s);                          // the sleep 30 ranks were stopped
  EXPECT_THAT(run.err, HasSubstr("1 of 4 ranks lost, tolerating up to 1\n"));
  EXPECT_THAT(run.err,
              HasSubstr("2 of 4 ranks lost, more than the 1 tolerated; stopping the other ranks"));
  EXPECT_THAT(run.err, Not(HasSubstr("finished with")));
  EXPECT_THAT(run.out, Not(HasSubstr("finished-")));

  // A failing status inside the degraded-success range is reported as 1.
  LaunchRun clash({"-n", "3", "--tolerate-failures", "1", "--", "sh", "-c",
                   "case $QRING_RANK in 0) exit 101;; 1) sleep 0.2; exit 101;; esac; sleep 30"});
  EXPECT_EQ(clash.finish(), 1) << clash.err;
  EXPECT_LT(clash.elapsed, 5s);
}

// Signal forwarding is unchanged with --tolerate-failures: ranks ended by the forwarded
// SIGTERM are not "lost", the launcher exits 128 + SIGTERM.
TEST(Launch, ForwardsSigtermWhileTolerating) {
  LaunchRun run({"-n", "3", "--tolerate-failures", "1", "--", "sh", "-c",
                 "if [ $QRING_RANK = 2 ]; then exit 5; fi; trap 'echo got-term; exit 7' TERM; "
                 "echo ready; while :; do sleep 0.05; done"});
  ASSERT_TRUE(run.read_until(
      [&] {
        return run.out.find("[rank 0] ready") != std::string::npos &&
               run.out.find("[rank 1] ready") != std::string::npos &&
               run.err.find("1 of 3 ranks lost") != std::string::npos;
      },
      5s))
      << run.out << run.err;
  kill(run.pid(), SIGTERM);
  EXPECT_EQ(run.finish(), 128 + SIGTERM);
  EXPECT_LT(run.elapsed, 5s);
  EXPECT_THAT(run.out, HasSubstr("[rank 0] got-term"));
  EXPECT_THAT(run.out, HasSubstr("[rank 1] got-term"));
  EXPECT_THAT(run.err, HasSubstr("received SIGTERM"));
  EXPECT_THAT(run.err, Not(HasSubstr("2 of 3 ranks lost")));
}

// The end of a job: a rank stopped (SIGSTOP) and never continued does not keep the launcher
// from exiting once the others finished: it is killed after 2 s stopped, reported with the
// rank finished first, and counted lost (exit 100 + 1, also without --tolerate-failures).
TEST(Launch, RankStoppedAtTheEndIsKilledAndReported) {
  LaunchRun run({"-n", "3", "--max-restarts", "2", "--", "sh", "-c",
                 "if [ $QRING_RANK = 1 ]; then kill -STOP $$; echo resumed; fi; sleep 0.3; "
                 "echo finished-$QRING_RANK"});
  EXPECT_EQ(run.finish(15s), 101) << run.out << run.err;
  EXPECT_GE(run.elapsed, 2s);
  EXPECT_LT(run.elapsed, 10s);  // a loaded machine (load 20 on 2 cores) adds seconds
  EXPECT_THAT(run.err, testing::ContainsRegex(
                           "qring-launch: rank 1 \\(pid [0-9]+\\) was stopped \\(SIGSTOP\\) for "
                           "2\\.[0-9] s after rank [02] finished the job; killing it\n"));
  EXPECT_THAT(run.err, testing::ContainsRegex(
                           "qring-launch: finished with 1 of 3 ranks lost: rank 1 \\(pid [0-9]+\\) "
                           "was stopped .*; killed by the launcher; exit status 101\n"));
  EXPECT_THAT(run.err, Not(HasSubstr("restarting")));  // the job is over: nothing to rejoin
  EXPECT_THAT(run.out, Not(HasSubstr("resumed")));
  for (int r : {0, 2}) EXPECT_THAT(run.out, HasSubstr(fmt::format("finished-{}\n", r)));
}

// A rank that still runs --finish-grace-s after another finished (hung) is killed too; one
// stopped for less than 2 s (a frozen straggler, continued) is not.
TEST(Launch, HungRankAtTheEndIsKilledButAShortStopIsNot) {
  LaunchRun hung({"-n", "2", "--finish-grace-s", "0.5", "--tolerate-failures", "1", "--", "sh",
                  "-c", "if [ $QRING_RANK = 1 ]; then sleep 30; fi; echo finished-$QRING_RANK"});
  EXPECT_EQ(hung.finish(10s), 101) << hung.out << hung.err;
  EXPECT_LT(hung.elapsed, 8s);
  EXPECT_THAT(hung.err, testing::ContainsRegex(
                            "rank 1 \\(pid [0-9]+\\) was still running \\(hung\\) 0\\.[5-9] s "
                            "after rank 0 finished the job \\(--finish-grace-s\\); killing it\n"));
  EXPECT_THAT(hung.err, HasSubstr("finished with 1 of 2 ranks lost (tolerating up to 1)"));

  TempDir dir;
  const std::string script = fmt::format(
      "case $QRING_RANK in "
      "1) echo $$ > {0}/1.pid; kill -STOP $$; sleep 0.2; echo resumed;; "
      "0) while [ ! -s {0}/1.pid ]; do sleep 0.05; done; sleep 0.5; kill -CONT $(cat {0}/1.pid);; "
      "esac; echo finished-$QRING_RANK",
      dir.path);
  LaunchRun brief({"-n", "3", "--", "sh", "-c", script});
  EXPECT_EQ(brief.finish(10s), 0) << brief.out << brief.err;
  EXPECT_THAT(brief.out, HasSubstr("[rank 1] resumed"));
  EXPECT_THAT(brief.err, Not(HasSubstr("killing it")));
}

TEST(Launch, OverallTimeout) {
  LaunchRun run({"-n", "2", "--timeout-s", "0.3", "--", "sleep", "30"});
  EXPECT_EQ(run.finish(), 124);
  EXPECT_LT(run.elapsed, 5s);
  EXPECT_THAT(run.err, HasSubstr("timeout of 0.3 s expired"));
}

// --bind cores (the default) gives each rank its share of the launcher's CPUs (QRING_CPUS and
// the affinity that nproc reports agree); --bind none leaves every rank on all of them.
TEST(Launch, BindsEachRankToItsShareOfTheCpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  const int m = static_cast<int>(cpus.size());
  const char* show = "echo \"cpus=$QRING_CPUS n=$(nproc)\"";

  // More ranks than CPUs: rank r on CPU r mod m alone.
  const int n = 2 * m;
  LaunchRun over({"-n", std::to_string(n), "--", "sh", "-c", show});
  EXPECT_EQ(over.finish(), 0);
  for (int r = 0; r < n; ++r)
    EXPECT_THAT(over.out, HasSubstr(fmt::format("[rank {}] cpus={} n=1\n", r, cpus[size_t(r % m)])))
        << over.out;

  // One rank: all of them.
  LaunchRun one({"-n", "1", "--", "sh", "-c", show});
  EXPECT_EQ(one.finish(), 0);
  EXPECT_THAT(one.out, HasSubstr(fmt::format("[rank 0] cpus={} n={}\n", fmt::join(cpus, ","), m)));

  // Unbound: every rank may use every CPU, and QRING_CPUS is not set (not even inherited).
  LaunchRun none({"-n", std::to_string(n), "--bind", "none", "--", "sh", "-c", show},
                 "QRING_CPUS=99");
  EXPECT_EQ(none.finish(), 0);
  for (int r = 0; r < n; ++r)
    EXPECT_THAT(none.out, HasSubstr(fmt::format("[rank {}] cpus= n={}\n", r, m))) << none.out;

  LaunchRun bad({"-n", "1", "--bind", "sockets", "--", "true"});
  EXPECT_EQ(bad.finish(), 2);
  EXPECT_THAT(bad.err, HasSubstr("--bind expects 'cores' or 'none', got 'sockets'"));
}

TEST(Launch, SuccessAndUsageErrors) {
  LaunchRun ok({"-n", "4", "--", "true"});
  EXPECT_EQ(ok.finish(), 0);
  LaunchRun missing_exec({"-n", "1", "--", "/nonexistent/qring-cmd"});
  EXPECT_EQ(missing_exec.finish(), 127);
  EXPECT_THAT(missing_exec.err, HasSubstr("cannot execute '/nonexistent/qring-cmd'"));
  LaunchRun no_n({"--", "true"});
  EXPECT_EQ(no_n.finish(), 2);
  EXPECT_THAT(no_n.err, HasSubstr("-n N is required"));
  LaunchRun no_cmd({"-n", "2"});
  EXPECT_EQ(no_cmd.finish(), 2);
  LaunchRun bad_n({"-n", "x", "--", "true"});
  EXPECT_EQ(bad_n.finish(), 2);
  LaunchRun tolerate_all({"-n", "2", "--tolerate-failures", "2", "--", "true"});
  EXPECT_EQ(tolerate_all.finish(), 2);
  EXPECT_THAT(tolerate_all.err, HasSubstr("--tolerate-failures 2 must be below -n 2"));
  LaunchRun tolerate_bad({"-n", "30", "--tolerate-failures=24", "--", "true"});
  EXPECT_EQ(tolerate_bad.finish(), 2);
  EXPECT_THAT(tolerate_bad.err, HasSubstr("--tolerate-failures expects an integer in [0, 23]"));
  LaunchRun unknown({"-n", "1", "--bogus", "--", "true"});
  EXPECT_EQ(unknown.finish(), 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown option '--bogus'"));
}

// Runs only as a rank under qring-launch (see LaunchedRanksRendezvous): bootstraps from the
// launcher's environment and rendezvouses over TCP.
TEST(LaunchChild, Rendezvous) {
  if (!std::getenv("QRING_TEST_LAUNCH_CHILD")) GTEST_SKIP() << "runs as a qring-launch rank";
  auto info = qring::net::detect_bootstrap();
  qring::net::Rendezvous rdv(info, qring::net::deadline_in(10s));
  rdv.store().set(fmt::format("hello/{}", info.rank), "x");
  for (int r = 0; r < info.world_size; ++r)
    rdv.store().get(fmt::format("hello/{}", r), qring::net::deadline_in(10s));
  std::printf("rank %d/%d source=%s hosts=%zu single=%d\n", info.rank, info.world_size,
              info.source.c_str(), rdv.hostnames().size(), rdv.single_host() ? 1 : 0);
}

// The shm regions (/dev/shm/<pid>:<n>:<m>) of this process.
std::vector<std::string> shm_regions_of(pid_t pid) {
  std::vector<std::string> out;
  const std::string prefix = fmt::format("{}:", pid);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().string());
  return out;
}

// Runs only as a rank under qring-launch (see DeadRanksLeaveNoShmRegions): opens pairwise shm
// endpoints (one region per peer), reports its pid in $QRING_TEST_LAUNCH_SHM/<rank>.pid, then
// rank 1 SIGKILLs itself once every rank has reported; rank 0 ignores SIGTERM, so that only
// the launcher's SIGKILL ends it; the others wait for the launcher's SIGTERM.
TEST(LaunchChild, ShmRegions) {
  const char* dir = std::getenv("QRING_TEST_LAUNCH_SHM");
  if (!dir) GTEST_SKIP() << "runs as a qring-launch rank";
  auto info = qring::net::detect_bootstrap();
  qring::net::Rendezvous rdv(info, qring::net::deadline_in(10s));
  qring::net::FabricOptions opts;
  opts.provider = "shm";
  opts.pairwise = qring::net::FabricOptions::Pairwise::kOn;
  auto ep = qring::net::make_fabric_endpoint(opts, info.rank, info.world_size, rdv.store(),
                                             rdv.single_host(), qring::net::deadline_in(10s));
  std::printf("regions=%zu\n", shm_regions_of(getpid()).size());
  std::fflush(stdout);
  {
    std::string tmp = fmt::format("{}/{}.tmp", dir, info.rank);
    std::ofstream(tmp) << getpid() << "\n";
    std::filesystem::rename(tmp, fmt::format("{}/{}.pid", dir, info.rank));
  }
  if (info.rank == 0) signal(SIGTERM, SIG_IGN);
  if (info.rank == 1) {
    auto deadline = Clock::now() + 10s;
    while (Clock::now() < deadline) {
      int n = 0;
      for (int r = 0; r < info.world_size; ++r)
        n += std::filesystem::exists(fmt::format("{}/{}.pid", dir, r)) ? 1 : 0;
      if (n == info.world_size) break;
      std::this_thread::sleep_for(10ms);
    }
    raise(SIGKILL);
  }
  std::this_thread::sleep_for(20s);
}

// A rank killed by SIGKILL cannot unlink its shm regions (16 MiB each); the launcher's side
// removes them, also those of a rank that ignored SIGTERM and was SIGKILLed with its group.
// A region of a dead process that was not of this job stays.
TEST(Launch, DeadRanksLeaveNoShmRegions) {
  TempDir dir;
  pid_t other = fork();
  if (other == 0) _exit(0);
  ASSERT_GT(other, 0);
  waitpid(other, nullptr, 0);
  const std::string decoy = fmt::format("/dev/shm/{}:0:0", other);
  std::ofstream(decoy) << "not this job's\n";
  ASSERT_TRUE(std::filesystem::exists(decoy));

  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string env = "QRING_TEST_LAUNCH_SHM=" + dir.path;
  LaunchRun run(
      {"-n", "3", "--timeout-s", "30", "--", self, "--gtest_filter=LaunchChild.ShmRegions"},
      env.c_str());
  EXPECT_EQ(run.finish(20s), 128 + SIGKILL) << run.out << run.err;
  EXPECT_LT(run.elapsed, 10s);
  auto pids = dir.pids(3);
  ASSERT_EQ(pids.size(), 3u) << run.out << run.err;
  for (int r = 0; r < 3; ++r)
    EXPECT_THAT(run.out, HasSubstr(fmt::format("[rank {}] regions=2\n", r))) << run.out;
  EXPECT_THAT(run.err,
              testing::ContainsRegex(fmt::format(
                  "removed 2 shared-memory regions that rank 1 \\(pid {}\\) left", pids[1])))
      << run.err;
  // Rank 0 ignored SIGTERM: SIGKILLed with its supervisor, so the launcher itself reaps it
  // (or the supervisor did, if it came first).
  EXPECT_THAT(run.err, HasSubstr("sending SIGKILL"));
  EXPECT_THAT(run.err, testing::ContainsRegex(fmt::format(
                           "removed 2 shared-memory regions that (a process of )?rank 0 \\(pid "
                           "{}\\) left",
                           pids[0])))
      << run.err;
  for (pid_t p : pids) {
    auto left = shm_regions_of(p);
    EXPECT_TRUE(left.empty()) << "left behind: " << fmt::format("{}", fmt::join(left, " "));
    for (const auto& f : left) std::filesystem::remove(f);
  }
  EXPECT_TRUE(std::filesystem::exists(decoy)) << "a region not of this job was removed";
  std::filesystem::remove(decoy);
}

// Processes whose command line contains `marker`.
int processes_with(const std::string& marker) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    std::ifstream in(e.path() / "cmdline");
    std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    if (cmd.find(marker) != std::string::npos) ++n;
  }
  return n;
}

// The tests' shell helper (tests/cli_harness.h) ends a command that hangs at its limit, at once
// rather than at ctest's timeout, with what it printed and status 137: a launcher and its ranks
// (process groups of their own), and a process that left the session and holds the output
// pipe (a plain `timeout` around the shell left it running, and the test waited for it).
TEST(Harness, ShKillsAHangingCommandAndAllItStartedAtTheLimit) {
  const std::string marker = fmt::format("{}.{}", 300 + getpid() % 1000, getpid());
  auto t0 = Clock::now();
  auto r = qring::testing::sh(std::string(kLauncher) +
                                  " -n 2 -- sh -c \"echo rank \\$QRING_RANK up; exec sleep " +
                                  marker + "\"",
                              2);
  EXPECT_LT(Clock::now() - t0, 6s);
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.status, 137) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 0 up")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 1 up")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("killed after 2 s, at the deadline")) << r.output;
  EXPECT_EQ(processes_with("sleep " + marker), 0) << "a rank outlived the deadline";

  t0 = Clock::now();
  r = qring::testing::sh("echo before; setsid sleep " + marker + " & wait", 2);
  EXPECT_LT(Clock::now() - t0, 6s);
  EXPECT_TRUE(r.timed_out);
  EXPECT_THAT(r.output, HasSubstr("before\n")) << r.output;
  EXPECT_EQ(processes_with("sleep " + marker), 0) << "a process of another session outlived it";

  auto ok = qring::testing::sh("echo out; echo err >&2; exit 3", 5);
  EXPECT_FALSE(ok.timed_out);
  EXPECT_EQ(ok.status, 3);
  EXPECT_EQ(ok.output, "out\nerr\n");
}

// Whatever limit a call asks for, it ends at the test's deadline: ctest's timeout
// (QRING_TEST_TIMEOUT_S, here 24 s) less 20 s after the test's start.
TEST(Harness, ShNeverRunsPastTheTestsDeadline) {
  const char* was = std::getenv("QRING_TEST_TIMEOUT_S");
  const std::string saved = was ? was : "";
  setenv("QRING_TEST_TIMEOUT_S", "24", 1);
  const auto t0 = Clock::now();
  auto r = qring::testing::sh("echo waiting; exec sleep 30", 60);
  const auto took = Clock::now() - t0;
  if (was) setenv("QRING_TEST_TIMEOUT_S", saved.c_str(), 1); else unsetenv("QRING_TEST_TIMEOUT_S");
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.output.rfind("waiting\n", 0), 0u) << r.output;
  EXPECT_GT(took, 2s);
  EXPECT_LT(took, 7s);
}

TEST(Launch, LaunchedRanksRendezvous) {
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  LaunchRun run(
      {"-n", "3", "--timeout-s", "30", "--", self, "--gtest_filter=LaunchChild.Rendezvous"},
      "QRING_TEST_LAUNCH_CHILD=1");
  EXPECT_EQ(run.finish(40s), 0) << run.out << run.err;
  for (int r = 0; r < 3; ++r)
    EXPECT_THAT(run.out,
                HasSubstr(fmt::format("[rank {}] rank {}/3 source=env hosts=3 single=1\n", r, r)));
}

}  // namespace
