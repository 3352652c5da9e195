#include "collectives/fault_inject.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "collectives/engine.h"
#include "collectives/spec_fields.h"
#include "net/base/error.h"
#include "net/transport/shm_region.h"

namespace qring::collectives {

namespace {
int64_t nonnegative_integer(std::string_view spec, const std::string& v, const char* what) {
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || errno || x < 0)
    throw ConfigError(fmt::format("fault '{}': {} '{}' is not a number >= 0", spec, what, v));
  return x;
}
}  // namespace

std::optional<FaultSpec> FaultSpec::parse(std::string_view spec) {
  if (spec.empty() || spec == "none") return std::nullopt;
  auto p = spec_fields(spec);
  FaultSpec f;
  size_t phase_at;
  if ((p[0] == "kill" || p[0] == "kill-locked" || p[0] == "kill-posting") &&
      (p.size() == 3 || p.size() == 4)) {
    f.action = p[0] == "kill"          ? Action::kKill
               : p[0] == "kill-locked" ? Action::kKillLocked
                                       : Action::kKillPosting;
    phase_at = 3;
  } else if ((p[0] == "stop" || p[0] == "stop-locked") && (p.size() == 4 || p.size() == 5)) {
    f.action = p[0] == "stop" ? Action::kStop : Action::kStopLocked;
    f.stop_ms = int(nonnegative_integer(spec, p[3], "pause (ms)"));
    phase_at = 4;
  } else {
    throw ConfigError(
        fmt::format("fault '{}': expected kill:RANK:STEP[:PHASE], kill-locked:RANK:STEP[:PHASE], "
                    "kill-posting:RANK:STEP[:PHASE], stop:RANK:STEP:MS[:PHASE] or "
                    "stop-locked:RANK:STEP:MS[:PHASE]",
                    spec));
  }
  f.rank = int(nonnegative_integer(spec, p[1], "rank"));
  f.step = uint64_t(nonnegative_integer(spec, p[2], "step"));
  if (p.size() > phase_at) f.phase = p[phase_at];
  if (f.phase != "step" && f.phase != "ready" && f.phase != "ring" && f.phase != "checkpoint" &&
      f.phase != "eval" && f.phase != "donate")
    throw ConfigError(fmt::format(
        "fault '{}': unknown phase '{}' (step, ready, ring, checkpoint, eval, donate)", spec,
        f.phase));
  return f;
}

std::vector<FaultSpec> FaultSpec::parse_list(std::string_view specs) {
  std::vector<FaultSpec> out;
  size_t at = 0;
  while (at <= specs.size()) {
    size_t c = specs.find(',', at);
    auto one = specs.substr(at, c == std::string_view::npos ? specs.npos : c - at);
    if (auto f = parse(one)) out.push_back(*f);
    if (c == std::string_view::npos) break;
    at = c + 1;
  }
  return out;
}

std::string FaultSpec::spec() const {
  if (action == Action::kKill) return fmt::format("kill:{}:{}:{}", rank, step, phase);
  if (action == Action::kKillLocked) return fmt::format("kill-locked:{}:{}:{}", rank, step, phase);
  if (action == Action::kKillPosting)
    return fmt::format("kill-posting:{}:{}:{}", rank, step, phase);
  return fmt::format("{}:{}:{}:{}:{}", action == Action::kStop ? "stop" : "stop-locked", rank,
                     step, stop_ms, phase);
}

void FaultSpec::inject(Engine* engine) const {
  std::unique_lock<std::mutex> hold;
  if (engine) hold = engine->hold_progress();
  // With the progress lock held no thread of this process is inside the provider, so the
  // region locks are free to take.
  if (action == Action::kKillLocked || action == Action::kStopLocked) net::take_own_shm_locks();
  if (action == Action::kKillPosting) net::take_a_peer_shm_lock();
  if (kills()) {
    ::kill(::getpid(), SIGKILL);
    ::pause();
  }
  const pid_t self = ::getpid();
  const pid_t waker = ::fork();
  if (waker == 0) {
    // Only async-signal-safe calls in the child of a threaded process.
    struct timespec ts{stop_ms / 1000, long(stop_ms % 1000) * 1000000L};
    while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    ::kill(self, SIGCONT);
    ::_exit(0);
  }
  ::kill(self, SIGSTOP);
  ::waitpid(waker, nullptr, 0);  // continued: the waker exits at once
  if (action == Action::kStopLocked) net::give_back_own_shm_locks();
}

}  // namespace qring::collectives
